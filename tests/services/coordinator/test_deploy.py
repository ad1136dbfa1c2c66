"""`coordinatorctl deploy`: compose and Kubernetes manifests from the process plan (no cluster, no Docker)."""

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from rlfleet.config import load_config
from services.coordinator import deploy
from services.coordinator.plan import process_plan


def k8s_docs(cfg, out) -> list[dict]:
    """`coordinatorctl deploy k8s` of ``cfg`` into ``out``: its documents, each validated offline (strict, 1.33)."""
    (path,) = deploy.write("k8s", cfg, out)
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    return docs


GPU_RUN = [
    "cluster.num_env_servers=2",
    "cluster.num_inference_servers=1",
    "cluster.num_gpus_per_node=8",
    "cluster.component_placement={env: 0-3, rollout: 4-7, actor: 0-7}",
]


def test_the_plan_lists_every_process_with_its_gpus():
    plan = {s.name: s for s in process_plan(load_config(None, GPU_RUN))}
    assert list(plan) == ["learner-0", "inference-0", "env-0", "env-1"]
    assert plan["env-1"].gpus == (2, 3) and plan["env-1"].cuda_visible_devices == "2,3"
    assert plan["inference-0"].gpus == (4, 5, 6, 7) and plan["learner-0"].gpus == tuple(range(8))
    assert plan["env-0"].simulator == "gym"


def test_k8s_manifests_validate_and_map_the_placement(tmp_path):
    cfg = load_config(None, GPU_RUN)
    docs = k8s_docs(cfg, tmp_path)
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert {k: v["spec"]["replicas"] for k, v in sets.items()} == {"learner": 1, "inference": 1, "env": 2}
    gpus = {
        k: v["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for k, v in sets.items()
    }
    assert gpus == {"learner": 8, "inference": 4, "env": 2}
    env = sets["env"]["spec"]["template"]["spec"]["containers"][0]
    assert env["readinessProbe"] == {"grpc": {"port": 50054}, "periodSeconds": 10}
    assert env["command"][env["command"].index("--index") + 1] == "$(POD_INDEX)"
    assert any(e["name"] == "RLFLEET_RUN_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in env["env"])
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["run.yaml"]
    (tmp_path / "run.yaml").write_text(config)
    assert load_config(tmp_path / "run.yaml").cluster.launcher == "attach"
    # the validator is not a rubber stamp
    broken = dict(sets["env"], spec={**sets["env"]["spec"], "replicas": "two"})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33", strict=True)


def test_compose_runs_the_same_processes_with_one_published_port(tmp_path):
    cfg = load_config(None, GPU_RUN)
    files = deploy.write("compose", cfg, tmp_path)
    doc = yaml.safe_load((tmp_path / "docker-compose.yml").read_text())
    services = doc["services"]
    assert list(services) == ["coordinator", "learner-0", "inference-0", "env-0", "env-1"]
    published = {k: v["ports"] for k, v in services.items() if "ports" in v}
    assert published == {"coordinator": ["127.0.0.1:50051:50051"]}
    assert services["env-1"]["restart"] == "on-failure" and services["learner-0"]["restart"] == "no"
    assert services["env-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2", "3"]
    assert "--advertise" in services["env-1"]["command"] and "env-1:50054" in services["env-1"]["command"]
    assert services["env-0"]["healthcheck"]["test"][-1] == "127.0.0.1:50054"
    env_file = tmp_path / "rlfleet.env"
    assert env_file in files and env_file.stat().st_mode & 0o777 == 0o600
    assert env_file.read_text().startswith("RLFLEET_RUN_TOKEN=")
    assert load_config(tmp_path / "run.yaml").cluster.launcher == "attach"


def test_simulator_env_servers_use_their_own_image():
    cfg = load_config("metaworld_mt1_ppo_mlp", ["cluster.num_env_servers=1"])
    env = next(s for s in process_plan(cfg) if s.role == "env")
    assert deploy.image_for(cfg, env) == "rlfleet-metaworld:cpu"
    cmd = deploy.service_command(cfg, env, "env-0")
    assert cmd[:5] == ["python", "-m", "services.env.environment", "exec", "metaworld"]
    assert deploy.images(cfg)["rlfleet-metaworld:cpu"] == {
        "target": "simulator",
        "args": {
            "BASE_IMAGE": "python:3.11-slim-bookworm",
            "TORCH_INDEX_URL": deploy.CPU_TORCH_INDEX,
            "SIMULATOR": "metaworld",
        },
    }


def test_vllm_inference_servers_use_the_vllm_image():
    cfg = load_config("pandapickcube_vision_ppo_openvla_tiny", ["rollout.backend=vllm"])
    plan = {s.role: s for s in process_plan(cfg)}
    assert deploy.image_for(cfg, plan["inference"]) == "rlfleet-vllm:cpu"
    assert deploy.image_for(cfg, plan["env"]) == deploy.image_for(cfg, plan["learner"]) == "rlfleet:cpu"
    cmd = deploy.service_command(cfg, plan["inference"], "inference-0")
    assert cmd[:7] == ["python", "-m", "services.env.environment", "exec", "vllm", "-m", "services.inference.server"]
    assert deploy.images(cfg)["rlfleet-vllm:cpu"]["args"]["SIMULATOR"] == "vllm"
    hf = load_config("pandapickcube_vision_ppo_openvla_tiny")
    assert set(deploy.images(hf)) == {"rlfleet:cpu"}


def test_cli_writes_and_names_bad_keys(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.coordinator.cli",
            "deploy",
            "k8s",
            "cluster.num_env_servers=2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and (tmp_path / "rlfleet-k8s.yaml").exists(), out.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.coordinator.cli",
            "deploy",
            "compose",
            "cluster.num_env_servrs=2",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown config key 'cluster.num_env_servrs'" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_a_run_over_two_simulators_gets_an_image_and_a_statefulset_per_simulator(tmp_path):
    cfg = load_config("libero_metaworld_ppo_cnn")
    envs = [s for s in process_plan(cfg) if s.role == "env"]
    assert [(s.index, s.simulator) for s in envs] == [(0, "libero"), (1, "metaworld")]
    assert {"rlfleet-libero:cpu", "rlfleet-metaworld:cpu"} <= set(deploy.images(cfg))
    assert [deploy.image_for(cfg, s) for s in envs] == ["rlfleet-libero:cpu", "rlfleet-metaworld:cpu"]
    docs = k8s_docs(cfg, tmp_path)
    sets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "StatefulSet"}
    assert set(sets) == {"learner", "inference", "env-0-libero", "env-1-metaworld"}
    # pod index = env server index: the Meta-World server's pod is env-1-metaworld-1, started with --index 1
    assert "ordinals" not in sets["env-0-libero"] and sets["env-1-metaworld"]["ordinals"] == {"start": 1}
    images = {k: v["template"]["spec"]["containers"][0]["image"] for k, v in sets.items()}
    assert images["env-0-libero"] == "rlfleet-libero:cpu" and images["env-1-metaworld"] == "rlfleet-metaworld:cpu"
    compose = yaml.safe_load(deploy.write("compose", cfg, tmp_path / "c")[0].read_text())
    assert compose["services"]["env-1"]["image"] == "rlfleet-metaworld:cpu"


def test_each_container_gets_its_own_credential_not_the_run_secret(tmp_path, monkeypatch):
    """The run secret goes to the coordinator only; compose gives each service a credential for its role and
    index, Kubernetes one per role (a StatefulSet's pods share a template); none of them is the secret, and what
    an env container holds is refused where the learner's is needed."""
    from rlfleet.errors import AuthError
    from rlfleet.wire import auth, callers

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    cfg = load_config(None, GPU_RUN)
    deploy.write("compose", cfg, tmp_path / "compose")
    doc = yaml.safe_load((tmp_path / "compose" / "docker-compose.yml").read_text())["services"]
    read = lambda name: (tmp_path / "compose" / name).read_text().strip().split("=", 1)[1]  # noqa: E731
    secret = read("rlfleet.env")
    assert doc["coordinator"]["env_file"] == ["rlfleet.env"] and not auth.is_credential(secret)
    for name in ("learner-0", "inference-0", "env-0", "env-1"):
        (env_file,) = doc[name]["env_file"]
        assert env_file == f"rlfleet-{name}.env" and (tmp_path / "compose" / env_file).stat().st_mode & 0o777 == 0o600
        role, index = name.rsplit("-", 1)
        assert read(env_file) == auth.issue(secret, role, int(index))

    docs = k8s_docs(cfg, tmp_path / "k8s")
    secrets = {d["metadata"]["name"]: d["stringData"][auth.TOKEN_ENV] for d in docs if d["kind"] == "Secret"}
    run = str(cfg.runner.experiment_name).replace("_", "-").lower()
    k8s_secret = secrets[f"{run}-token"]

    def secret_of(obj):
        container = obj["spec"]["template"]["spec"]["containers"][0]
        (ref,) = [e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if e["name"] == auth.TOKEN_ENV]
        return ref

    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("StatefulSet", "Job")}
    assert secret_of(workloads["coordinator"]) == f"{run}-token"
    for role in ("env", "inference", "learner"):
        assert secret_of(workloads[role]) == f"{run}-{role}-credential"
        assert secrets[f"{run}-{role}-credential"] == auth.issue(k8s_secret, role)  # any index of the role
    # an env pod's credential, claiming the learner at an inference server: refused
    try:
        auth.set_identity("env", secrets[f"{run}-env-credential"], 1)
        md = [
            (k, "learner" if k == callers.ROLE_KEY else v)
            for k, v in callers.call_metadata("/rlfleet.v1.InferenceService/Act")
        ]
        auth.set_identity("inference", secrets[f"{run}-inference-credential"], 0)
        with pytest.raises(AuthError) as err:
            callers.check_caller("/rlfleet.v1.InferenceService/UpdateWeights", md)
        assert err.value.args[0] == "PERMISSION_DENIED"
    finally:
        auth.set_identity("env", None)


def test_collocated_acting_deploys_no_inference_server(tmp_path):
    """cluster.component_placement.rollout: env (issue 37): the env servers act themselves, on the env's GPUs;
    neither compose nor Kubernetes gets an inference service, credential or image."""
    cfg = load_config(
        None,
        [
            "cluster.num_env_servers=2",
            "cluster.num_gpus_per_node=8",
            "cluster.component_placement={env: 0-3, rollout: env, actor: 4-7}",
            "rollout.pipeline_stage_num=1",
        ],
    )
    plan = {s.name: s for s in process_plan(cfg)}
    assert list(plan) == ["learner-0", "env-0", "env-1"] and plan["env-1"].gpus == (2, 3)
    docs = k8s_docs(cfg, tmp_path / "k8s")
    assert not [d for d in docs if "inference" in d["metadata"]["name"]]
    deploy.write("compose", cfg, tmp_path / "compose")
    services = yaml.safe_load((tmp_path / "compose" / "docker-compose.yml").read_text())["services"]
    assert list(services) == ["coordinator", "learner-0", "env-0", "env-1"]
