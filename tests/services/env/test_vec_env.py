import numpy as np
import pytest

from rlfleet.errors import InvalidRequest
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
    assert list(out.final_rows) == [0, 1, 2]
    # episode returns are the sums of the rewards the steps reported
    env2 = make()
    env2.reset()
    total = np.zeros(3)
    for t in range(5):
        o = env2.step(None, np.full((3, 4), 0.3, np.float32))
        total += o.rewards
    assert np.allclose(sorted(e.episode_return for e in o.episodes), sorted(total), atol=1e-5)
    # after auto-reset the returned obs is a fresh episode, the final obs is the last of the old one
    assert not np.allclose(out.obs["state"], out.final_obs["state"])
    out2 = env.step([1], np.zeros((1, 4), np.float32))
    assert out2.obs["state"].shape == (1, 13) and not out2.episodes
    # only ended rows carry a final observation
    assert out2.final_obs["state"].shape == (0, 13) and out2.final_rows.size == 0
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
    with pytest.raises(InvalidRequest, match=r"actions: shape \[2, 3\] where \[2, 4\] or \[2, chunk, 4\] was expected"):
        env.step(None, np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidRequest, match=r"env_ids: unknown env id 7 \(this server hosts 0..1\)"):
        env.step([7], np.zeros((1, 4), np.float32))
    with pytest.raises(InvalidRequest, match="unknown env id 'PandaPickCub-v0'; did you mean 'PandaPickCube-v0'"):
        VecEnv("PandaPickCub-v0", 1, max_episode_steps=5)
    # nothing was lost: the envs still step
    assert env.step(None, np.zeros((2, 4), np.float32)).obs["state"].shape == (2, 13)


def test_action_chunks_run_as_sub_steps_and_stop_at_episode_end():
    a, b = make(2, max_episode_steps=6), make(2, max_episode_steps=6)
    a.reset(seeds=[3, 4])
    b.reset(seeds=[3, 4])
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, (2, 4, 4)).astype(np.float32)
    chunk = a.step(None, acts)  # one request with a 4-step chunk == four single steps
    singles = [b.step(None, acts[:, c]) for c in range(4)]
    assert chunk.rewards.shape == (2, 4) and chunk.terminated.shape == (2, 4)
    assert np.allclose(chunk.rewards, np.stack([s.rewards for s in singles], 1))
    assert np.allclose(chunk.obs["state"], singles[-1].obs["state"])
    # the episode ends at sub-step 2 of the next chunk (6 steps): the rest of the chunk is not executed
    out = a.step(None, acts)
    assert out.truncated[:, 1].all() and not out.truncated[:, 2:].any() and (out.rewards[:, 2:] == 0).all()
    assert len(out.episodes) == 2 and all(e.length == 6 for e in out.episodes)
    assert list(out.final_rows) == [0, 1] and out.final_obs["state"].shape == (2, 13)
    with pytest.raises(InvalidRequest, match="chunk of 100 sub-steps"):
        a.step(None, np.zeros((2, 100, 4), np.float32))
    nan = acts.copy()
    nan[1, 2, 0] = np.inf
    with pytest.raises(InvalidRequest, match="env row 1, sub-step 2, dim 0"):
        a.step(None, nan)


def test_actions_are_clipped_to_bounds():
    a, b = make(1), make(1)
    a.reset(seeds=[1])
    b.reset(seeds=[1])
    big = a.step(None, np.full((1, 4), 4.75, np.float32))
    one = b.step(None, np.ones((1, 4), np.float32))
    assert np.allclose(big.obs["state"], one.obs["state"])


def test_reset_state_ids_are_checked_and_instructions_reported():
    env = make(2)
    env.reset()
    assert env.instructions == ["pick up the red cube and lift it"] * 2
    with pytest.raises(InvalidRequest, match=r"reset_state_ids: state id 3 is not in \[0, 0\)"):
        env.reset([0], [1], [3])
    with pytest.raises(InvalidRequest, match="unknown simulator_type 'metawrld'; did you mean 'metaworld'"):
        VecEnv("reach-v3", 1, max_episode_steps=5, simulator="metawrld")


def test_one_vec_env_interface():
    """VecEnv, PolicySpaceEnv (and RemoteVecEnv: test_external_contract) implement VecEnvInterface with explicit
    members (no __getattr__ passthrough); a chunk steps through step_chunk into one result per row."""
    from rlfleet.wire.spaces import TensorSpace
    from services.env.policy_spaces import PolicySpaceEnv
    from services.env.remote import RemoteVecEnv
    from services.env.vec_env_interface import VecEnvInterface, step_chunk

    env = make(2)
    obs = {**env.observation_space, "extra": TensorSpace((3,), np.float32)}
    act = TensorSpace((6,), np.float32, -1, 1)
    wrapped = PolicySpaceEnv(env, obs, act)
    for e in (env, wrapped):
        assert isinstance(e, VecEnvInterface)
    for cls in (VecEnv, PolicySpaceEnv, RemoteVecEnv):
        assert "__getattr__" not in vars(cls), cls
    assert (wrapped.num_envs, wrapped.max_episode_steps, wrapped.simulator, wrapped.contract_version) == (
        2,
        5,
        "gym",
        "1",
    )
    assert wrapped.observation_space["extra"].shape == (3,) and wrapped.action_space.shape == (6,)
    assert wrapped.reset()["extra"].shape == (2, 3)
    out = step_chunk(wrapped, [0, 1], np.zeros((2, 3, 6), np.float32))
    assert out.rewards.shape == (2,) and out.terminated.shape == (2,) and out.obs["extra"].shape == (2, 3)
    out = step_chunk(wrapped, [0, 1], np.zeros((2, 1, 6), np.float32))
    assert out.rewards.shape == (2,)
    assert [e.length for e in step_chunk(env, [0, 1], np.zeros((2, 4, 4), np.float32)).episodes] == [5, 5]


def _record_threads(env: VecEnv) -> list[str]:
    """Wrap the backend's step to record the name of each thread it runs on."""
    import threading

    names, step = [], env.backend.step

    def recorded(ids, actions):
        names.append(threading.current_thread().name)
        return step(ids, actions)

    env.backend.step = recorded
    return names


def test_a_backend_bound_to_no_thread_steps_on_the_callers_thread_with_the_same_results():
    """PandaPickCube-v0's state env holds no renderer: its steps skip the hand-off to the simulator's thread (and
    give what they gave there); an env the backend knows nothing about stays on the simulator's thread."""
    import threading

    inline, handed = make(2), make(2)
    assert inline.any_thread and inline.backend.any_thread
    handed.any_thread = False  # as a thread-bound backend would run
    names = {id(e): _record_threads(e) for e in (inline, handed)}
    rng = np.random.default_rng(0)
    a, b = inline.reset(seeds=[3, 4]), handed.reset(seeds=[3, 4])
    np.testing.assert_array_equal(a["state"], b["state"])
    for _ in range(7):  # past an auto-reset (max_episode_steps 5)
        act = rng.uniform(-1, 1, (2, 4)).astype(np.float32)
        x, y = inline.step(None, act), handed.step(None, act)
        np.testing.assert_array_equal(x.obs["state"], y.obs["state"])
        np.testing.assert_array_equal(x.rewards, y.rewards)
    assert set(names[id(inline)]) == {threading.current_thread().name}
    assert all(n.startswith("sim") for n in names[id(handed)])
    inline.close(), handed.close()

    from services.env.envs.panda_pick_cube import PandaPickCubeVisionEnv

    assert not PandaPickCubeVisionEnv.steps_on_any_thread  # renders its observations: bound to its GL context
    other = VecEnv("Pendulum-v1", 1, max_episode_steps=5)  # any other gymnasium env may be bound to its thread
    assert not other.any_thread
    seen = _record_threads(other)
    other.reset()
    other.step(None, np.zeros((1, 1), np.float32))
    assert seen and all(n.startswith("sim") for n in seen)
    other.close()
