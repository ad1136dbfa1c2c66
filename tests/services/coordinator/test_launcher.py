"""Placement -> CUDA_VISIBLE_DEVICES per process, and the coordinator's config comparison (no processes)."""

from rlfleet.config import load_config, to_yaml
from services.coordinator.launcher import LocalLauncher
from services.coordinator.service_registry import config_difference
from tests.conftest import INFERENCE_SERVER


def test_devices_follow_component_placement(tmp_path):
    cfg = load_config(
        None,
        [
            "cluster.num_gpus_per_node=8",
            "cluster.num_env_servers=2",
            "cluster.component_placement={env: 0-3, rollout: 4-7, actor: 0-7}",
        ],
    )
    launcher = LocalLauncher(cfg, tmp_path, tmp_path / "config.yaml", "127.0.0.1:1")
    assert launcher.devices_for("env", 0) == "0,1"
    assert launcher.devices_for("env", 1) == "2,3"
    assert launcher.devices_for("inference", 0) == "4,5,6,7"
    assert launcher.devices_for("learner", 0) == "0,1,2,3,4,5,6,7"


def test_cpu_only_placement_hides_gpus(tmp_path):
    cfg = load_config()
    launcher = LocalLauncher(cfg, tmp_path, tmp_path / "config.yaml", "127.0.0.1:1")
    assert launcher.devices_for("env", 0) == ""


def test_config_difference_names_the_key():
    cfg = load_config()
    assert config_difference(cfg, to_yaml(load_config(None, ["cluster.launcher=attach"]))) == ""
    diff = config_difference(cfg, to_yaml(load_config(None, ["env.train.total_num_envs=128"])))
    assert diff.startswith("'env.train.total_num_envs' is 128 there, 64 here")
    import pytest

    from rlfleet.errors import InvalidRequest

    for bad, why in (
        ("cluster: [unclosed", "config_yaml: line 1 column 19: expected valid YAML"),
        ("- a list", "config_yaml: is not a mapping"),
    ):
        with pytest.raises(InvalidRequest, match=why.replace("[", r"\[")):
            config_difference(cfg, bad)


def _cpus(cfg, cores):
    from services.coordinator.plan import process_plan

    return {s.name: s.cpus for s in process_plan(cfg, cores=cores)}


def test_env_servers_are_pinned_only_where_that_measured_faster():
    # measured on 2 cores (docs/benchmarks.md, CPU placement): env servers one core each made the synchronous
    # collocated default faster; asynchronous runs and the inference-server layout keep the OS scheduler's choice
    cfg = load_config(None, [])  # sync, rollout: auto -> two collocated env servers
    assert _cpus(cfg, [0, 1]) == {"learner-0": (0, 1), "env-0": (0,), "env-1": (1,)}
    assert _cpus(cfg, [0, 1, 2, 3]) == {"learner-0": (0, 1, 2, 3), "env-0": (0, 1), "env-1": (2, 3)}
    assert _cpus(cfg, [0]) == {"learner-0": (0,), "env-0": (0,), "env-1": (0,)}  # fewer cores than env servers
    for unpinned in (
        ["algorithm.max_staleness=1"],
        ["cluster.num_env_servers=2", INFERENCE_SERVER],
        ["cluster.cpu_placement={}"],  # the user's map replaces the default: nothing placed
    ):
        assert set(_cpus(load_config(None, unpinned), [0, 1]).values()) == {()}, unpinned
    from services.coordinator.plan import process_plan

    cfg = load_config(None, ["cluster.cpu_placement={env: 0}"])  # containers and other hosts: never pinned
    assert {s.cpus for s in process_plan(cfg)} == {()}
    assert {s.cpus for s in process_plan(load_config(None, []))} == {()}


def test_cpu_placement_override_splits_a_range_over_servers():
    cfg = load_config(
        None,
        ["cluster.num_env_servers=2", "cluster.cpu_placement={env: 0-3, actor: 4, rollout: all}", INFERENCE_SERVER],
    )
    got = _cpus(cfg, list(range(6)))
    assert got == {"learner-0": (4,), "inference-0": tuple(range(6)), "env-0": (0, 1), "env-1": (2, 3)}
    assert _cpus(load_config(None, ["cluster.cpu_placement={env: 0}"]), [0, 1])["learner-0"] == (0, 1)  # unplaced


def test_cpu_placement_errors_name_the_key():
    import pytest

    from rlfleet.config import ConfigError

    for override, cores, why in (
        ("{env: 0-2}", [0, 1], "'cluster.cpu_placement.env': CPU core 2 in '0-2' is outside"),
        ("{env: 1}", [0, 2], r"'cluster.cpu_placement.env': core\(s\) \[1\] of '1' are not usable here"),
        ("{envs: 0}", [0, 1], "unknown component 'envs'.*did you mean 'env'"),
        ("{env: x}", [0, 1], "'cluster.cpu_placement.env': 'x' is not a CPU core range"),
        ("{env,rollout: 0}", [0, 1], "'cluster.cpu_placement.env': no CPU core range given .* quote a key"),
        ("{actor: auto}", [0, 1], "'cluster.cpu_placement.actor': 'auto' places only the env component"),
        ("{env: autoo}", [0, 1], "'cluster.cpu_placement.env': 'autoo' is not a CPU core range .* env alone, 'auto'"),
    ):
        with pytest.raises(ConfigError, match=why):
            _cpus(load_config(None, [f"cluster.cpu_placement={override}"]), cores)


def test_a_placement_outside_this_machine_is_refused_before_any_service_starts(monkeypatch):
    import os

    import pytest

    from rlfleet.config import ConfigError
    from services.coordinator.launcher import check_local

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    check_local(load_config())
    with pytest.raises(ConfigError, match="'cluster.cpu_placement.env': CPU core 5 in '5' is outside"):
        check_local(load_config(None, ["cluster.cpu_placement={env: 5}"]))


def test_launcher_hands_each_process_its_cores(tmp_path, monkeypatch):
    import os
    import subprocess

    from rlfleet.wire.service import CPU_CORES_ENV

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env, **kw):
            index = cmd[cmd.index("--index") + 1]
            seen[f"{cmd[2].split('.')[1]}-{index}"] = env.get(CPU_CORES_ENV)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    cfg = load_config(None, ["cluster.cpu_placement={'env,rollout': 0, actor: 1}", INFERENCE_SERVER])
    LocalLauncher(cfg, tmp_path, tmp_path / "c.yaml", "127.0.0.1:1").start_all()
    assert seen == {"learner-0": "1", "inference-0": "0", "env-0": "0"}
    seen.clear()
    LocalLauncher(load_config(), tmp_path, tmp_path / "c.yaml", "127.0.0.1:1").start_all()
    assert seen == {"learner-0": "0,1", "env-0": "0", "env-1": "1"}  # the default (env: auto): one core each
    seen.clear()
    LocalLauncher(load_config(None, ["cluster.cpu_placement={}"]), tmp_path, tmp_path / "c.yaml", "1:1").start_all()
    assert set(seen.values()) == {None}


def test_a_service_pins_itself_to_its_cores():
    import os
    import subprocess
    import sys

    core = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import os; from rlfleet.wire.service import pin_to_placed_cores; pin_to_placed_cores(); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RLFLEET_CPU_CORES": str(core)},
    )
    assert out.stdout.strip() == f"[{core}]"
