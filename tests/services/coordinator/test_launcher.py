"""Placement -> CUDA_VISIBLE_DEVICES per process, and the coordinator's config comparison (no processes)."""

from rlfleet.config import load_config, to_yaml
from services.coordinator.registry import config_difference
from services.coordinator.launcher import LocalLauncher


def test_devices_follow_component_placement(tmp_path):
    cfg = load_config(None, ["cluster.num_gpus_per_node=8", "cluster.num_env_servers=2",
                             "cluster.component_placement={env: 0-3, rollout: 4-7, actor: 0-7}"])
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

    from rlfleet.rpc import InvalidRequest

    for bad, why in (("cluster: [unclosed", "config_yaml: does not parse as YAML"),
                     ("- a list", "config_yaml: is not a mapping")):
        with pytest.raises(InvalidRequest, match=why.replace("[", r"\[")):
            config_difference(cfg, bad)
