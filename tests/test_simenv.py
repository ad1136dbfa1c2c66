"""The rule for tests whose simulator or vLLM environment cannot be built: skipped, or failed under
RLFLEET_REQUIRE_ENVS=1 (CI). No environment is built here: the builder is made to fail."""

from __future__ import annotations

import pytest

from rlfleet.simulators import environments
from tests import simenv


@pytest.fixture
def build_fails(monkeypatch):
    def ensure(env, *args, **kwargs):
        raise environments.EnvironmentError_(f"uv could not install {env.name}\nmore detail")

    monkeypatch.setattr(environments, "ensure", ensure)


@pytest.mark.parametrize("get_python, name", [(simenv.sim_python, "metaworld"), (simenv.backend_python, "vllm")])
def test_an_unbuildable_environment_skips_the_test_unless_environments_are_required(
    monkeypatch, build_fails, get_python, name
):
    monkeypatch.delenv(simenv.REQUIRE_ENVS, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"the {name} environment could not be built here: uv could"):
        get_python(name)
    for value in ("1", "true"):
        monkeypatch.setenv(simenv.REQUIRE_ENVS, value)
        with pytest.raises(pytest.fail.Exception) as failed:
            get_python(name)
        assert str(failed.value) == (
            f"the {name} environment could not be built here: uv could not install "
            f"{environments.environment_of(name).name}"
        )  # skip's message, first line
    monkeypatch.setenv(simenv.REQUIRE_ENVS, "0")
    with pytest.raises(pytest.skip.Exception):
        get_python(name)


def test_a_built_environment_runs_the_test_either_way(monkeypatch, tmp_path):
    python = tmp_path / "bin" / "python"
    monkeypatch.setattr(environments, "ensure", lambda env, *a, **k: python)
    for value in ("1", None):
        if value is None:
            monkeypatch.delenv(simenv.REQUIRE_ENVS, raising=False)
        else:
            monkeypatch.setenv(simenv.REQUIRE_ENVS, value)
        assert simenv.sim_python("libero") == str(python)
