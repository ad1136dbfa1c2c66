"""rlfleet.wire.codec: per-row, counter-based sampling noise, and the inference engine's batch invariance built on it."""

import warnings

import numpy as np
import pytest
import torch

from rlfleet.errors import InvalidRequest
from rlfleet.policies.base import sample_categorical
from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.wire.codec import RowNoise, row_keys
from rlfleet.wire.spaces import TensorSpace
from services.inference.engine import InferenceEngine
from tests.conftest import small_config


def test_keys_are_distinct_across_envs_epochs_and_steps():
    keys = np.concatenate([row_keys(np.arange(256), epoch, step) for epoch in range(5) for step in range(100)])
    assert keys.dtype == np.uint64 and len(np.unique(keys)) == len(keys)


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser in Python's integers (the reference the numpy version must equal)."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _mix(key: int, value: int) -> int:
    return _splitmix64((key + value * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))


def test_keys_and_draws_are_splitmix64_chains_bit_for_bit():
    """The keys and the uniform draws, recomputed from their definition in Python's integers (and the normal
    draws from those words): the vectorised arithmetic (in place, without numpy's error-state switches) is the same
    stream, warning-free, for arrays and scalars."""
    seeds, epoch, step = [0, 1, 7, 2**62 + 3], 2**40 + 5, 123
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from the wrapping arithmetic
        keys = row_keys(np.array(seeds), epoch, step)
        one = row_keys(seeds[2], epoch, step)
        noise = RowNoise(keys)
        u, z = noise.uniform((3,)), noise.normal((2,))
    expected = [_mix(_mix(_splitmix64(s), epoch), step) for s in seeds]
    assert keys.tolist() == expected and int(one) == expected[2]
    for i, key in enumerate(expected):
        words = [_mix(_mix(key, 1), j) for j in range(3)]  # the first call's block of the row's stream
        assert u[i].tolist() == [((w >> 11) + 0.5) / float(1 << 53) for w in words]
        w = [((x >> 11) + 0.5) / float(1 << 53) for x in (_mix(_mix(key, 2), j) for j in range(4))]
        want = [np.sqrt(-2.0 * np.log(w[j])) * np.cos(2.0 * np.pi * w[2 + j]) for j in range(2)]
        assert np.allclose(z[i], want, rtol=1e-6, atol=1e-7)  # Box-Muller on those words (libm's last bit aside)


def test_a_rows_draws_depend_on_its_key_only():
    keys = row_keys(np.arange(100), 2, 7)
    whole = RowNoise(keys)
    z1, u1 = whole.normal((3, 5)), whole.uniform((4,))
    part = RowNoise(keys[[42, 3, 99]])  # other rows, another order
    z2, u2 = part.normal((3, 5)), part.uniform((4,))
    assert np.array_equal(z2, z1[[42, 3, 99]]) and np.array_equal(u2, u1[[42, 3, 99]])
    assert not np.array_equal(z1[:, 0], z1[:, 1])  # successive draws of a row differ


def test_normal_and_categorical_draws_have_the_right_distribution():
    keys = row_keys(np.arange(20_000), 0, 0)
    z = RowNoise(keys).normal((4,))
    assert z.dtype == np.float32 and abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    assert abs((np.abs(z) < 1).mean() - 0.6827) < 0.01
    probs = torch.tensor([0.1, 0.2, 0.7])
    picks = sample_categorical(probs.log().expand(20_000, 3), RowNoise(keys)).numpy()
    freq = np.bincount(picks, minlength=3) / len(picks)
    assert np.allclose(freq, probs.numpy(), atol=0.015)


def _engine(block: int) -> InferenceEngine:
    cfg = small_config()
    engine = InferenceEngine(cfg.actor.model, batch_invariant_rows=block)
    specs = {"state": TensorSpace((13,), "float32")}
    torch.manual_seed(0)
    engine.set_weights(0, ActorCritic(specs, 4, hidden_dims=[64, 64]).state_dict(), obs_specs=specs, action_dim=4)
    return engine


def test_a_keyed_rows_action_is_the_same_in_any_batch():
    """Sampled actions, log-probs and values of a row are bit-identical whether it is acted on alone or among 36
    other rows, when act batches are padded to whole blocks (rollout.batch_invariant_rows)."""
    engine = _engine(32)
    obs = np.random.default_rng(0).normal(size=(37, 13)).astype(np.float32)
    keys = row_keys(np.arange(37), 0, 3)
    batch = engine.act_now({"state": obs}, False, None, keys)
    for i in (0, 5, 36):
        alone = engine.act_now({"state": obs[i : i + 1]}, False, None, keys[i : i + 1])
        assert np.array_equal(alone.actions[0], batch.actions[i])
        assert np.array_equal(alone.log_probs[0], batch.log_probs[i])
        assert np.array_equal(alone.values[0], batch.values[i])
    again = engine.act_now({"state": obs}, False, None, row_keys(np.arange(37), 0, 4))  # the next step's keys
    assert not np.array_equal(again.actions, batch.actions)
    keyless = engine.act_now({"state": obs}, False)
    assert keyless.actions.shape == (37, 1, 4)


def test_noise_keys_of_the_wrong_length_are_refused():
    engine = _engine(0)
    obs = {"state": np.zeros((3, 13), np.float32)}
    with pytest.raises(InvalidRequest, match="noise_keys: 2 keys for 3 observation rows"):
        engine.act_now(obs, False, None, [1, 2])
    with pytest.raises(InvalidRequest, match="noise_keys"):
        engine.submit(obs, False, noise_keys=[1, 2, 3, 4])
