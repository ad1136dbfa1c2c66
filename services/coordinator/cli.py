"""coordinatorctl: start, watch and stop an rlfleet run.

coordinatorctl start [CONFIG] [key=value ...]     # default: PPO on PandaPickCube-v0, all services local
coordinatorctl start --resume RUN_DIR [key=value ...]
coordinatorctl status [RUN_DIR | --address HOST:PORT]   # an ended run's folder: how it ended (its summary)
coordinatorctl stop   [RUN_DIR | --address HOST:PORT]
coordinatorctl scale env N [RUN_DIR | --address HOST:PORT]  # env servers of a running run, from the next epoch
coordinatorctl configs                              # the built-in configs (start NAME)
coordinatorctl envs [install NAME | remove NAME]    # simulators, their environments, install one ahead
coordinatorctl check-env HOST:PORT                  # an EnvService against the env contract
coordinatorctl collect-demos CONFIG [key=value ...] # scripted-expert demonstrations of env.train -> sft.dataset_path
coordinatorctl sft CONFIG [key=value ...]           # behaviour cloning of actor.model on them -> sft.output_path
coordinatorctl deploy compose|k8s [CONFIG] [key=value ...] [--out DIR]  # container manifests for a run
coordinatorctl traces RUN_DIR [--epoch N]           # one epoch's trace across the services, as a tree
coordinatorctl eval RUN_DIR|CHECKPOINT|MODEL_DIR [--config CFG] [key=value ...] [--out DIR]
coordinatorctl eval --compare A B [...]             # seeded evaluation reports (95% intervals); A - B paired
coordinatorctl export RUN_DIR [--step N] OUT [--layout upstream|rlfleet] [--lora merged|adapter]  # released layout
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import grpc

import rlfleet  # noqa: F401  (sets gRPC's log verbosity before grpc is imported)
from rlfleet.algorithms import ALGORITHMS
from rlfleet.config import ConfigError, load_config
from rlfleet.untrusted import BadFile
from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc
from rlfleet.wire import auth, channels, tls, tracing


def _start(args) -> int:
    from services.coordinator.coordinator import Coordinator, RunFailed, choose_run_dir, install_signal_handlers
    from services.coordinator.server import serve

    try:
        if args.resume:
            run_dir = pathlib.Path(args.resume)
            if not (run_dir / "config.yaml").exists():
                raise ConfigError(f"--resume: {run_dir}/config.yaml not found (is it a run folder?)")
            overrides = ([args.config] if args.config else []) + list(args.overrides)
            cfg = load_config(run_dir / "config.yaml", overrides + [f"runner.resume_dir={run_dir}"], root=run_dir)
        else:
            cfg = load_config(args.config, args.overrides)
            if cfg.cluster.external_env_addresses:  # Describe them now: refuse what cannot run, name the run after it
                from services.coordinator.preflight import preflight_external

                default_name = load_config(None).runner.experiment_name  # (the embedded config's: not the user's)
                named = any(o.startswith("runner.experiment_name=") for o in args.overrides)
                for note in preflight_external(cfg, rename=not named and cfg.runner.experiment_name == default_name):
                    print(f"  note: {note}")
            run_dir = choose_run_dir(cfg, None)
        if cfg.runner.resume_dir and (args.resume or cfg.cluster.launcher == "local"):
            from services.coordinator.preflight import preflight_resume

            preflight_resume(cfg)  # the checkpoint checked whole: a bad file named in seconds, before any service
        if cfg.runner.only_eval:
            raise ConfigError(
                "'runner.only_eval': true means evaluation only, which `coordinatorctl eval RUN_DIR | "
                "CHECKPOINT | MODEL_DIR` runs (same env and inference servers, a learner that never "
                "trains); `coordinatorctl start` trains"
            )
        if cfg.cluster.launcher == "local":
            from services.coordinator.launcher import check_local
            from services.coordinator.preflight import preflight_loggers, preflight_model

            preflight_loggers(cfg)  # wandb/swanlab named but not installed: the pip commands, in seconds
            check_local(cfg)  # e.g. a learner over several nodes
            preflight_model(cfg)  # a model_path (folder or hub id) that does not resolve, in seconds
        if cfg.cluster.launcher == "local" and not cfg.cluster.external_env_addresses:
            from services.coordinator.preflight import preflight_local

            preflight_local(cfg)
    except ConfigError as exc:
        print(f"coordinatorctl: config error: {exc}", file=sys.stderr)
        return 2
    token = auth.token_from_env() or auth.new_token()  # a deployment may hand one in; else a fresh one per run
    auth.set_identity("coordinator", token)
    tls.configure_tls(cfg.cluster.tls)
    try:
        where = tracing.setup("coordinator", 0, cfg, run_dir)
    except SystemExit as exc:
        print(f"coordinatorctl: {exc}", file=sys.stderr)
        return 2
    coord = Coordinator(cfg, run_dir, quiet=args.quiet, token=token)
    server = serve(coord, cfg.cluster.coordinator_address)
    if where:
        coord.say(f"  traces and metrics: {where}", verbose=True)
    install_signal_handlers(coord)
    code = 0
    try:
        coord.run()
        if coord.fatal:
            raise RunFailed(coord.fatal)
    except RunFailed as exc:
        print(f"\ncoordinatorctl: run failed: {exc}", file=sys.stderr)
        code = 1
    except grpc.RpcError as exc:
        print(f"\ncoordinatorctl: run failed: {coord.fatal or channels.describe_error(exc)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("\ncoordinatorctl: interrupted; shutting down", file=sys.stderr)
        code = 130
    finally:
        coord.shutdown()
        server.stop(grace=0.5)
        tracing.shutdown()
    return code


def _envs(args) -> int:
    from rlfleet.policies.backends import BACKENDS
    from rlfleet.policies.backends import describe as describe_backends
    from rlfleet.registry import UnknownName
    from rlfleet.simulators import environments, get_simulator

    if args.action == "assets":  # the env side fetches them, in the simulator's environment (a subprocess)
        import subprocess

        from services.coordinator.launcher import ENV_SIDE_COMMAND

        if not args.name:
            print("coordinatorctl envs assets: name a simulator (e.g. maniskill)", file=sys.stderr)
            return 2
        try:
            get_simulator(args.name)
        except UnknownName as exc:
            print(f"coordinatorctl envs assets: {exc}", file=sys.stderr)
            return 2
        cmd = [
            *ENV_SIDE_COMMAND,
            "assets",
            args.name,
            *(["--envs-dir", args.envs_dir] if args.envs_dir else []),
            *(["--dry-run"] if args.dry_run else []),
            *([args.task] if args.task else []),
        ]
        return subprocess.run(cmd).returncode
    if args.action in ("install", "remove"):
        if not args.name:
            print(f"coordinatorctl envs {args.action}: name a simulator", file=sys.stderr)
            return 2
        if args.name in BACKENDS:  # an inference backend's environment (vllm)
            part = BACKENDS[args.name]
        else:
            try:
                part = get_simulator(args.name)
            except UnknownName as exc:
                print(f"coordinatorctl: {exc} (or an inference backend: {', '.join(BACKENDS)})", file=sys.stderr)
                return 2
        if part.environment is None:
            print(f"{part.name} runs in the main environment ({sys.prefix}); nothing to {args.action}")
            return 0
        if args.action == "remove":
            removed = environments.remove(part.environment, args.envs_dir)
            print(f"{part.name}: {'removed' if removed else 'not installed'}")
            return 0
        from services.coordinator.launcher import simulator_python

        try:  # a simulator's through the env side (it adds its finishing steps); a backend's directly
            print(
                environments.ensure(part.environment, args.envs_dir)
                if args.name in BACKENDS
                else simulator_python(args.name, args.envs_dir)
            )
        except environments.EnvironmentError_ as exc:
            print(f"coordinatorctl: {exc}", file=sys.stderr)
            return 1
        return 0
    rows = environments.describe(args.envs_dir) + describe_backends(args.envs_dir)
    print(f"simulator and inference-backend environments in {environments.envs_dir(args.envs_dir)}\n")
    print(f"{'simulator':<10} {'environment':<12} {'installed':<10} task ids (examples) / model types")
    for r in rows:
        print(
            f"{r['simulator']:<10} {r['environment']:<12} {'yes' if r['installed'] else 'no':<10} "
            f"{', '.join(r['examples'])}"
        )
        print(f"{'':<10} {r['description']}" + (f" ({r['notes']})" if r["notes"] else ""))
    print(
        "\nan environment is built on first use by `coordinatorctl start`; build one ahead with "
        "`coordinatorctl envs install NAME`"
    )
    return 0


def _configs(args) -> int:
    """The built-in configs, each with the first sentence of its opening comment."""
    from rlfleet.config import CONFIG_DIR, builtin_configs

    names = builtin_configs()
    width = max(map(len, names))
    print(f"{len(names)} built-in configs ({CONFIG_DIR}); `coordinatorctl start NAME` runs one\n")
    for name in names:
        head = []
        for line in (CONFIG_DIR / f"{name}.yaml").read_text().splitlines():
            if not line.startswith("#"):
                break
            head.append(line.lstrip("# ").strip())
        text = " ".join(head)
        first = text.split(". ")[0].rstrip(".")
        print(f"{name:<{width}}  {first[:90] + ('...' if len(first) > 90 else '')}")
    return 0


def _sft_step(args) -> int:
    """collect-demos (from the simulator's environment, as env servers run) or sft (the learner's code), each as
    a child process with its output on this console."""
    import subprocess

    from rlfleet.simulators import environments
    from rlfleet.simulators.environments import child_environ

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"coordinatorctl: config error: {exc}", file=sys.stderr)
        return 2
    base = pathlib.Path(cfg.runner.logger.log_path) / cfg.runner.experiment_name
    dataset = pathlib.Path(cfg.sft.dataset_path or base / "demos")
    python = sys.executable
    if args.command == "collect-demos":
        from services.coordinator.launcher import simulator_python

        try:
            python = simulator_python(cfg.env.train.simulator_type, cfg.cluster.envs_dir, print)
        except environments.EnvironmentError_ as exc:
            print(f"coordinatorctl: {exc}", file=sys.stderr)
            return 1
        cmd = [
            python,
            "-m",
            "services.env.demos",
            "--config",
            str(args.config or "pandapickcube_ppo"),
            "--out",
            str(dataset),
        ]
        if args.episodes:
            cmd += ["--episodes", str(args.episodes)]
    else:
        from rlfleet.config import fit
        from services.coordinator.preflight import preflight_model

        try:
            preflight_model(cfg)
        except ConfigError as exc:
            print(f"coordinatorctl: config error: {exc}", file=sys.stderr)
            return 2
        why = fit.check(cfg, inference=False)
        if why:
            print(f"coordinatorctl: config error: 'actor.model': {why}", file=sys.stderr)
            return 2
        cmd = [python, "-m", "services.learner.sft", "--config", str(args.config or "pandapickcube_ppo")]
    cmd += list(args.overrides)
    return subprocess.call(cmd, env=child_environ(python, cfg.cluster.torch_num_threads), cwd=os.getcwd())


def _find_run(args) -> tuple[str, str | None]:
    """(coordinator address, run folder or None) of the run that status/stop talk to."""
    if args.address:
        return args.address, args.run_dir
    if args.run_dir:
        candidates = [pathlib.Path(args.run_dir) / "coordinator.json"]
    else:
        candidates = sorted(
            pathlib.Path("runs").glob("*/coordinator.json"), key=lambda p: p.stat().st_mtime, reverse=True
        )
    for path in candidates:
        address = _live_address(path)
        if address is not None:
            return address, str(path.parent)
    raise SystemExit("coordinatorctl: no running coordinator found (give RUN_DIR or --address)")


def _live_address(path: pathlib.Path) -> str | None:
    """The address in a run folder's coordinator.json when its coordinator process is alive, else None."""
    if not path.exists():
        return None
    from rlfleet.untrusted import read_json

    info = read_json(path, max_bytes=65536, what="coordinator address file")
    if not isinstance(info.get("pid"), int) or not isinstance(info.get("address"), str):
        raise SystemExit(f"coordinatorctl: {path}: expected {{\"pid\": int, \"address\": str}}")
    try:
        os.kill(info["pid"], 0)
    except OSError:
        return None
    return info["address"]


def _coordinator_stub(args):
    """A stub carrying the run credential: $RLFLEET_RUN_TOKEN, else the run folder's run_token file."""
    address, run_dir = _find_run(args)
    token = auth.read_token(run_dir)
    if token is None:
        raise SystemExit(
            f"coordinatorctl: no run credential for {address}: set {auth.TOKEN_ENV} or give the run "
            f"folder (its {auth.TOKEN_FILE} file)"
        )
    auth.set_identity("ctl", token)
    config = pathlib.Path(run_dir) / "config.yaml" if run_dir else None
    if config is not None and config.exists():  # a TLS run: dial it with the run's certificates
        from omegaconf import OmegaConf

        from rlfleet.config import read_config_file

        tls.configure_tls(OmegaConf.select(read_config_file(config, root=run_dir), "cluster.tls"))
    return address, coordinator_pb2_grpc.CoordinatorServiceStub(channels.channel(address))


def _status(args) -> int:
    if args.run_dir and not args.address and _live_address(pathlib.Path(args.run_dir) / "coordinator.json") is None:
        from services.coordinator.ended import ended_run

        lines = ended_run(args.run_dir)  # a finished, stopped or crashed run: what its folder says
        if lines:
            print("\n".join(lines))
            return 0
    address, stub = _coordinator_stub(args)
    try:
        st = stub.Status(coordinator_pb2.StatusRequest(), timeout=5)
    except grpc.RpcError as exc:
        print(f"coordinatorctl: {address}: {channels.describe_error(exc)}", file=sys.stderr)
        return 1
    print(
        f"{st.experiment_name}: {st.phase}, epoch {st.epoch + 1}/{st.max_epochs}, {st.env_steps} env steps, "
        f"{st.elapsed_s:.0f}s  ({st.run_dir})"
    )
    update_keys = [key for entry in ALGORITHMS.values() for _, key, _ in entry.progress]  # whichever the run has
    for key in dict.fromkeys(("env/success_once", "env/return", *update_keys)):
        if key in st.last_metrics:
            print(f"  {key} = {st.last_metrics[key]:.4f}")
    if st.bottleneck:  # empty before the first epoch and from a coordinator older than the field
        print(f"  bottleneck: {st.bottleneck}")
    names = {1: "env", 2: "inference", 3: "learner"}
    for s in st.services:
        print(
            f"  {names.get(s.role, s.role)}[{s.index}] {s.address} pid {s.pid} "
            f"{'alive' if s.alive else 'DOWN'} restarts {s.restarts} heartbeat {s.last_heartbeat_age_s:.1f}s ago"
        )
    return 0


def _scale(args) -> int:
    if args.role != "env":
        print("coordinatorctl scale: only env servers scale during a run (coordinatorctl scale env N)", file=sys.stderr)
        return 2
    address, stub = _coordinator_stub(args)
    try:
        reply = stub.Scale(coordinator_pb2.ScaleRequest(role=coordinator_pb2.ENV, count=args.count), timeout=10)
    except grpc.RpcError as exc:
        print(f"coordinatorctl: {address}: {channels.describe_error(exc)}", file=sys.stderr)
        return 1
    print(reply.message)
    return 0


def _stop(args) -> int:
    address, stub = _coordinator_stub(args)
    try:
        stub.Stop(coordinator_pb2.StopRequest(reason="coordinatorctl stop"), timeout=5)
    except grpc.RpcError as exc:
        print(f"coordinatorctl: {address}: {channels.describe_error(exc)}", file=sys.stderr)
        return 1
    print(f"stop requested at {address}; the run finishes its current epoch, saves a checkpoint and shuts down")
    return 0


def _deploy(args) -> int:
    from services.coordinator import deploy

    try:
        cfg = load_config(args.config, args.overrides)
        out = pathlib.Path(args.out or f"deploy/generated/{cfg.runner.experiment_name}-{args.kind}")
        written = deploy.write(args.kind, cfg, out, args.tag)  # refuses what the platform cannot run, writing nothing
    except ConfigError as exc:
        print(f"coordinatorctl: config error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if args.kind == "compose":
        print(
            f"run it: cd {out} && docker-compose up --build   (status: RLFLEET_RUN_TOKEN=... coordinatorctl status "
            f"--address 127.0.0.1:50051, the token is in {out / 'rlfleet.env'})"
        )
    else:
        print(
            f"apply it: kubectl apply -f {out / 'rlfleet-k8s.yaml'}   (images: {', '.join(deploy.images(cfg, args.tag))})"
        )
    return 0


def _traces(args) -> int:
    from rlfleet.wire import tracing

    spans = tracing.load_spans(args.run_dir)
    if not spans:
        print(f"coordinatorctl: no spans in {args.run_dir}/traces (telemetry.traces=file writes them)", file=sys.stderr)
        return 1
    epochs = sorted({s["attributes"].get("rlfleet.epoch") for s in spans if s["name"] == "epoch"})
    epoch = args.epoch if args.epoch is not None else (epochs[-1] if epochs else 0)
    tree = tracing.format_tree(tracing.epoch_trace(spans, epoch))
    if not tree:
        print(
            f"coordinatorctl: no trace for epoch {epoch} (traced epochs: {epochs[0]}..{epochs[-1]})"
            if epochs
            else "coordinatorctl: no epoch traces yet",
            file=sys.stderr,
        )
        return 1
    print(f"epoch {epoch} ({len(spans)} spans in {args.run_dir}/traces)\n{tree}")
    return 0


def _add_eval_parser(sub) -> None:
    q = sub.add_parser(
        "eval",
        help="evaluate a run folder, a checkpoint or a model folder on seeded episodes "
        "(report.json/report.md with 95%% intervals); --compare A B",
    )
    q.add_argument(
        "target",
        nargs="?",
        default=None,
        help="run folder (its newest checkpoint), RUN/checkpoints/global_step_N, or a model folder "
        "(a released layout, as coordinatorctl export writes)",
    )
    q.add_argument("overrides", nargs="*", help="key=value overrides, e.g. env.eval.num_episodes=200")
    q.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        default=None,
        help="evaluate A and B on the same episodes and report A - B with its paired 95%% interval",
    )
    q.add_argument("--config", default=None, help="YAML config or a built-in name (default: the run's config.yaml)")
    q.add_argument(
        "--out",
        default=None,
        help="output folder (default RUN/eval/global_step_N, or <log_path>/eval-NAME, <log_path>/compare-A-vs-B)",
    )
    q.add_argument("--quiet", action="store_true", help="print only errors")


def _eval(args) -> int:
    from services.coordinator.offline_eval import main as eval_main

    if args.target and "=" in args.target and not args.compare:  # `eval k=v` without a target
        args.overrides, args.target = [args.target, *args.overrides], None
    return eval_main(args)


class _ExportInputError(Exception):
    pass


EXPORT_LAYOUTS = ("upstream", "rlfleet")


def _export_target(args):
    """(checkpoint folder, run config) that `export` reads, or _ExportInputError in one line."""
    if args.layout not in EXPORT_LAYOUTS:  # checked here, not by argparse: one line, not a usage block
        raise _ExportInputError(
            f"--layout: '{args.layout}' is not one of {', '.join(EXPORT_LAYOUTS)} (upstream: the "
            f"model family's released layout; rlfleet: rlfleet's own save_pretrained)"
        )
    from rlfleet.data.checkpoint_files import CheckpointNotFound, find_checkpoint, verify_checkpoint

    try:
        ckpt, run = find_checkpoint(args.run_dir, args.step)
    except CheckpointNotFound as exc:
        raise _ExportInputError(str(exc)) from None
    try:  # the checkpoint checked whole before anything else reads it (rlfleet.data.checkpoint_files)
        verify_checkpoint(ckpt)
    except (BadFile, OSError) as exc:
        raise _ExportInputError(str(exc)) from None
    out = pathlib.Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _ExportInputError(f"{out}: exists and is not empty (export writes a new or empty folder)")
    config = pathlib.Path(args.config) if args.config else run / "config.yaml"
    if not config.is_file():
        raise _ExportInputError(f"{config}: not found (the run's config; give --config CONFIG)")
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise _ExportInputError(f"config error: {exc}") from None
    from rlfleet.policies.families import get_family

    why = get_family(cfg.actor.model.model_type).export_refusal(cfg.actor.model, args.layout)  # its entry says
    if why:
        raise _ExportInputError(f"{ckpt}: {why}" if why.startswith(cfg.actor.model.model_type) else why)
    if args.lora == "adapter" and not cfg.actor.model.is_lora:
        raise _ExportInputError(
            "--lora adapter: the run trained without LoRA (actor.model.is_lora=false); export it merged (the default)"
        )
    return ckpt, config, cfg


def _export(args) -> int:
    """Checked here (one line, exit 2), exported by the learner's code in a child process on the CPU
    (services/learner/export.py; the coordinator never imports the learner)."""
    import subprocess

    from rlfleet.simulators.environments import child_environ

    try:
        ckpt, config, cfg = _export_target(args)
    except _ExportInputError as exc:
        print(f"coordinatorctl export: {exc}", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "services.learner.export",
        str(ckpt),
        str(args.out),
        "--config",
        str(config),
        "--lora",
        args.lora,
        "--layout",
        args.layout,
        "--max-shard-size",
        str(args.max_shard_size),
    ]
    env = child_environ(sys.executable, cfg.cluster.torch_num_threads, CUDA_VISIBLE_DEVICES="")
    return subprocess.call(cmd, env=env, cwd=os.getcwd())


MODULES_REPORT_ENV = "RLFLEET_MODULES_REPORT"  # tests: where `start` writes the modules its process loaded


def _report_modules() -> None:
    """With $RLFLEET_MODULES_REPORT set, write the coordinator process's loaded modules there (JSON) when `start`
    ends: the tests check that no env-side module or simulator package was ever loaded by a run's coordinator."""
    path = os.environ.get(MODULES_REPORT_ENV)
    if path:
        pathlib.Path(path).write_text(json.dumps(sorted(sys.modules)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check-env"]:  # its own parser: argparse.REMAINDER would not take a leading --help
        from rlfleet.simulators.conformance import main as check_env_main

        return check_env_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="coordinatorctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="start a run (default config: PPO on PandaPickCube-v0)")
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML config or a built-in name (pandapickcube_ppo, pandapickcube_vision_ppo)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. env.train.total_num_envs=32")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    for name in ("status", "stop"):
        q = sub.add_parser(name, help=f"{name} of a running coordinator")
        q.add_argument("run_dir", nargs="?", default=None)
        q.add_argument("--address", default=None)
    sub.add_parser("configs", help="list the built-in configs (coordinatorctl start NAME)")
    q = sub.add_parser("scale", help="change the number of env servers of a running run (next epoch)")
    q.add_argument("role", choices=("env",))
    q.add_argument("count", type=int)
    q.add_argument("run_dir", nargs="?", default=None)
    q.add_argument("--address", default=None)
    q = sub.add_parser(
        "envs",
        help="list simulators and their environments; install or remove one; fetch a task's "
        "assets (envs assets maniskill [TASK])",
    )
    q.add_argument("action", nargs="?", choices=("list", "install", "remove", "assets"), default="list")
    q.add_argument("name", nargs="?", default=None, help="simulator name (see the list)")
    q.add_argument("task", nargs="?", default=None, help="assets: the task whose assets to fetch (none: list them)")
    q.add_argument("--dry-run", action="store_true", help="assets: print the downloads, run none")
    q.add_argument(
        "--envs-dir", default=None, help="where environments live (default: $RLFLEET_ENVS_DIR or ~/.cache/rlfleet/envs)"
    )
    q = sub.add_parser("collect-demos", help="record scripted-expert demonstrations of env.train (sft.* keys)")
    q.add_argument("config", help="YAML config or a built-in name")
    q.add_argument("overrides", nargs="*", help="key=value overrides")
    q.add_argument("--episodes", type=int, default=None, help="episodes to record (default: sft.num_demos)")
    q = sub.add_parser("sft", help="supervised fine-tuning of actor.model on the demonstrations (sft.* keys)")
    q.add_argument("config", help="YAML config or a built-in name")
    q.add_argument("overrides", nargs="*", help="key=value overrides")
    q = sub.add_parser("deploy", help="write docker-compose or Kubernetes manifests for a run")
    q.add_argument("kind", choices=("compose", "k8s"))
    q.add_argument("config", nargs="?", default=None, help="YAML config or a built-in name (default: the embedded one)")
    q.add_argument("overrides", nargs="*", help="key=value overrides")
    q.add_argument("--out", default=None, help="output folder (default deploy/generated/<experiment>-<kind>)")
    q.add_argument("--tag", default=None, help="image tag (default cpu, or gpu when the placement uses GPUs)")
    q = sub.add_parser("traces", help="print one epoch's trace (spans from every service) as a tree")
    q.add_argument("run_dir")
    q.add_argument("--epoch", type=int, default=None, help="epoch (default: the last traced)")
    q = sub.add_parser(
        "check-env",
        add_help=False,
        help="check a running EnvService against the env contract (docs/env-contract.md); "
        "`coordinatorctl check-env --help` for options",
    )
    q.add_argument("rest", nargs=argparse.REMAINDER)
    _add_eval_parser(sub)
    q = sub.add_parser(
        "export",
        help="write a run's trained policy in its model family's released layout "
        "(VLA policies; LoRA merged, or --lora adapter)",
        description="Write a run's trained VLA policy (its newest complete checkpoint, or --step N) to "
        "OUT. Layouts: upstream (default) is the family's released layout: OpenVLA / "
        "OpenVLA-OFT as openvla/openvla-7b (Prismatic's config.json and tensor names, "
        "sharded safetensors with an index, tokenizer and processor files, OFT's "
        "proprio_projector--N_checkpoint.pt), π0 as transformers' PI0 layout "
        "(lerobot/pi0_base: lerobot's tensor names, PaliGemma-style tokenizer files); "
        "the value head is not written, π0.5 is refused. rlfleet is rlfleet's own "
        "save_pretrained (its tensor names, every module, π0.5 too). Both load back "
        "through actor.model.model_path and coordinatorctl eval.",
    )
    q.add_argument(
        "run_dir", metavar="RUN_DIR", help="run folder (its newest checkpoint) or RUN/checkpoints/global_step_N"
    )
    q.add_argument("out", metavar="OUT", help="output folder (new, or empty)")
    q.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest)")
    q.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        default="merged",
        help="merged into the weights (default) or a peft adapter beside the base's id (upstream "
        "layout: keys named as the released model's modules, language_model.*)",
    )
    q.add_argument(
        "--layout",
        default="upstream",
        metavar="{upstream,rlfleet}",
        help="upstream (default): the model family's released layout; rlfleet: rlfleet's own save_pretrained layout",
    )
    q.add_argument(
        "--max-shard-size",
        default="5GB",
        help="upstream layout: the largest safetensors shard, as transformers' save_pretrained takes it (default 5GB)",
    )
    q.add_argument("--config", default=None, help="the run's config (default RUN_DIR/config.yaml)")
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides given after an option (`collect-demos CFG --episodes 2 k=v`)
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "check-env":
        from rlfleet.simulators.conformance import main as check_env_main

        return check_env_main(args.rest)
    if args.command == "configs":
        return _configs(args)
    if args.command == "envs":
        return _envs(args)
    if args.command in ("collect-demos", "sft"):
        return _sft_step(args)
    if args.command == "deploy":
        if args.config and "=" in args.config:
            args.overrides, args.config = [args.config, *args.overrides], None
        return _deploy(args)
    if args.command == "traces":
        return _traces(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "export":
        return _export(args)
    if args.command == "start":
        if args.config and "=" in args.config:  # `start k=v ...` without a config file
            args.overrides = [args.config, *args.overrides]
            args.config = None
        try:
            return _start(args)
        finally:
            _report_modules()
    from rlfleet.wire.auth import CredentialError

    try:  # the operator's commands need the operator's credential (the run folder's run_token) or the run's secret
        if args.command == "scale":
            return _scale(args)
        return _status(args) if args.command == "status" else _stop(args)
    except CredentialError as exc:
        print(
            f"coordinatorctl {args.command}: {exc} (operator commands need the operator's credential, the run "
            f"folder's run_token, or the run's secret; not a service's credential)",
            file=sys.stderr,
        )
        return 2
    except (ConfigError, BadFile) as exc:  # the run folder's coordinator.json or config.yaml
        print(f"coordinatorctl {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
