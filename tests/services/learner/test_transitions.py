"""A rollout as transitions: every row's next observation from the rollout's own rows and its tail."""

from __future__ import annotations

import numpy as np

from rlfleet.wire import codec
from rlfleet.wire.spaces import TensorSpace
from services.learner.replay import ReplayBuffer
from services.learner.transitions import transitions


def _rollout(T=4, N=3):
    obs = np.arange(T * N * 2, dtype=np.float32).reshape(T, N, 2)
    tm = {
        "obs.state": obs,
        "actions": np.arange(T * N * 2, dtype=np.float32).reshape(T, N, 1, 2) / 100,
        "fi.actions": np.zeros((T, N, 2), np.float32),
        "log_probs": np.zeros((T, N, 1), np.float32),
        "values": np.zeros((T, N), np.float32),
        "rewards": np.arange(T * N, dtype=np.float32).reshape(T, N),
        "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool),
        "loss_mask": np.ones((T, N), bool),
        "weights_version": np.full((T, N), 7, np.int64),
    }
    tm["terminated"][1, 0] = True  # env 0's episode ends at t=1 (terminal), env 2's is cut at t=3 (the last step)
    tm["truncated"][3, 2] = True
    final = np.array([[-1.0, -1.0], [-3.0, -3.0]], np.float32)
    tail = codec.make_tail({"state": np.full((N, 2), 99.0, np.float32)}, [1 * N + 0, 3 * N + 2], {"state": final})
    return {"time": tm, "tail": tail, "episodes": []}


def test_each_rows_next_observation_is_the_next_row_the_final_one_or_the_one_after_the_last_step():
    part = _rollout()
    tm = part["time"]
    codec.check_rollout(
        tm, part["tail"], obs_specs={"state": TensorSpace((2,), "float32")}, chunk=1, action_dim=2, log_prob_width=1
    )
    tr = transitions(part)
    nxt = tr["next_obs.state"].reshape(4, 3, 2)
    assert np.array_equal(nxt[0], tm["obs.state"][1])  # no episode ended at t=0
    assert np.array_equal(nxt[1, 0], [-1.0, -1.0])  # env 0 terminated at t=1: its final observation
    assert np.array_equal(nxt[1, 1:], tm["obs.state"][2, 1:])
    assert np.array_equal(nxt[3, :2], np.full((2, 2), 99.0))  # after the last step
    assert np.array_equal(nxt[3, 2], [-3.0, -3.0])  # env 2 truncated at the last step: its final observation
    assert np.array_equal(tr["obs.state"], tm["obs.state"].reshape(12, 2))
    assert tr["terminated"].sum() == 1 and tr["truncated"].sum() == 1 and tr["reward"][4] == 4.0
    assert tr["action"].shape == (12, 2) and np.all(tr["weights_version"] == 7)


def test_rows_that_do_not_train_are_left_out_and_the_rest_fill_a_replay_buffer():
    part = _rollout()
    part["time"]["loss_mask"][2:, 0] = False  # env 0 idle after its episode ended (no auto-reset)
    tr = transitions(part)
    assert len(tr["reward"]) == 10
    buffer = ReplayBuffer(64, {"state": TensorSpace((2,), "float32")}, 2)
    assert buffer.add(tr) == 10 and len(buffer) == 10
