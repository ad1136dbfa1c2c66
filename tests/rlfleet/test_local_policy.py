"""rlfleet.policies.local: the policy a collocated env server holds (cluster.component_placement.rollout: env,
issue 37) acts as the inference engine does: the same checks of weights and observations, the same actions for the
same weights and noise keys (so a collocated run samples what an inference server would), and the config that
turns it on refuses what cannot run collocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.config import ConfigError, load_config, parse_placement, rollout_in_env
from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.policies import build_policy
from rlfleet.policies.local import LocalPolicy
from rlfleet.wire.codec import row_keys
from rlfleet.wire.spaces import TensorSpace
from services.inference.engine import InferenceEngine
from tests.conftest import INFERENCE_SERVER, small_config

torch.set_num_threads(1)

SPECS = {"state": TensorSpace((13,), "float32")}
ON = ["cluster.component_placement.rollout=env", "rollout.pipeline_stage_num=1"]


def _weights(cfg):
    torch.manual_seed(0)
    return build_policy(cfg.actor.model, SPECS, 4, True).state_dict()


def test_local_policy_acts_as_the_inference_engine():
    cfg = small_config()
    state = _weights(cfg)
    engine = InferenceEngine(cfg.actor.model, batch_invariant_rows=32)
    engine.set_weights(3, state, obs_specs=SPECS, action_dim=4)
    local = LocalPolicy(cfg.actor.model, batch_invariant_rows=32)
    with pytest.raises(FailedPrecondition, match="no policy weights loaded yet"):
        local.act_now({"state": np.zeros((2, 13), np.float32)}, False)
    local.set_weights(3, state, obs_specs=SPECS, action_dim=4)
    obs = {"state": np.random.default_rng(0).normal(size=(5, 13)).astype(np.float32)}
    keys = row_keys(np.arange(5, dtype=np.int64) + 7, 2, 11)
    for deterministic in (True, False):
        a = engine.act_now(obs, deterministic, None, keys)
        b = local.act_now(obs, deterministic, None, keys)
        assert b.weights_version == a.weights_version == 3
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.log_probs, b.log_probs)
        np.testing.assert_array_equal(a.values, b.values)
    # one row alone gets the action it got in the batch (its noise is its key's)
    one = local.act_now({"state": obs["state"][2:3]}, False, None, keys[2:3])
    np.testing.assert_array_equal(one.actions[0], local.act_now(obs, False, None, keys).actions[2])


def test_acting_copies_keep_the_normalisers_numbers_until_new_weights():
    """The env server's and the inference server's copies keep the observation normaliser's mean and standard
    deviation between acts (RunningMeanStd.keep_for_acting: the same bits as computing them each time), and a new
    weights set, full or partial, moves them: an act after it is the act of a fresh copy with those weights."""
    cfg = small_config()
    state = _weights(cfg)
    obs = {"state": np.random.default_rng(1).normal(size=(6, 13)).astype(np.float32)}

    def fresh(st):  # a copy that has never acted: nothing kept
        p = LocalPolicy(cfg.actor.model)
        p.set_weights(1, st, obs_specs=SPECS, action_dim=4)
        return p.act_now(obs, True).actions

    engine = InferenceEngine(cfg.actor.model)
    local = LocalPolicy(cfg.actor.model)
    for holder in (engine, local):
        holder.set_weights(1, state, obs_specs=SPECS, action_dim=4)
        assert holder.model.obs_rms.keep_for_acting
        first = holder.act_now(obs, True).actions
        np.testing.assert_array_equal(first, holder.act_now(obs, True).actions)  # from the kept numbers
        holder.model.obs_rms.keep_for_acting = False
        np.testing.assert_array_equal(first, holder.act_now(obs, True).actions)  # computed afresh: the same bits
        holder.model.obs_rms.keep_for_acting = True
        moved = dict(state, **{"obs_rms.mean": state["obs_rms.mean"] + 0.5, "obs_rms.var": state["obs_rms.var"] * 4})
        holder.set_weights(2, moved)
        after = holder.act_now(obs, True).actions
        assert not np.array_equal(after, first)
        np.testing.assert_array_equal(after, fresh(moved))
        # a partial set carries what changes in training (the engine's idle copy has the set before last)
        part = {k: v for k, v in moved.items() if k.startswith("obs_rms.")}
        part["obs_rms.mean"] = state["obs_rms.mean"] - 1.0
        holder.set_weights(3, part, partial=True)
        np.testing.assert_array_equal(holder.act_now(obs, True).actions, fresh(dict(moved, **part)))


def test_local_policy_checks_weights_and_observations():
    cfg = small_config()
    state = _weights(cfg)
    local = LocalPolicy(cfg.actor.model)
    with pytest.raises(InvalidRequest, match="first weights set must describe"):
        local.set_weights(0, state)
    local.set_weights(2, state, obs_specs=SPECS, action_dim=4)
    with pytest.raises(InvalidRequest, match="stale weights version 1 \\(serving 2\\)"):
        local.set_weights(1, state)
    name = next(iter(state))
    with pytest.raises(InvalidRequest, match="full set is missing tensor"):
        local.set_weights(3, {name: state[name]})
    local.set_weights(3, {name: state[name] * 0}, partial=True)  # a partial update
    assert local.version == 3 and torch.equal(local.model.state_dict()[name], state[name] * 0)
    with pytest.raises(InvalidRequest, match="observations\\['state'\\]: shape"):
        local.act_now({"state": np.zeros((2, 12), np.float32)}, False)
    with pytest.raises(InvalidRequest, match="noise_keys: 1 keys for 2"):
        local.act_now({"state": np.zeros((2, 13), np.float32)}, False, None, [1])


def test_the_default_acts_in_the_env_servers_where_it_can():
    """rollout: auto (the default): collocated acting for a small policy on a machine without GPUs, each pipeline
    stage an env server of its own; the inference server wherever the policy cannot act in the env servers."""
    from services.coordinator.plan import process_plan

    cfg = load_config(None, [])
    assert dict(cfg.cluster.component_placement) == {"env,actor": "all", "rollout": "env"}
    assert (cfg.cluster.num_env_servers, cfg.rollout.pipeline_stage_num) == (2, 1)
    assert [p.role for p in process_plan(cfg)] == ["learner", "env", "env"]
    assert load_config(None, ["cluster.num_env_servers=4", "env.eval.total_num_envs=40"]).cluster.num_env_servers == 4
    assert load_config(None, ["rollout.pipeline_stage_num=1"]).cluster.num_env_servers == 1
    assert rollout_in_env(load_config(None, ["cluster.component_placement={'env,rollout': auto, actor: all}"]))
    metaworld = [
        *(f"env.{s}.simulator_type=metaworld" for s in ("train", "eval")),
        "env.train.env_id=reach-v3",
        "env.eval.env_id=reach-v3",
    ]
    for why, overrides in {
        "GPUs": ["cluster.num_gpus_per_node=2"],
        "a VLA": ["actor.model.model_type=openvla"],
        "another backend": ["rollout.backend=vllm"],
        "a simulator in its own environment": metaworld,
        "external simulators": ["cluster.external_env_addresses=[127.0.0.1:1]"],
    }.items():
        try:
            other = load_config(None, overrides)
        except ConfigError:  # the combination is refused for its own reason; what auto chose was not that
            other = None
        if other is not None:
            assert not rollout_in_env(other), why
            assert dict(other.cluster.component_placement) == {"env,actor": "all", "rollout": "all"}, why
            assert (other.cluster.num_env_servers, other.rollout.pipeline_stage_num) == (1, 2), why


def test_collocated_placement_and_what_it_refuses():
    assert not rollout_in_env(load_config(None, [INFERENCE_SERVER]))
    cfg = load_config(None, ON)
    assert rollout_in_env(cfg)
    assert parse_placement({"env": "0-1", "actor": "2", "rollout": "env"}, 4) == {
        "env": [0, 1],
        "actor": [2],
        "rollout": [0, 1],
    }
    from services.coordinator.plan import process_plan

    assert [p.role for p in process_plan(cfg)] == ["learner", "env"]  # no inference server
    assert [p.role for p in process_plan(load_config(None, [INFERENCE_SERVER]))] == ["learner", "inference", "env"]
    with pytest.raises(ConfigError, match="rollout.pipeline_stage_num=1"):
        load_config(None, ["cluster.component_placement.rollout=env"])
    with pytest.raises(ConfigError, match="for small policies \\(mlp, cnn, sac\\); a policy of model_type openvla"):
        load_config(None, [*ON, "actor.model.model_type=openvla"])
    with pytest.raises(ConfigError, match="metaworld env servers run in their simulator's own Python environment"):
        load_config(
            None,
            [
                *ON,
                *(f"env.{s}.simulator_type=metaworld" for s in ("train", "eval")),
                "env.train.env_id=reach-v3",
                "env.eval.env_id=reach-v3",
            ],
        )
    with pytest.raises(ConfigError, match="'env' places only the rollout component"):
        load_config(None, ["cluster.component_placement={'env,rollout': env}", "rollout.pipeline_stage_num=1"])


def test_waiting_for_a_weights_version():
    """A synchronous epoch's Collect arrives before the learner has published its weights: the holder waits for
    the version (woken by the weights set itself), and gives up at its timeout or when told to stop."""
    import threading
    import time

    cfg = small_config()
    state = _weights(cfg)
    local = LocalPolicy(cfg.actor.model)
    local.set_weights(1, state, obs_specs=SPECS, action_dim=4)
    assert local.wait_for_version(1, timeout=0.0)  # already there
    t0 = time.monotonic()
    assert not local.wait_for_version(2, timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert not local.wait_for_version(2, timeout=60, should_stop=lambda: True)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(local.wait_for_version(3, timeout=60)))
    waiter.start()
    local.set_weights(2, state)  # not yet the version it waits for
    time.sleep(0.2)
    assert waiter.is_alive()
    t0 = time.monotonic()
    local.set_weights(3, state)
    waiter.join(10)
    assert woke == [True] and time.monotonic() - t0 < 1
