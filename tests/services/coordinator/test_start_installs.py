"""`coordinatorctl start` does what `coordinatorctl envs install NAME` does when the run's simulator lacks Debian
packages (ManiSkill's Vulkan loader) and it can (root, apt-get); else it refuses as before, naming that command.
Nothing is installed here: the system-package and build steps are recorded, not run."""

from __future__ import annotations

import pytest

from rlfleet.config import ConfigError, load_config
from rlfleet.simulators import environments
from services.coordinator import launcher, preflight

REFUSAL = (
    "'env.train.simulator_type': maniskill: the Vulkan loader (libvulkan.so.1) is not installed. ... "
    "`coordinatorctl envs install maniskill` does this when run as root"
)


@pytest.fixture
def host(monkeypatch):
    """A host whose maniskill packages are missing until the recorded install step 'installs' them."""
    state = {"root": True, "apt_get": True, "missing": ["libvulkan1", "mesa-vulkan-drivers>=25"], "did": []}

    def missing_apt(env):
        return list(state["missing"]) if env.name == "maniskill" else []

    def ensure_system_packages(env, log=print):
        state["did"].append(("system-packages", env.name))
        state["missing"] = []

    def simulator_python(name, envs_dir=None, log=print):
        state["did"].append(("environment", name))
        return f"/envs/{name}/bin/python"

    monkeypatch.setattr(preflight.os, "geteuid", lambda: 0 if state["root"] else 1000)
    real_which = preflight.shutil.which
    monkeypatch.setattr(
        preflight.shutil,
        "which",
        lambda cmd: ("/usr/bin/apt-get" if state["apt_get"] else None) if cmd == "apt-get" else real_which(cmd),
    )
    monkeypatch.setattr(environments, "missing_apt", missing_apt)
    monkeypatch.setattr(environments, "ensure_system_packages", ensure_system_packages)
    monkeypatch.setattr(launcher, "simulator_python", simulator_python)
    # the env side's preflight (a subprocess) refuses while the packages are missing
    monkeypatch.setattr(preflight, "env_side_preflight", lambda cfg: [REFUSAL] if state["missing"] else [])
    return state


def test_start_installs_what_envs_install_would_when_it_can(host, capsys):
    if preflight.shutil.which("dpkg") is None:
        pytest.skip("not a Debian host: nothing rlfleet installs")
    cfg = load_config("maniskill_pushcube_ppo_mlp")
    assert preflight.missing_system_packages(cfg) == {"maniskill": ["libvulkan1", "mesa-vulkan-drivers>=25"]}
    assert preflight.can_install_system_packages()
    preflight.preflight_local(cfg)  # no refusal: installed, then the env side asked again
    assert host["did"] == [("system-packages", "maniskill"), ("environment", "maniskill")]
    out = capsys.readouterr().out
    assert "maniskill needs Debian packages this host lacks (libvulkan1, mesa-vulkan-drivers>=25)" in out
    assert "`coordinatorctl envs install maniskill`" in out and "maniskill: installed" in out


@pytest.mark.parametrize("why", ["not root", "no apt-get"])
def test_start_refuses_as_before_when_it_cannot(host, why):
    host["root" if why == "not root" else "apt_get"] = False
    cfg = load_config("maniskill_pushcube_ppo_mlp")
    assert not preflight.can_install_system_packages()
    with pytest.raises(ConfigError, match="`coordinatorctl envs install maniskill` does this when run as root"):
        preflight.preflight_local(cfg)
    assert host["did"] == []


def test_nothing_is_installed_for_a_refusal_packages_do_not_fix(host):
    host["missing"] = []  # the packages are there: the refusal is about something else (a task id, say)
    cfg = load_config("maniskill_pushcube_ppo_mlp")
    assert preflight.missing_system_packages(cfg) == {}
    assert not preflight.install_missing(cfg)
    assert host["did"] == []
    # and a run of the main environment's simulator never looks for packages to install
    assert preflight.missing_system_packages(load_config(None)) == {}


def test_a_failed_install_is_one_line_naming_the_simulator(host, monkeypatch):
    if preflight.shutil.which("dpkg") is None:
        pytest.skip("not a Debian host")

    def fail(env, log=print):
        raise environments.EnvironmentError_("[env maniskill] command failed (exit 100): apt-get update -qq")

    monkeypatch.setattr(environments, "ensure_system_packages", fail)
    with pytest.raises(ConfigError, match="installing maniskill failed: .*apt-get update"):
        preflight.preflight_local(load_config("maniskill_pushcube_ppo_mlp"))
