"""The env side's command for simulator environments and preflights (the coordinator runs it as a subprocess, a
container as its entry point; it never imports env code itself):

    python -m services.env.environment python SIMULATOR [--envs-dir D]   # build if needed; print its python
    python -m services.env.environment install SIMULATOR [--envs-dir D]  # the same (image builds)
    python -m services.env.environment exec SIMULATOR ARGS...            # run ARGS with that python (containers)
    python -m services.env.environment preflight < CONFIG.yaml           # fail fast on what this host cannot run
    python -m services.env.environment assets SIMULATOR [TASK] [--dry-run] # fetch a task's assets (the simulator's
                                                                         # own download), or list what is missing

A simulator's environment is built by rlfleet.simulators.environments with this side's finishing steps
(services.env.backends.FINISH_STEPS). The preflight runs in the main environment: each simulator's preflight
(host checks: GPU, Vulkan, EGL, assets) and, for simulators of the main environment, the env id itself.
Build progress goes to stderr; `python` and `install` print only the interpreter's path on stdout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from rlfleet.simulators import environments
from services.env.backends import ASSETS, FINISH_STEPS, PREFLIGHTS


def python_for(simulator: str, configured: str | None = None, log=print) -> str:
    """The python an env server for ``simulator`` runs with: the main one, or its own environment's (built first,
    with this side's finishing steps, when missing)."""
    env = environments.environment_of(simulator)
    if env is None:
        return sys.executable
    return str(environments.ensure(env, configured, log, steps=FINISH_STEPS.get(simulator, ())))


def preflight_errors(cfg) -> list[str]:
    """What this host cannot run of ``cfg``'s env servers, one ConfigError-style line each ('key': why)."""
    from omegaconf import OmegaConf

    from rlfleet.config import env_server_config
    from rlfleet.errors import InvalidRequest
    from rlfleet.registry import load_object

    errors: list[str] = []
    servers = {}  # each distinct env-server config (env.per_server gives some servers other simulators)
    for i in range(cfg.cluster.num_env_servers):
        server = env_server_config(cfg, i)
        servers.setdefault(OmegaConf.to_yaml(server.env), server)
    for server in servers.values():
        for name in dict.fromkeys(server.env[split].simulator_type for split in ("train", "eval")):
            if name in PREFLIGHTS:
                try:
                    load_object(PREFLIGHTS[name])(server)
                except RuntimeError as exc:
                    errors.append(f"'env.train.simulator_type': {name} cannot run on this machine: {exc}")
        for split in ("train", "eval"):
            e = server.env[split]
            if environments.environment_of(e.simulator_type) is None:  # importable here: check the id now
                from services.env.gym_envs import make_gym_env

                try:
                    make_gym_env(e.env_id, dict(e.init_params)).close()
                except (InvalidRequest, ValueError) as exc:
                    errors.append(f"'env.{split}.env_id': {exc}")
    return list(dict.fromkeys(errors))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.env.environment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=("python", "install", "exec", "preflight", "assets"))
    p.add_argument("simulator", nargs="?")
    p.add_argument(
        "--envs-dir", default=None, help="where environments live (default: $RLFLEET_ENVS_DIR or ~/.cache/rlfleet/envs)"
    )
    p.add_argument("--dry-run", action="store_true", help="assets: print the downloads, run none")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    err = lambda *a, **k: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.action == "preflight":
        from omegaconf import OmegaConf

        errors = preflight_errors(OmegaConf.create(sys.stdin.read()))
        for line in errors:
            print(line, flush=True)
        return 3 if errors else 0
    if not args.simulator:
        err(f"{p.prog} {args.action}: name a simulator")
        return 2
    try:
        python = python_for(args.simulator, args.envs_dir, err)
    except KeyError as exc:
        err(f"{p.prog}: {exc}")
        return 2
    except environments.EnvironmentError_ as exc:
        err(str(exc))
        return 1
    if args.action in ("python", "install"):
        print(python, flush=True)
        return 0
    if args.action == "assets":
        if args.simulator not in ASSETS:
            err(
                f"{p.prog} assets: {args.simulator} has no assets to fetch (simulators with assets: "
                f"{', '.join(ASSETS)})"
            )
            return 2
        module, _, fn = ASSETS[args.simulator].partition(":")
        rest = [a for a in args.args if a != "--dry-run"]  # (REMAINDER keeps flags given after the simulator)
        task, dry = (rest[0] if rest else None), args.dry_run or "--dry-run" in args.args
        code = f"import sys, {module} as m; sys.exit(m.{fn}({task!r}, {bool(dry)}))"
        return subprocess.run([python, "-c", code], env=environments.child_environ(python, 1)).returncode
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    os.execve(python, [python, *args.args], environments.child_environ(python, int(threads)))
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
