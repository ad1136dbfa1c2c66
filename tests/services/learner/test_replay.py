"""services/learner/replay.py: the off-policy data store. Rows in their own dtypes, a ring that overwrites the oldest,
each rank's share of a global stream, a save and load that gives back the same rows (a hash), and named errors."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.errors import InvalidRequest
from rlfleet.untrusted import BadFile
from rlfleet.wire.spaces import TensorSpace
from services.learner.replay import ReplayBuffer, buffer_bytes

SPECS = {"state": TensorSpace((5,), "float32"), "cam": TensorSpace((8, 8, 3), "uint8")}


def transitions(n: int, start: int = 0) -> dict[str, np.ndarray]:
    """``n`` transitions whose reward is their global index (start, start + 1, ...)."""
    rng = np.random.default_rng(start)
    i = np.arange(start, start + n)
    return {
        "obs.state": rng.standard_normal((n, 5)).astype(np.float32),
        "obs.cam": rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
        "next_obs.state": rng.standard_normal((n, 5)).astype(np.float32),
        "next_obs.cam": rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
        "action": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
        "reward": i.astype(np.float32),
        "terminated": i % 7 == 0,
        "truncated": i % 11 == 0,
        "weights_version": (i // 10).astype(np.int32),
    }


def test_rows_keep_their_dtypes_and_the_ring_overwrites_the_oldest():
    buf = ReplayBuffer(16, SPECS, 2, seed=1)
    assert buf.data["obs.cam"].dtype == np.uint8 and buf.nbytes == buffer_bytes(16, SPECS, 2)
    assert buf.add(transitions(10)) == 10 and len(buf) == 10
    buf.add(transitions(10, start=10))  # 20 offered, 16 kept: 4..19
    assert len(buf) == 16
    assert sorted(buf.data["reward"].tolist()) == list(range(4, 20))
    batch = buf.sample(64)
    assert batch["obs.cam"].dtype == np.uint8 and batch["obs.cam"].shape == (64, 8, 8, 3)
    assert set(batch["reward"].tolist()) <= set(range(4, 20))
    # the next observation and the flags travel with their own row
    row = int(np.nonzero(buf.data["reward"] == 14)[0][0])
    assert buf.data["terminated"][row] == (14 % 7 == 0) and buf.data["truncated"][row] == (14 % 11 == 0)
    assert buf.staleness(3).tolist() == (3 - buf.data["weights_version"][:16]).tolist()


def test_each_rank_holds_its_share_of_one_global_stream():
    world = 3
    ranks = [ReplayBuffer(30, SPECS, 2, rank=r, world_size=world) for r in range(world)]
    for start in (0, 7, 19):  # uneven batches: the global index decides, not the batch
        n = {0: 7, 7: 12, 19: 5}[start]
        for b in ranks:
            b.add(transitions(n, start))
    held = [sorted(int(x) for x in b.data["reward"][: len(b)]) for b in ranks]
    assert held == [[i for i in range(24) if i % world == r] for r in range(world)]
    assert all(b.capacity == 10 for b in ranks)
    assert buffer_bytes(30, SPECS, 2, world_size=3) == ranks[0].nbytes


def test_save_and_load_give_back_the_same_rows_and_the_same_next_samples(tmp_path):
    a = ReplayBuffer(12, SPECS, 2, seed=5, rank=1, world_size=2)
    a.add(transitions(9))
    a.add(transitions(9, 9))
    a.sample(4)
    path = a.save(tmp_path)
    assert path.name == "replay_rank001_of_002.safetensors"
    b = ReplayBuffer(12, SPECS, 2, seed=99, rank=1, world_size=2)  # another seed: the saved generator wins
    b.load(tmp_path)
    assert b.digest() == a.digest() and len(b) == len(a) == 6
    assert all(np.array_equal(x, y) for x, y in zip(a.sample(8).values(), b.sample(8).values()))
    b.add(transitions(3, 18))
    a.add(transitions(3, 18))
    assert b.digest() == a.digest()


def test_a_file_of_another_buffer_is_refused_by_name(tmp_path):
    a = ReplayBuffer(12, SPECS, 2)
    a.add(transitions(4))
    a.save(tmp_path, extra={"steps": 7})
    assert ReplayBuffer(12, SPECS, 2).load(tmp_path) == {"steps": 7}
    with pytest.raises(BadFile, match="capacity: expected a share of 20 rows .* found 12 rows holding 4"):
        ReplayBuffer(20, SPECS, 2).load(tmp_path)
    with pytest.raises(BadFile, match="replay_rank000_of_002.safetensors: file: .*saved by 2 ranks.*missing"):
        ReplayBuffer(24, SPECS, 2, world_size=2).load(tmp_path)
    with pytest.raises(BadFile, match="fields"):
        ReplayBuffer(12, {"state": TensorSpace((5,), "float32")}, 2).load(tmp_path)
    with pytest.raises(BadFile, match="field 'obs.state' shape: expected \\[4, 4\\]"):
        ReplayBuffer(12, {**SPECS, "state": TensorSpace((4,), "float32")}, 2).load(tmp_path)


def test_a_lying_replay_file_is_refused_before_a_row_is_copied(tmp_path):
    a = ReplayBuffer(12, SPECS, 2)
    a.add(transitions(4))
    path = a.save(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[:8] = (2**40).to_bytes(8, "little")  # a header claiming a terabyte
    path.write_bytes(bytes(raw))
    b = ReplayBuffer(12, SPECS, 2)
    with pytest.raises(BadFile, match="header length"):
        b.load(tmp_path)
    assert len(b) == 0 and b.seen == 0
    path.unlink()
    path.symlink_to("/etc/hostname")  # a link out of the checkpoint
    with pytest.raises(BadFile):
        b.load(tmp_path)


def test_bad_transitions_are_named_and_nothing_is_stored():
    buf = ReplayBuffer(8, SPECS, 2)
    good = transitions(3)
    with pytest.raises(InvalidRequest, match="field 'action' has shape \\[3, 3\\], expected \\[3, 2\\]"):
        buf.add({**good, "action": np.zeros((3, 3), np.float32)})
    with pytest.raises(InvalidRequest, match="'next_obs.cam' is missing"):
        buf.add({k: v for k, v in good.items() if k != "next_obs.cam"})
    with pytest.raises(InvalidRequest, match="field 'reward' holds NaN"):
        buf.add({**good, "reward": np.array([0, np.nan, 1], np.float32)})
    with pytest.raises(InvalidRequest, match="unknown transition fields \\['value'\\]"):
        buf.add({**good, "value": np.zeros(3)})
    with pytest.raises(InvalidRequest, match="dtype float32, expected uint8"):
        buf.add({**good, "obs.cam": good["obs.cam"].astype(np.float32)})
    assert len(buf) == 0 and buf.seen == 0
    with pytest.raises(InvalidRequest, match="empty buffer"):
        buf.sample(1)
