"""The typed config views (rlfleet.config.views) and the configuration page generated from the schema's comments
(rlfleet.config.docs)."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from rlfleet.config import CONFIG_DIR, ConfigError, config_from_yaml, env_server_config, load_config, to_yaml
from rlfleet.config.schema import comments, schema_keys
from rlfleet.config.views import (
    VIEWS,
    CoordinatorView,
    EnvView,
    InferenceView,
    LearnerView,
    build_view,
    field_docs,
    learner_view,
)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_builtin_config_gives_valid_views(path):
    cfg = load_config(path)
    for cls in VIEWS:
        view = build_view(cls, cfg)
        assert dataclasses.is_dataclass(view)
    lv = learner_view(cfg)
    assert lv.algorithm.gamma == cfg.algorithm.gamma and lv.micro_batch_size == cfg.actor.micro_batch_size
    assert lv.model.model_type == cfg.actor.model.model_type
    assert build_view(InferenceView, cfg).max_batch_size == cfg.rollout.max_batch_size
    assert build_view(EnvView, cfg).pipeline_stage_num == cfg.rollout.pipeline_stage_num
    assert build_view(CoordinatorView, cfg).total_num_envs == cfg.env.train.total_num_envs
    for index in range(cfg.cluster.num_env_servers):  # each env server's own view (env.per_server)
        server = env_server_config(cfg, index)
        assert build_view(EnvView, server).train.simulator_type == server.env.train.simulator_type


def test_views_are_frozen_and_typed():
    view = learner_view(config_from_yaml(to_yaml(load_config(None, ["algorithm.gamma=1"]))))
    assert view.algorithm.gamma == 1.0 and isinstance(view.algorithm.gamma, float)  # an int where a float belongs
    assert view.logger_backends == ("tensorboard",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.seed = 2  # type: ignore[misc]
    with pytest.raises(Exception):  # the policy's sub-tree is read-only too
        view.model.hidden_dims = [4]


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("algorithm.gamma", "high", "float"),
        ("actor.micro_batch_size", 1.5, "int"),
        ("runner.logger.logger_backends", "tensorboard", "list of str"),
        ("algorithm.normalize_obs", 1, "bool"),
        ("runner.resume_dir", 3, "str or null"),
    ],
)
def test_wrong_type_refused_naming_the_key(key, value, expected):
    cfg = load_config()
    OmegaConf.update(cfg, key, value)  # what a hand-edited run folder's config.yaml could hold
    cls = next(c for c in VIEWS if any(k == key for _, _, k, _ in field_docs(c)))
    with pytest.raises(ConfigError, match=rf"'{key}' = .* has the wrong type \(expected {expected}\)"):
        build_view(cls, cfg)


def test_missing_key_refused():
    cfg = load_config()
    del cfg.rollout["max_batch_size"]
    with pytest.raises(ConfigError, match="'rollout.max_batch_size': missing"):
        build_view(InferenceView, cfg)


def test_every_field_names_a_schema_key_and_its_comment():
    known = comments()
    for cls in VIEWS:
        for name, kind, key, doc in field_docs(cls):
            assert key in known, (cls.__name__, name, key)
            assert doc and (doc == known[key] or not known[key]), (cls.__name__, name)  # a group: its own doc
            assert kind
    assert all(k.comment for k in schema_keys() if not k.group)  # every value key of the schema has its comment
    with pytest.raises(TypeError):
        build_view(dict, load_config())


def test_configuration_page_reference_is_in_step_with_the_schema():
    from rlfleet.config import docs

    page = docs.PAGE.read_text()
    assert docs.BEGIN in page and docs.END in page
    assert not docs.stale(), (
        f"docs/configuration.md's reference is out of step with the schema's comments "
        f"(rlfleet/configs/pandapickcube_ppo.yaml and the size YAMLs): run `{docs.FIX}`"
    )
    for key in schema_keys():  # every key, its default and its comment
        if not key.group:
            assert f"| `{key.path}` |" in page, key.path
    assert "| `rollout` |" in page and "| `actor` |" in page  # the glossary above the block


def test_stale_page_detected(tmp_path):
    from rlfleet.config import docs

    page = tmp_path / "configuration.md"
    page.write_text(docs.PAGE.read_text().replace("| `algorithm.gamma` |", "| `algorithm.gama` |"))
    assert docs.stale(page)
    assert docs.main(["--check"]) == 0


def test_a_service_refuses_a_wrong_type_at_start_up_naming_the_key(tmp_path):
    """What a service's ``main`` does with a config whose value its view cannot take: exit before anything starts,
    naming the key (as ``load_service_config`` does for a config that does not load)."""
    from rlfleet.config.views import SftView, service_view

    cfg = load_config()
    OmegaConf.update(cfg, "rollout.max_wait_ms", "soon")
    with pytest.raises(SystemExit, match=r"config error: 'rollout\.max_wait_ms' = 'soon' has the wrong type"):
        service_view(InferenceView, cfg)
    assert service_view(LearnerView, cfg).seed == cfg.runner.seed  # a key the learner does not read is not its concern
    assert service_view(SftView, cfg).max_steps == cfg.sft.max_steps


def test_cores_take_their_view_not_the_config(tmp_path):
    import torch

    from services.learner.learner import Learner

    torch.set_num_threads(1)
    with pytest.raises(TypeError, match="learner_view"):
        Learner(load_config(), tmp_path / "run")
