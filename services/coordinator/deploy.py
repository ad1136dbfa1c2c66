"""`coordinatorctl deploy compose|k8s CONFIG`: container manifests for a run, from the same process plan.

Both generators take :func:`services.coordinator.plan.process_plan` (the function the local launcher uses), so a
server count or a GPU placement means the same thing in every launcher:

- one container per service process; env servers run from their simulator's image (a target of
  ``deploy/Dockerfile`` that builds the simulator's environment), every other role from the main image;
- the coordinator runs with ``cluster.launcher=attach``; every service gets the same resolved ``run.yaml`` and
  registers by its service name; the run secret (``RLFLEET_RUN_TOKEN``, generated) goes to the coordinator only,
  and each service gets its own credential issued from it in the same variable (rlfleet.wire.auth): per compose
  service (``rlfleet-<service>.env``), per role in Kubernetes (a Secret ``<run>-<role>-credential``: the pods of
  a StatefulSet share one template, so the credential names no index);
- ``cluster.component_placement`` becomes GPU requests: compose reserves the placed device ids, Kubernetes asks for
  as many ``nvidia.com/gpu`` as the process's range holds (a Kubernetes scheduler picks which);
- the run folder is a shared volume; the only published port is the coordinator's, on 127.0.0.1 (compose);
- restart policies: env and inference servers restart on failure (the coordinator republishes weights and
  re-collects); the learner is not restarted (``coordinatorctl start --resume`` continues a run);
- health: every container is probed with grpc.health.v1 (``python -m rlfleet.wire.healthcheck``, Kubernetes' native
  gRPC probes);
- a learner of several ranks runs torchrun's agent (``ProcessSpec.command``) over its node's GPUs (or CPU ranks),
  with a memory-backed /dev/shm: on one node in its container (compose) or pod (Kubernetes, ``nvidia.com/gpu`` =
  ranks per node); over several nodes (Kubernetes only) as an Indexed Job of one pod per node, whose completion
  index is the node rank, with a headless Service ``<learner>-ranks`` for the pods' names: pod 0
  (``learner-0.learner-ranks``) hosts the static rendezvous on ``cluster.learner_master_port`` and runs rank 0,
  the one that serves gRPC, which the ``learner`` Service selects alone.
"""

from __future__ import annotations

import os
import pathlib

import yaml
from omegaconf import OmegaConf

from rlfleet.config import ConfigError, to_yaml
from rlfleet.simulators.environments import REPO_ROOT
from rlfleet.wire import auth
from services.coordinator.plan import PORTS, ProcessSpec, process_plan

CONFIG_IN_CONTAINER = "/etc/rlfleet/run.yaml"
RUNS_IN_CONTAINER = "/runs"
GPU_BASE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
GPU_TORCH_INDEX = "https://download.pytorch.org/whl/cu128"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # an Indexed Job pod's index (annotation and label)
SHM_SIZE = "8gb"  # compose: /dev/shm of a learner of several ranks (NCCL's shared-memory transport; Docker gives 64 MB)


def attach_config(cfg):
    """The run config every container gets: attach launcher, coordinator on all interfaces, runs on the volume."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out.cluster.launcher = "attach"
    out.cluster.host = "0.0.0.0"
    out.cluster.coordinator_address = f"0.0.0.0:{PORTS['coordinator']}"
    out.runner.logger.log_path = RUNS_IN_CONTAINER
    return out


def uses_gpus(cfg) -> bool:
    return any(s.gpus for s in process_plan(cfg))


def images(cfg, tag: str | None = None) -> dict[str, dict]:
    """Image name -> Dockerfile build target and arguments (the main image, and one per simulator)."""
    gpu = uses_gpus(cfg)
    tag = tag or ("gpu" if gpu else "cpu")
    args = {
        "BASE_IMAGE": GPU_BASE if gpu else "python:3.11-slim-bookworm",
        "TORCH_INDEX_URL": GPU_TORCH_INDEX if gpu else CPU_TORCH_INDEX,
    }
    from rlfleet.data.loggers import logger_backend

    loggers = [n for n in dict.fromkeys(cfg.runner.logger.logger_backends) if logger_backend(n).module]
    # the learner's optional logger packages (wandb, swanlab) go into the main image
    out = {
        f"rlfleet:{tag}": {"target": "rlfleet", "args": {**args, **({"LOGGERS": " ".join(loggers)} if loggers else {})}}
    }
    for name in sorted({n for s in process_plan(cfg) if (n := own_environment(cfg, s))}):
        out[f"rlfleet-{name}:{tag}"] = {"target": "simulator", "args": {**args, "SIMULATOR": name}}
    return out


def own_environment(cfg, spec: ProcessSpec | None) -> str | None:
    """The name of the Python environment a service process runs from when it is not the main one: an env
    server's simulator (metaworld, ...) or an inference server's backend (vllm); None for the main one."""
    from rlfleet.policies.backends import get_backend
    from rlfleet.simulators import get_simulator

    if spec is None:
        return None
    if spec.simulator and get_simulator(spec.simulator).environment is not None:
        return spec.simulator
    if spec.role == "inference" and get_backend(cfg.rollout.backend).environment is not None:
        return cfg.rollout.backend
    return None


def image_for(cfg, spec: ProcessSpec | None, tag: str | None = None) -> str:
    tag = tag or ("gpu" if uses_gpus(cfg) else "cpu")
    name = own_environment(cfg, spec)
    return f"rlfleet-{name}:{tag}" if name else f"rlfleet:{tag}"


def service_command(cfg, spec: ProcessSpec, host: str, master: str | None = None, node_rank: str = "0") -> list[str]:
    """The container command of one service process; ``host`` is the name others reach it by. A learner of several
    ranks runs torchrun's agent (``ProcessSpec.command``); over several nodes ``master`` is node 0's rendezvous
    ``host:port`` and ``node_rank`` this container's node rank."""
    port = PORTS[spec.role]
    run_dir = f"{RUNS_IN_CONTAINER}/{cfg.runner.experiment_name}"
    cmd = spec.command(
        CONFIG_IN_CONTAINER,
        f"0.0.0.0:{port}",
        f"coordinator:{PORTS['coordinator']}",
        run_dir,
        advertise=f"{host}:{port}",
        master=master,
        node_rank=node_rank,
    )
    name = own_environment(cfg, spec)
    if name:  # the simulator's (or inference backend's) own Python environment, built into its image
        return ["python", "-m", "services.env.environment", "exec", name, *cmd]
    return ["python", *cmd]


def _healthcheck(port: int) -> list[str]:
    return ["CMD", "python", "-m", "rlfleet.wire.healthcheck", f"127.0.0.1:{port}"]


# --- docker compose ----------------------------------------------------------------------------------------------
def credential_file(spec: ProcessSpec) -> str:
    """The env file of one compose service: RLFLEET_RUN_TOKEN=<its credential> (rlfleet.wire.auth.issue)."""
    return f"rlfleet-{spec.name}.env"


def check_compose(cfg) -> None:
    """Raise ConfigError for what one compose project cannot run: a learner whose ranks span several nodes."""
    for spec in process_plan(cfg):
        if spec.nnodes > 1:
            raise ConfigError(
                f"'cluster.component_placement': the learner's {spec.world_size} ranks span {spec.nnodes} nodes "
                f"({spec.nproc_per_node} GPUs each), and a compose project runs on one machine: use `coordinatorctl "
                f"deploy k8s` (an Indexed Job, one learner pod per node), or place the actor on one node's GPUs"
            )


def compose(cfg, out_dir: pathlib.Path, tag: str | None = None) -> dict:
    """The compose document for ``cfg``; image builds are relative to the repository."""
    check_compose(cfg)
    context = os.path.relpath(REPO_ROOT, out_dir.resolve())
    common_env = {
        "MUJOCO_GL": "egl",
        "OMP_NUM_THREADS": str(cfg.cluster.torch_num_threads),
        "RLFLEET_TRACE_DIR": f"{RUNS_IN_CONTAINER}/{cfg.runner.experiment_name}/traces",
    }
    volumes = ["./run.yaml:/etc/rlfleet/run.yaml:ro", f"./runs:{RUNS_IN_CONTAINER}"]
    builds = images(cfg, tag)
    services: dict[str, dict] = {}

    def base(image: str) -> dict:
        return {
            "image": image,
            "build": {
                "context": context,
                "dockerfile": "deploy/Dockerfile",
                "target": builds[image]["target"],
                "args": builds[image]["args"],
            },
            "env_file": ["rlfleet.env"],
            "environment": dict(common_env),
            "volumes": list(volumes),
        }

    coordinator = base(image_for(cfg, None, tag))
    coordinator.update(
        {
            "command": ["coordinatorctl", "start", CONFIG_IN_CONTAINER],
            "ports": [f"127.0.0.1:{PORTS['coordinator']}:{PORTS['coordinator']}"],
            "restart": "no",
            "healthcheck": {
                "test": _healthcheck(PORTS["coordinator"]),
                "interval": "10s",
                "timeout": "5s",
                "retries": 3,
            },
        }
    )
    services["coordinator"] = coordinator
    for spec in process_plan(cfg):
        svc = base(image_for(cfg, spec, tag))
        svc["env_file"] = [credential_file(spec)]  # its own credential, not the run secret
        svc.update(
            {
                "command": service_command(cfg, spec, spec.name),
                "restart": "no" if spec.role == "learner" else "on-failure",
                "depends_on": ["coordinator"],
                "healthcheck": {
                    "test": _healthcheck(PORTS[spec.role]),
                    "interval": "10s",
                    "timeout": "5s",
                    "retries": 3,
                    "start_period": "60s",
                },
            }
        )
        if spec.gpus:
            svc["deploy"] = {
                "resources": {
                    "reservations": {
                        "devices": [
                            {
                                "driver": "nvidia",
                                "device_ids": [str(g % cfg.cluster.num_gpus_per_node) for g in spec.gpus],
                                "capabilities": ["gpu"],
                            }
                        ]
                    }
                }
            }
        if spec.world_size > 1:  # the ranks' shared memory (NCCL)
            svc["shm_size"] = SHM_SIZE
        services[spec.name] = svc
    return {"version": "3.8", "services": services}


# --- Kubernetes --------------------------------------------------------------------------------------------------
def k8s(cfg, tag: str | None = None, namespace: str = "rlfleet", storage: str = "20Gi") -> list[dict]:
    """Kubernetes objects: Secret (token), ConfigMap (run.yaml), PVC (runs), the coordinator Job + Service,
    and per role (per simulator for env servers) a StatefulSet with a headless Service (stable names
    ``<role>-<i>.<role>``; the pod index is the service index); a learner over several nodes instead: an Indexed
    Job (:func:`_learner_job`)."""
    name = str(cfg.runner.experiment_name).replace("_", "-").lower()
    labels = {"app.kubernetes.io/part-of": "rlfleet", "rlfleet/run": name}
    secret = auth.new_token()
    roles = list(dict.fromkeys(spec.role for spec in process_plan(cfg)))
    # the run secret for the coordinator; per role a credential issued from it, for any index of the role
    objs: list[dict] = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-token", "namespace": namespace, "labels": labels},
            "type": "Opaque",
            "stringData": {auth.TOKEN_ENV: secret},
        },
        *(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{name}-{role}-credential", "namespace": namespace, "labels": labels},
                "type": "Opaque",
                "stringData": {auth.TOKEN_ENV: auth.issue(secret, role)},
            }
            for role in roles
        ),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", "namespace": namespace, "labels": labels},
            "data": {"run.yaml": to_yaml(attach_config(cfg))},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{name}-runs", "namespace": namespace, "labels": labels},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}},
        },
    ]

    def token_env(secret_name: str) -> dict:
        return {"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": auth.TOKEN_ENV}}}

    common = [
        {"name": "RLFLEET_TRACE_DIR", "value": f"{RUNS_IN_CONTAINER}/{cfg.runner.experiment_name}/traces"},
        {"name": "MUJOCO_GL", "value": "egl"},
        {"name": "OMP_NUM_THREADS", "value": str(cfg.cluster.torch_num_threads)},
    ]
    env = [token_env(f"{name}-token"), *common]  # the coordinator's

    def role_env(role: str) -> list[dict]:
        return [token_env(f"{name}-{role}-credential"), *common]

    mounts = [
        {"name": "config", "mountPath": "/etc/rlfleet", "readOnly": True},
        {"name": "runs", "mountPath": RUNS_IN_CONTAINER},
    ]
    volumes = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}},
    ]

    def probes(port: int) -> dict:
        return {
            "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 10},
            "livenessProbe": {
                "grpc": {"port": port},
                "periodSeconds": 20,
                "failureThreshold": 3,
                "initialDelaySeconds": 60,
            },
        }

    def pod(container: dict) -> dict:
        return {"containers": [container], "volumes": volumes, "enableServiceLinks": False}

    def with_shm(pod_spec: dict) -> dict:  # a learner of several ranks: memory-backed /dev/shm (NCCL)
        container = pod_spec["containers"][0]
        container["volumeMounts"] = [*container["volumeMounts"], {"name": "dshm", "mountPath": "/dev/shm"}]
        return {**pod_spec, "volumes": [*pod_spec["volumes"], {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}

    cport = PORTS["coordinator"]
    coord_labels = {**labels, "rlfleet/role": "coordinator"}
    # the coordinator is the run: a Job (a finished run is not started again), reachable as service "coordinator"
    objs.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "coordinator", "namespace": namespace, "labels": coord_labels},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": coord_labels},
                    "spec": {
                        **pod(
                            {
                                "name": "coordinator",
                                "image": image_for(cfg, None, tag),
                                "command": ["coordinatorctl", "start", CONFIG_IN_CONTAINER],
                                "ports": [{"containerPort": cport, "name": "grpc"}],
                                "env": env,
                                "volumeMounts": mounts,
                                **probes(cport),
                            }
                        ),
                        "restartPolicy": "Never",
                    },
                },
            },
        }
    )
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "coordinator", "namespace": namespace, "labels": coord_labels},
            "spec": {"selector": coord_labels, "ports": [{"name": "grpc", "port": cport, "targetPort": cport}]},
        }
    )
    # one StatefulSet per role, or per run of consecutive env servers on one simulator (env.per_server): pods
    # <set>-<i> with i the service index (spec.ordinals.start = the run's first index)
    groups: list[list[ProcessSpec]] = []
    for spec in process_plan(cfg):
        if groups and (groups[-1][0].role, groups[-1][0].simulator) == (spec.role, spec.simulator):
            groups[-1].append(spec)
        else:
            groups.append([spec])
    per_role = {}
    for specs in groups:
        per_role[specs[0].role] = per_role.get(specs[0].role, 0) + 1
    for specs in groups:
        first = specs[0]
        role = first.role
        port = PORTS[role]
        set_name = role if per_role[role] == 1 else f"{role}-{first.index}-{first.simulator or 'main'}"
        set_labels = {**labels, "rlfleet/role": role}
        if first.nnodes > 1:
            objs += _learner_job(
                cfg,
                first,
                set_name,
                set_labels,
                namespace,
                image_for(cfg, first, tag),
                role_env(role),
                with_shm(pod({"name": role, "volumeMounts": mounts})),
            )
            continue
        cmd = service_command(cfg, first, f"$(POD_NAME).{set_name}")
        cmd = [("$(POD_INDEX)" if a == str(first.index) and cmd[i - 1] == "--index" else a) for i, a in enumerate(cmd)]
        container = {
            "name": role,
            "image": image_for(cfg, first, tag),
            "command": cmd,
            "ports": [{"containerPort": port, "name": "grpc"}],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {
                    "name": "POD_INDEX",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
                },
                *role_env(role),
            ],
            "volumeMounts": mounts,
            **probes(port),
        }
        gpus = max(len(s.gpus) for s in specs)
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        pod_spec = with_shm(pod(container)) if first.world_size > 1 else pod(container)
        objs.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": {"name": set_name, "namespace": namespace, "labels": set_labels},
                "spec": {
                    "serviceName": set_name,
                    "replicas": len(specs),
                    "podManagementPolicy": "Parallel",
                    **({"ordinals": {"start": first.index}} if first.index else {}),
                    "selector": {"matchLabels": set_labels},
                    "template": {"metadata": {"labels": set_labels}, "spec": pod_spec},
                },
            }
        )
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": set_name, "namespace": namespace, "labels": set_labels},
                "spec": {
                    "clusterIP": "None",
                    "selector": set_labels,
                    "ports": [{"name": "grpc", "port": port, "targetPort": port}],
                },
            }
        )
    return objs


def _learner_job(
    cfg, spec: ProcessSpec, job: str, labels: dict, namespace: str, image: str, env: list[dict], pod_spec: dict
) -> list[dict]:
    """A learner whose ranks span ``spec.nnodes`` nodes: an Indexed Job of one pod per node (completion index =
    node rank; hostname ``<job>-<index>``), a headless Service ``<job>-ranks`` that gives the pods DNS names
    (published before they are ready: the rendezvous comes first), and the learner's gRPC Service ``<job>``,
    which selects pod 0 only: rank 0 serves gRPC, the other ranks follow it through collectives. Each pod runs
    torchrun's agent over its node's GPUs; node 0 hosts the static rendezvous on cluster.learner_master_port. A
    failed pod fails the Job (backoffLimit 0), which stops the others: the run then stops with its resume command.
    Torchrun's settings are also in its PET_* variables (the names Kubeflow's PyTorchJob gives them)."""
    port, mport = PORTS[spec.role], int(cfg.cluster.learner_master_port)
    ranks_svc = f"{job}-ranks"
    master = f"{job}-0.{ranks_svc}"  # pod 0 (node rank 0, hence rank 0)
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
    # probes: only pod 0 serves gRPC; the others pass (their health is the group's: a dead rank ends it)
    probe = ["sh", "-c", f'test "$NODE_RANK" != 0 || exec python -m rlfleet.wire.healthcheck 127.0.0.1:{port}']
    container = {
        "name": spec.role,
        "image": image,
        "command": service_command(cfg, spec, master, master=f"{master}:{mport}", node_rank="$(NODE_RANK)"),
        "ports": [{"containerPort": port, "name": "grpc"}, {"containerPort": mport, "name": "rendezvous"}],
        "env": [
            {"name": "NODE_RANK", "valueFrom": index},
            {"name": "PET_NNODES", "value": str(spec.nnodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(spec.nproc_per_node)},
            {"name": "PET_NODE_RANK", "valueFrom": index},
            {"name": "PET_MASTER_ADDR", "value": master},
            {"name": "PET_MASTER_PORT", "value": str(mport)},
            *env,
        ],
        "volumeMounts": pod_spec["containers"][0]["volumeMounts"],
        "readinessProbe": {"exec": {"command": probe}, "periodSeconds": 10, "timeoutSeconds": 10},
        "livenessProbe": {
            "exec": {"command": probe},
            "periodSeconds": 20,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
            "initialDelaySeconds": 60,
        },
    }
    if spec.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.nproc_per_node}}
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job, "namespace": namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed",
                "completions": spec.nnodes,
                "parallelism": spec.nnodes,
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {**pod_spec, "containers": [container], "subdomain": ranks_svc, "restartPolicy": "Never"},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ranks_svc, "namespace": namespace, "labels": labels},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": labels,
                "ports": [{"name": "rendezvous", "port": mport, "targetPort": mport}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": job, "namespace": namespace, "labels": labels},
            "spec": {
                "clusterIP": "None",
                "selector": {**labels, COMPLETION_INDEX: "0"},
                "ports": [{"name": "grpc", "port": port, "targetPort": port}],
            },
        },
    ]


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people: no anchors/aliases, multi-line strings (run.yaml) as literal blocks."""

    def ignore_aliases(self, data):
        return True


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def write(kind: str, cfg, out_dir: pathlib.Path, tag: str | None = None) -> list[pathlib.Path]:
    """Write the manifests of ``kind`` (compose | k8s) into ``out_dir``; -> the files written."""
    if kind == "compose":
        check_compose(cfg)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if kind == "compose":
        (out_dir / "run.yaml").write_text(to_yaml(attach_config(cfg)))
        token = auth.token_from_env() or auth.new_token()
        if auth.is_credential(token):
            raise ConfigError(f"{auth.TOKEN_ENV}: holds a service credential; deploy needs the run secret")

        def private(path: pathlib.Path, text: str) -> pathlib.Path:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return path

        env_file = private(out_dir / "rlfleet.env", f"{auth.TOKEN_ENV}={token}\n")  # the coordinator's: the secret
        credentials = [
            private(out_dir / credential_file(spec), f"{auth.TOKEN_ENV}={auth.issue(token, spec.role, spec.index)}\n")
            for spec in process_plan(cfg)
        ]
        (out_dir / "runs").mkdir(exist_ok=True)
        doc = compose(cfg, out_dir, tag)
        path = out_dir / "docker-compose.yml"
        path.write_text(
            f"# generated by `coordinatorctl deploy compose` for {cfg.runner.experiment_name}\n"
            f"# docker-compose up --build   (the run secret is in rlfleet.env, for the coordinator and "
            f"coordinatorctl; each service's own credential in rlfleet-<service>.env)\n"
            + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)
        )
        written = [path, out_dir / "run.yaml", env_file, *credentials]
    elif kind == "k8s":
        path = out_dir / "rlfleet-k8s.yaml"
        path.write_text(
            f"# generated by `coordinatorctl deploy k8s` for {cfg.runner.experiment_name}\n"
            f"# kubectl apply -f {path.name}\n"
            + yaml.dump_all(k8s(cfg, tag), Dumper=_Dumper, sort_keys=False, width=120)
        )
        written = [path]
    else:
        raise ValueError(f"deploy: '{kind}' is not one of compose, k8s")
    return written
