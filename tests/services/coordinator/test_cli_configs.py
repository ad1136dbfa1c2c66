"""A misspelled config name: the nearest built-in config, and `coordinatorctl configs`, which lists them all."""

from __future__ import annotations

import pytest

from rlfleet.config import ConfigError, builtin_configs, load_config
from services.coordinator import cli


def test_a_misspelled_config_names_the_nearest_and_the_list(capsys):
    with pytest.raises(ConfigError) as err:
        load_config("pandapickcube_vsion_ppo")
    msg = str(err.value)
    assert "did you mean 'pandapickcube_vision_ppo'?" in msg and "`coordinatorctl configs` lists them" in msg
    assert "maniskill" not in msg  # not the whole list any more
    assert cli.main(["start", "pandapickcube_vsion_ppo"]) == 2
    assert "did you mean 'pandapickcube_vision_ppo'?" in capsys.readouterr().err
    with pytest.raises(ConfigError) as err:  # nothing near: no guess, the pointer still
        load_config("/nowhere/zzz.yaml")
    assert "did you mean" not in str(err.value) and "coordinatorctl configs" in str(err.value)


def test_configs_lists_every_built_in_config(capsys):
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    names = builtin_configs()
    assert len(names) >= 20 and f"{len(names)} built-in configs" in out
    for name in names:
        assert f"\n{name} " in out
    assert "PPO with a small CNN encoder on PandaPickCubeVision-v0" in out
