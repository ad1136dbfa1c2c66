import numpy as np
import pytest

from rlfleet.rpc import InvalidRequest
from services.env.vec_env import VecEnv


def make(n=3, **kw):
    kw.setdefault("max_episode_steps", 5)
    return VecEnv("PandaPickCube-v0", n, **kw)


def test_auto_reset_final_obs_and_episode_stats():
    env = make()
    obs0 = env.reset()
    assert obs0["state"].shape == (3, 13) and obs0["state"].dtype == np.float32
    for t in range(5):
        out = env.step(None, np.zeros((3, 4), np.float32))
    assert out.truncated.all() and not out.terminated.any()
    assert len(out.episodes) == 3 and all(e.length == 5 for e in out.episodes)
    assert np.allclose([e.episode_return for e in out.episodes], [e.episode_return for e in out.episodes])
    # after auto-reset the returned obs is a fresh episode, the final obs is the last of the old one
    assert not np.allclose(out.obs["state"], out.final_obs["state"])
    out2 = env.step([1], np.zeros((1, 4), np.float32))
    assert out2.obs["state"].shape == (1, 13) and not out2.episodes
    env.close()


def test_seeded_reset_is_deterministic():
    a, b = make(2), make(2)
    assert np.array_equal(a.reset(seeds=[5, 6])["state"], b.reset(seeds=[5, 6])["state"])
    assert not np.array_equal(a.reset(seeds=[5, 7])["state"][1], b.reset(seeds=[5, 6])["state"][1])


def test_no_auto_reset_freezes_finished_envs():
    env = make(2, auto_reset=False)
    env.reset()
    for _ in range(5):
        out = env.step(None, np.zeros((2, 4), np.float32))
    assert len(out.episodes) == 2
    frozen = env.step(None, np.ones((2, 4), np.float32))
    assert not frozen.episodes and (frozen.rewards == 0).all()
    assert np.array_equal(frozen.obs["state"], out.obs["state"])


def test_bad_input_is_named():
    env = make(2)
    env.reset()
    nan = np.zeros((2, 4), np.float32)
    nan[1, 3] = np.nan
    with pytest.raises(InvalidRequest, match="actions: non-finite value nan for env row 1, dim 3"):
        env.step(None, nan)
    with pytest.raises(InvalidRequest, match=r"actions: shape \[2, 3\] where \[2, 4\] was expected"):
        env.step(None, np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidRequest, match=r"env_ids: unknown env id 7 \(this server hosts 0..1\)"):
        env.step([7], np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidRequest, match="unknown env id 'PandaPickCub-v0'; did you mean 'PandaPickCube-v0'"):
        VecEnv("PandaPickCub-v0", 1, max_episode_steps=5)
    # nothing was lost: the envs still step
    assert env.step(None, np.zeros((2, 4), np.float32)).obs["state"].shape == (2, 13)
