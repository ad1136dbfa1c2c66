"""Simulator environments: lock keys, pip source translation, build/cache/failure of a real (tiny) environment."""

from __future__ import annotations

import subprocess
import threading

import pytest

from rlfleet.simulators import SIMULATORS, Environment, environments, get_simulator

TINY = Environment(name="tiny", pip=("six",), check="import six, grpc, omegaconf")


def test_lock_key_follows_what_is_installed():
    a = Environment(name="x", pip=("six==1.16.0",))
    assert environments.lock_key(a) == environments.lock_key(Environment(name="x", pip=("six==1.16.0",)))
    assert environments.lock_key(a) != environments.lock_key(Environment(name="x", pip=("six==1.17.0",)))
    assert environments.env_path(a, "/e").name.startswith("x-")
    # packages installed without their dependencies count too (and an environment without any keeps its key)
    assert environments.lock_key(
        Environment(name="x", pip=("six==1.16.0",), no_deps=("lerobot==0.4.4",))
    ) != environments.lock_key(a)


def test_registry_names_and_errors():
    assert {"gym", "metaworld", "behavior"} <= set(SIMULATORS)
    with pytest.raises(KeyError, match="unknown simulator_type 'metawrld'; did you mean 'metaworld'"):
        get_simulator("metawrld")
    rows = {r["simulator"]: r for r in environments.describe("/nonexistent")}
    assert rows["gym"]["installed"] and rows["gym"]["environment"] == "main"
    assert not rows["metaworld"]["installed"]


@pytest.mark.sim
def test_build_once_cached_and_concurrent_callers_wait(tmp_path):
    lines: list[str] = []
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(environments.ensure(TINY, str(tmp_path), lines.append)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 2 and results[0] == results[1]
    assert sum("building the tiny environment" in line for line in lines) == 1  # built once
    assert any("ready in" in line for line in lines)
    out = subprocess.run([str(results[0]), "-c", "import six, sys; print(sys.prefix)"], capture_output=True, text=True)
    assert out.returncode == 0 and str(tmp_path) in out.stdout
    assert environments.is_installed(TINY, str(tmp_path))
    again: list[str] = []
    assert environments.ensure(TINY, str(tmp_path), again.append) == results[0] and again == []  # cached


@pytest.mark.sim
def test_failed_build_names_the_command_and_is_not_cached(tmp_path):
    bad = Environment(name="bad", pip=("six",), check="import no_such_module_here")
    with pytest.raises(environments.EnvironmentError_, match="no_such_module_here"):
        environments.ensure(bad, str(tmp_path), lambda *a: None)
    assert not environments.is_installed(bad, str(tmp_path))


@pytest.mark.sim
def test_no_deps_packages_are_installed_without_their_dependencies(tmp_path):
    """How lerobot goes into its test environment without its torch<2.11 pin (tests/simenv.py LEROBOT_ENV)."""
    env = Environment(name="nodeps", pip=("six",), no_deps=("python-dateutil",), check="import six")
    lines: list[str] = []
    python = environments.ensure(env, str(tmp_path), lines.append)
    assert any("--no-deps" in line and "python-dateutil" in line for line in lines), lines
    out = subprocess.run(
        [str(python), "-c", "import dateutil; print(dateutil.__version__)"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
