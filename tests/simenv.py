"""Test helper: run code inside a simulator's own Python environment (built on first use, like a run does).

Where an environment (a simulator's, or an inference backend's such as vLLM) cannot be built here, the test that
needs it is skipped, saying why; with ``RLFLEET_REQUIRE_ENVS=1`` (CI, ``.ci/run``) it fails with the same message
instead, so a run that silently tested less cannot pass.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import NoReturn

import pytest

from rlfleet.simulators import environments

REQUIRE_ENVS = "RLFLEET_REQUIRE_ENVS"


def envs_required() -> bool:
    """Whether an environment that cannot be built fails the test (``RLFLEET_REQUIRE_ENVS=1``) or skips it."""
    return os.environ.get(REQUIRE_ENVS, "").strip().lower() in ("1", "true", "yes", "on")


def unavailable(reason: str) -> NoReturn:
    """A simulator's or inference backend's environment is unavailable: skip the test saying why, or fail it with
    the same message where ``RLFLEET_REQUIRE_ENVS`` is set. Every such skip in the tests goes through here."""
    if envs_required():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def sim_python(simulator: str) -> str:
    """The environment's python; skips the test (saying why) when the environment cannot be built here, or fails
    it under ``RLFLEET_REQUIRE_ENVS=1``."""
    from services.env.environment import python_for  # the env side builds it, with its finishing steps

    try:
        return python_for(simulator, None, lambda *a, **k: None)
    except environments.EnvironmentError_ as exc:
        unavailable(f"the {simulator} environment could not be built here: {str(exc).splitlines()[0]}")


def backend_python(backend: str) -> str:
    """The python of an inference backend's environment (vllm); skips the test (saying why) when it cannot be
    built here, or fails it under ``RLFLEET_REQUIRE_ENVS=1``."""
    from rlfleet.policies.backends import get_backend

    env = get_backend(backend).environment
    try:
        return str(environments.ensure(env, log=lambda *a, **k: None))
    except environments.EnvironmentError_ as exc:
        unavailable(f"the {backend} environment could not be built here: {str(exc).splitlines()[0]}")


def _run_json(what: str, python: str, code: str, timeout: float, env_vars: dict) -> dict:
    """Run ``code`` with ``python`` (the checkout on PYTHONPATH, no stdin); -> the JSON of its last stdout line."""
    env = {**os.environ, "PYTHONPATH": str(environments.REPO_ROOT), **env_vars}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=str(environments.REPO_ROOT),
    )
    if proc.returncode != 0:
        raise AssertionError(f"{what} subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_in_env(simulator: str, code: str, timeout: float = 300.0, **env_vars: str) -> dict:
    """Run ``code`` (which must print one JSON line last) with the simulator environment's python (or an
    inference backend's: ``simulator`` "backend:vllm") and the checkout on PYTHONPATH; returns the parsed JSON."""
    python = backend_python(simulator.partition(":")[2]) if simulator.startswith("backend:") else sim_python(simulator)
    return _run_json(simulator, python, code, timeout, {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), **env_vars})


# lerobot, to check that rlfleet's datasets are LeRobot's: its dataset code, unmodified, in an environment of its own
# (docs/testing.md). lerobot 0.4.4 pins torch<2.11, torchvision<0.26 and torchcodec<0.11; PyPI's builds of those are
# CUDA builds that need a matching CUDA torch, and torchvision >= 0.24 has no video decoding left, so lerobot decodes
# video with torchcodec only. No CPU build of torchvision or torchcodec exists on PyPI for rlfleet's torch 2.13.0 CPU
# wheel (both fail to load beside it), so this environment takes the newest CUDA trio that loads on a CPU machine
# (torch 2.14.1, torchvision 0.29.1, torchcodec 0.17.0; local wheels on this kind of machine, about 4 GB of disk) and
# installs lerobot itself without its pins, plus exactly what lerobot.datasets imports. torchcodec decodes with the
# host's FFmpeg (Debian 12: FFmpeg 5.1's libraries).
LEROBOT_ENV = environments.Environment(
    name="lerobot",
    pip=(
        "torch==2.14.1",
        "torchvision==0.29.1",
        "torchcodec==0.17.0",
        "datasets==4.8.5",
        "huggingface-hub==0.35.3",
        "accelerate==1.15.0",
        "jsonlines==4.0.0",
        "pandas==3.1.1",
        "numpy>=1.26,<3",
    ),
    no_deps=("lerobot==0.4.4",),
    apt=(
        "libavutil57",
        "libavcodec59",
        "libavformat59",
        "libavdevice59",
        "libavfilter8",
        "libswscale6",
        "libswresample4",
    ),
    check="import lerobot.datasets.lerobot_dataset, torchcodec.decoders",
    notes="lerobot 0.4.4's dataset code (no deps) on torch 2.14.1 + torchvision 0.29.1 + torchcodec 0.17.0",
)


def run_lerobot(code: str, timeout: float = 300.0) -> dict:
    """Run ``code`` (which must print one JSON line last) with lerobot's python (built on first use; skipped or,
    under ``RLFLEET_REQUIRE_ENVS=1``, failed when it cannot be built); returns the parsed JSON."""
    try:
        python = str(environments.ensure(LEROBOT_ENV, log=lambda *a, **k: None))
    except environments.EnvironmentError_ as exc:
        unavailable(f"the lerobot environment could not be built here: {str(exc).splitlines()[0]}")
    return _run_json("lerobot", python, code, timeout, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
