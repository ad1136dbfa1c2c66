"""What `coordinatorctl start` checks before anything starts, so a run that cannot work fails in seconds naming the
key: external env servers are Described (and their episode limit adopted); for local env servers the env side is
asked, in a subprocess, what this host cannot run (the coordinator never imports env code); and the policy's
copies must fit this machine (rlfleet.config.fit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from rlfleet.config import ConfigError
from rlfleet.simulators.environments import child_environ
from rlfleet.wire import env_contract
from services.coordinator.calls import CallFailed, describe, describe_external
from services.coordinator.launcher import ENV_SIDE_COMMAND


def preflight_local(cfg) -> None:
    """Fail in seconds, before anything starts, on what can be checked here: a simulator that cannot run on this
    host, (for simulators of the main environment) an unknown env id (both asked of the env side, in a
    subprocess), and a policy too big for this machine."""
    from rlfleet.config import env_server_config
    from rlfleet.simulators import get_simulator

    for i in range(cfg.cluster.num_env_servers):
        server = env_server_config(cfg, i)
        sims = {server.env[split].simulator_type for split in ("train", "eval")}
        if len({get_simulator(name).environment for name in sims}) > 1:
            raise ConfigError(
                f"'env.eval.simulator_type': {server.env.eval.simulator_type} and env.train's "
                f"{server.env.train.simulator_type} run in different Python environments; one env "
                f"server hosts both (use the same simulator, or external eval servers)"
            )
    errors = env_side_preflight(cfg)
    if errors and install_missing(cfg):  # e.g. ManiSkill's Vulkan: installed as `envs install` would, then asked again
        errors = env_side_preflight(cfg)
    if errors:
        raise ConfigError(errors[0])  # already "'key': why"
    from rlfleet.config import fit

    why = fit.check(cfg)  # a real-size VLA where there is no memory for it: say so now, not by OOM kills
    if why:
        raise ConfigError(f"'actor.model': {why}")


def can_install_system_packages() -> bool:
    """Whether this process can do what `coordinatorctl envs install NAME` does for a simulator's Debian packages
    (rlfleet.simulators.environments.ensure_system_packages: apt-get, as root)."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None and shutil.which("dpkg") is not None


def missing_system_packages(cfg) -> dict[str, list[str]]:
    """{simulator: its environment's Debian packages missing on this host} for the simulators of the run's local
    env servers ({} where dpkg is absent: not a Debian host, nothing rlfleet can install)."""
    from rlfleet.config import env_server_config
    from rlfleet.simulators import environments

    if shutil.which("dpkg") is None:
        return {}
    sims = {
        env_server_config(cfg, i).env[split].simulator_type
        for i in range(cfg.cluster.num_env_servers)
        for split in ("train", "eval")
    }
    out = {}
    for name in sorted(sims):
        env = environments.environment_of(name)
        missing = environments.missing_apt(env) if env is not None and env.apt else []
        if missing:
            out[name] = missing
    return out


def install_missing(cfg, log=print) -> bool:
    """`coordinatorctl start` does what `coordinatorctl envs install NAME` does when the run's simulators lack Debian
    packages (ManiSkill's Vulkan loader and driver, say) and this process can install them (root, apt-get): the
    packages, then the simulator's environment (built if not yet), with their progress on the console. -> whether it
    installed anything; False (nothing done) where it cannot, and the preflight's refusal names the command."""
    missing = missing_system_packages(cfg)
    if not missing or not can_install_system_packages():
        return False
    from rlfleet.simulators import environments
    from services.coordinator import launcher

    for name, packages in missing.items():
        log(
            f"  {name} needs Debian packages this host lacks ({', '.join(packages)}): installing them as "
            f"`coordinatorctl envs install {name}` does (root, apt-get) ..."
        )
        try:
            environments.ensure_system_packages(environments.environment_of(name), log)
            python = launcher.simulator_python(name, cfg.cluster.envs_dir, log)
        except environments.EnvironmentError_ as exc:
            raise ConfigError(f"'env.train.simulator_type': installing {name} failed: {exc}") from None
        log(f"  {name}: installed (its environment: {python})")
    return True


def preflight_model(cfg) -> None:
    """``actor.model.model_path`` names a model folder, or a hub id that resolves through the hub cache (downloaded
    into it first where the network allows and HF_HUB_OFFLINE is not set): else a ConfigError naming the id, the
    cache folder and the download command, in seconds, before any service starts (rlfleet.policies.hub)."""
    if not cfg.actor.model.get("model_path"):
        return
    from rlfleet.policies.hub import KEY, resolve_model_path

    try:
        resolve_model_path(cfg.actor.model.model_path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"'{KEY}': {str(exc).removeprefix(KEY + ': ')}") from None


def preflight_resume(cfg):
    """``runner.resume_dir`` (``coordinatorctl start --resume RUN``): its newest complete checkpoint checked whole
    before any service starts (rlfleet.data.checkpoint_files.verify_checkpoint: DCP metadata through a restricted
    unpickler, every shard it names present and long enough, learner_state.json, the reward normaliser's header,
    nothing linked out of the run folder), so a truncated or corrupt checkpoint is named in seconds rather than by
    the learner after every service has started. -> the checkpoint's folder, or ConfigError in one line."""
    from rlfleet.data.checkpoint_files import latest_checkpoint, verify_checkpoint
    from rlfleet.untrusted import BadFile

    run = cfg.runner.resume_dir
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise ConfigError(
            f"'runner.resume_dir': no complete checkpoint in {run}/checkpoints (a run saves one "
            f"every runner.save_interval epochs and at its end; learner_state.json marks it complete)"
        )
    try:
        verify_checkpoint(ckpt)
    except (BadFile, OSError) as exc:
        raise ConfigError(f"'runner.resume_dir': {exc}") from None
    return ckpt


def preflight_loggers(cfg) -> None:
    """A logger backend whose package is not installed where the learner runs (this environment, with the local
    launcher) fails the start in seconds with the exact pip commands that install it: rlfleet never changes the
    environment it runs in by itself (docs/configuration.md, "Metrics loggers")."""
    from rlfleet.data.loggers import install_hint, missing

    absent = missing(cfg.runner.logger.logger_backends)
    if absent:
        raise ConfigError(
            f"'runner.logger.logger_backends': {', '.join(absent)} not installed in this Python "
            f"environment ({sys.prefix}); install with:\n  {install_hint(absent)}\n(the same: {sys.executable} -m "
            f"rlfleet.data.loggers install {' '.join(absent)})"
        )


def env_side_preflight(cfg) -> list[str]:
    """The env side's preflight of ``cfg`` (a subprocess in the main environment): one 'key': why line per
    problem, [] when this host can run every env server."""
    from rlfleet.config import to_yaml

    proc = subprocess.run(
        [*ENV_SIDE_COMMAND, "preflight"],
        input=to_yaml(cfg),
        capture_output=True,
        text=True,
        env=child_environ(sys.executable, 1),
    )
    if proc.returncode not in (0, 3):
        raise ConfigError(
            f"the env side's preflight failed (exit {proc.returncode}): "
            + (proc.stderr.strip().splitlines() or ["no output"])[-1]
        )
    return [line for line in proc.stdout.splitlines() if line.strip()]


def preflight_external(cfg, *, rename: bool, timeout: float = 15.0) -> list[str]:
    """`coordinatorctl start` with ``cluster.external_env_addresses``: Describe every external server before
    anything starts. A server rlfleet cannot use, or one that does not answer, raises ConfigError naming the
    field; otherwise ``cfg`` takes the episode limit from the server (an external server ends its episodes by its
    own, docs/env-contract.md#describe) and, with ``rename``, the run is named after the simulator it serves.
    Returns notes to print."""
    import re

    from rlfleet.config import ConfigError, validate

    notes = []
    chunk = cfg.actor.model.num_action_chunks
    per_server = cfg.env.train.total_num_envs // cfg.cluster.num_env_servers
    first = None
    for key in ("external_env_addresses", "external_eval_env_addresses"):
        for i, address in enumerate(cfg.cluster[key]):
            address = str(address)
            try:  # counts scanned before the reply is parsed (docs/env-contract.md#limits)
                spec = describe_external(address, timeout)
            except TimeoutError:
                raise ConfigError(
                    f"'cluster.{key}[{i}]': no EnvService answered at {address} within {timeout:.0f}s; "
                    f"start the simulator first"
                ) from None
            except CallFailed as exc:
                raise ConfigError(f"'cluster.{key}[{i}]': {address} did not answer Describe: {describe(exc)}") from None
            except ValueError as exc:  # rlfleet.untrusted.TooLarge
                raise ConfigError(
                    f"'cluster.{key}[{i}]': the external env at {address} cannot be used: {exc} "
                    f"({env_contract.section('limits')})"
                ) from None
            problems = env_contract.run_problems(spec, policy_chunk=chunk)
            if problems:
                raise ConfigError(f"'cluster.{key}[{i}]': the external env at {address} cannot be used: {problems[0]}")
            if key == "external_env_addresses":
                if spec.num_envs != per_server:
                    raise ConfigError(
                        f"'env.train.total_num_envs': the external env at {address} hosts "
                        f"{spec.num_envs} envs; env.train.total_num_envs / cluster.num_env_servers is "
                        f"{per_server} (set env.train.total_num_envs="
                        f"{spec.num_envs * cfg.cluster.num_env_servers})"
                    )
                first = first or spec
    for split in ("train", "eval"):
        if cfg.env[split].max_episode_steps != first.max_episode_steps:
            notes.append(
                f"env.{split}.max_episode_steps: {first.max_episode_steps} from the external server's "
                f"Describe (the config said {cfg.env[split].max_episode_steps})"
            )
            cfg.env[split].max_episode_steps = int(first.max_episode_steps)
    validate(cfg)  # e.g. GRPO's whole episodes per epoch, against the server's episode limit
    if rename:
        simulator = env_contract.read(first).simulator
        name = re.sub(
            r"[^A-Za-z0-9_.-]+", "_", f"{simulator}_{first.env_id}" if simulator != "external" else first.env_id
        ).strip("_.")
        cfg.runner.experiment_name = f"external_{name or 'env'}"
    return notes
