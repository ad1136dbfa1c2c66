"""Tensors through shared memory on one host (rlfleet/wire/shm.py and its seam in rlfleet/wire/codec.py): the same bits
as inline bytes, every forged or stale handle refused by name, and no segment left behind by a kill -9 of either
side (real processes, real memfds, the kernel's own account in /proc)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from rlfleet.v1 import tensor_pb2
from rlfleet.wire import codec, shm

pytestmark = pytest.mark.skipif(bool(shm.unavailable()), reason=f"no shared memory here: {shm.unavailable()}")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARRAYS = {
    "third_person": np.random.default_rng(0).integers(0, 256, (16, 224, 224, 3), dtype=np.uint8),
    "wrist": np.random.default_rng(1).integers(0, 256, (16, 64, 64, 3), dtype=np.uint8),
    "state": np.random.default_rng(2).normal(size=(16, 7)).astype(np.float32),  # small: inline
    "f64": np.random.default_rng(3).normal(size=(16, 1024)),
    "f16": np.random.default_rng(4).normal(size=(64, 1024)).astype(np.float16),
    "i64": np.arange(16 * 4096, dtype=np.int64).reshape(16, 4096),
    "mask": np.random.default_rng(5).random((256, 1024)) > 0.5,
    "strided": np.arange(2 * 300 * 300, dtype=np.float32).reshape(300, 600)[:, ::2],  # not contiguous
}


def roundtrip(arrays, arena=None, reader=None):
    """Through a serialised message, as on the wire."""
    msg = codec.encode_map(arrays, arena=arena)
    again = codec.TensorMap.FromString(msg.SerializeToString())
    return again, codec.decode_map(again, "obs", shm=reader)


def test_tensors_through_shared_memory_are_the_inline_bits():
    arena, reader = shm.Arena("test"), shm.Reader()
    try:
        inline_msg, inline = roundtrip(ARRAYS)
        for _ in range(3):  # the ring's two segments, then the first again
            msg, shared = roundtrip(ARRAYS, arena, reader)
            arena.release()
            for k, a in ARRAYS.items():
                assert shared[k].dtype == inline[k].dtype == a.dtype and shared[k].shape == a.shape
                assert shared[k].tobytes() == inline[k].tobytes() == a.tobytes(), k
                assert msg.tensors[k].HasField("shared") == (a.nbytes >= shm.MIN_BYTES), k
                owner = shared[k] if shared[k].base is None else shared[k].base
                if msg.tensors[k].HasField("shared"):  # a private copy, not the writer's bytes
                    assert shared[k].flags.writeable and owner.flags.owndata
        assert inline_msg.ByteSize() > sum(a.nbytes for a in ARRAYS.values()) > 60 * msg.ByteSize()
        assert codec.shared_bytes(msg) == sum(a.nbytes for a in ARRAYS.values() if a.nbytes >= shm.MIN_BYTES)
        assert reader.shm_bytes == 3 * codec.shared_bytes(msg)
        # 0-d and empty arrays keep their shapes
        small = {"zero_d": np.float32(3.0), "empty": np.zeros((0, 5), np.float32)}
        _, back = roundtrip(small, arena, reader)
        assert back["zero_d"].shape == () and back["empty"].shape == (0, 5)
    finally:
        arena.close()
        reader.close()
    assert shm.segments_of() == []  # closed: nothing of ours is open or mapped


def test_buffers_go_by_handle_without_a_copy_and_move_on_a_generation():
    arena, reader = shm.Arena("buffers", slots=1), shm.Reader()
    try:
        buf = arena.buffers({"obs.cam": ((4, 8, 64, 64, 3), np.uint8)})["obs.cam"]
        buf[:] = 7
        slot, (ref,) = arena.pack([buf])
        assert slot is None  # no ring segment used: the handle points at the buffer itself
        assert ref.offset == shm.HEADER_BYTES and ref.length == buf.nbytes
        buf[0, 0, 0, 0, 0] = 9  # written where it lies: what the reader gets is the buffer's bytes now
        got = reader.read(ref, np.dtype(np.uint8), buf.size, "rollout['obs.cam']")
        assert got[0] == 9 and (got[1:] == 7).all()
        arena.release()
        again = arena.buffers({"obs.cam": ((4, 8, 64, 64, 3), np.uint8)})["obs.cam"]  # the same memory, next generation
        assert again.__array_interface__["data"][0] == buf.__array_interface__["data"][0]
        with pytest.raises(
            shm.BadHandle,
            match=r"^rollout\['obs.cam'\]\.shared\.generation: 1, the segment is at "
            r"generation 2 \(a stale handle",
        ):
            reader.read(ref, np.dtype(np.uint8), buf.size, "rollout['obs.cam']")
    finally:
        reader.close()
        arena.close()


def test_a_segment_is_rewritten_only_once_its_reader_took_it():
    arena, reader = shm.Arena("ring", slots=1, min_bytes=0), shm.Reader()
    try:
        a = np.arange(1000, dtype=np.float64)
        _, (ref,) = arena.pack([a])
        with pytest.raises(shm.Abandoned, match="ended before it took generation 1"):
            arena.pack([a], abandon=lambda: True)  # the reader has not read it yet
        with pytest.raises(shm.Abandoned, match="did not take generation 1 within 0s"):
            arena.pack([a], timeout=0.0)
        assert np.array_equal(reader.read(ref, np.dtype(np.float64), 1000), a)  # ... and acknowledged it
        _, (ref2,) = arena.pack([a + 1], timeout=0.0)
        assert ref2.generation == ref.generation + 1
        arena.release()  # the writer's word (its call ended): no wait
        arena.pack([a], timeout=0.0)
    finally:
        reader.close()
        arena.close()


# --- Forged handles ----------------------------------------------------------------------------------------------------
@pytest.fixture
def good():
    arena = shm.Arena("forge", slots=1, min_bytes=0)
    _, (ref,) = arena.pack([np.arange(64, dtype=np.float32)])
    yield arena, ref
    arena.close()


def tensor(ref, shape=(64,)):
    return codec.Tensor(dtype=codec.DType.FLOAT32, shape=list(shape), shared=ref)


def forged(ref, **fields):
    out = tensor_pb2.SharedRef()
    out.CopyFrom(ref)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def refused(msg, match, name="observations['state']"):
    reader = shm.Reader()
    try:
        with pytest.raises(shm.BadHandle) as err:
            codec.decode(msg, name, shm=reader)
        assert isinstance(err.value, codec.CodecError)  # what servers answer with INVALID_ARGUMENT
        assert str(err.value).startswith(f"{name}.shared."), err.value
        assert match in str(err.value), err.value
    finally:
        reader.close()


def test_the_good_handle_reads(good):
    reader = shm.Reader()
    assert codec.decode(tensor(good[1]), "x", shm=reader).tolist() == list(range(64))
    reader.close()


def test_a_wrong_key_is_refused(good):
    refused(tensor(forged(good[1], key=bytes(16))), "shared.key: does not match the key of segment")
    refused(tensor(forged(good[1], key=b"short")), "shared.key: 5 bytes; a segment's key has 16")


def test_a_regular_file_the_server_has_open_is_refused(good, tmp_path):
    secret = tmp_path / "checkpoint.bin"
    secret.write_bytes(b"RLFSHM01" + bytes(4096))  # even with our magic in it
    with open(secret, "rb") as f:
        refused(
            tensor(forged(good[1], pid=os.getpid(), fd=f.fileno())),
            f"shared.fd: fd {f.fileno()} of process {os.getpid()} is not an rlfleet shared-memory segment",
        )
    with open(secret, "rb") as f:  # a deleted file is not one either
        secret.unlink()
        refused(tensor(forged(good[1], fd=f.fileno())), "is not an rlfleet shared-memory segment")


def test_memfds_that_are_not_rlfleet_segments_are_refused(good):
    other = os.memfd_create("someone-else", os.MFD_ALLOW_SEALING)  # another program's memfd
    named = os.memfd_create(f"{shm.NAME_PREFIX}lookalike")  # our name, but no seals: it could shrink under a reader
    try:
        for fd in (other, named):
            os.ftruncate(fd, 4096)
        refused(tensor(forged(good[1], fd=other)), f"fd {other} of process {os.getpid()} is not an rlfleet")
        refused(tensor(forged(good[1], fd=named)), "(not sealed against shrinking)")
    finally:
        os.close(other)
        os.close(named)
    r, w = os.pipe()  # a pipe (a FIFO would block an open): never opened
    try:
        refused(tensor(forged(good[1], fd=r)), "is not an rlfleet shared-memory segment")
    finally:
        os.close(r)
        os.close(w)


def test_out_of_range_offsets_and_lengths_are_refused(good):
    ref = good[1]
    refused(tensor(forged(ref, offset=1 << 40)), f"shared.offset: bytes [{1 << 40}, {(1 << 40) + 256}) lie outside")
    refused(tensor(forged(ref, offset=2**64 - 8)), "lie outside the segment's")
    refused(tensor(forged(ref, offset=8)), "shared.offset: 8 lies in the segment's header")
    refused(tensor(forged(ref, length=4)), "shared.length: 4 bytes where the dtype and shape need 256")
    refused(tensor(ref, shape=(64, 1 << 20)), "shared.length: 256 bytes where the dtype and shape need")


def test_a_stale_generation_is_refused(good):
    arena, ref = good
    arena.release()
    arena.pack([np.zeros(64, np.float32)])  # the writer moved on
    refused(tensor(ref), "shared.generation: 1, the segment is at generation 2 (a stale handle")
    refused(tensor(forged(ref, generation=99)), "shared.generation: 99, the segment is at generation 2")


def test_a_pid_or_fd_that_holds_nothing_is_refused(good):
    refused(tensor(forged(good[1], fd=999_999)), f"shared.pid: process {os.getpid()} has no fd 999999")
    refused(tensor(forged(good[1], pid=2**31 - 2)), f"shared.pid: process {2**31 - 2} has no fd")


def test_handles_where_inline_bytes_are_expected_and_both_at_once_are_refused(good):
    with pytest.raises(
        codec.CodecError,
        match=r"^obs\.shared: a shared-memory handle where inline bytes \(data\) "
        r"are expected",
    ):
        codec.decode(tensor(good[1]), "obs")
    both = tensor(good[1])
    both.data = bytes(256)
    with pytest.raises(codec.CodecError, match="both data and a shared-memory handle"):
        codec.decode(both, "obs", shm=shm.Reader())


# --- Across processes, and kill -9 -------------------------------------------------------------------------------------
WRITER = r"""
import json, sys
import numpy as np
from rlfleet.wire import shm
arena = shm.Arena("child", slots=1, min_bytes=0)
_, (ref,) = arena.pack([np.arange(1 << 20, dtype=np.uint8)])  # 1 MiB
print(json.dumps({"pid": ref.pid, "fd": ref.fd, "offset": ref.offset, "length": ref.length,
                  "generation": ref.generation, "key": ref.key.hex()}), flush=True)
sys.stdin.readline()
"""

READER = r"""
import json, sys
import numpy as np
from rlfleet.v1 import tensor_pb2
from rlfleet.wire import shm
d = json.loads(sys.stdin.readline())
ref = tensor_pb2.SharedRef(pid=d["pid"], fd=d["fd"], offset=d["offset"], length=d["length"],
                           generation=d["generation"], key=bytes.fromhex(d["key"]))
reader = shm.Reader()
got = reader.read(ref, np.dtype(np.uint8), ref.length, "probe")
print(int(got.sum()), flush=True)
sys.stdin.readline()  # keeps the mapping until killed
"""


def _python(code):
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )


def _ref(d):
    return tensor_pb2.SharedRef(
        pid=d["pid"],
        fd=d["fd"],
        offset=d["offset"],
        length=d["length"],
        generation=d["generation"],
        key=bytes.fromhex(d["key"]),
    )


def holders(name_part: str) -> dict[int, list[str]]:
    """Every process of this host that holds open or maps an rlfleet segment whose name contains ``name_part``:
    the kernel's own account (/proc/*/fd and /proc/*/maps)."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            segs = [s for s in shm.segments_of(pid) if name_part in s]
            if segs:
                out[int(pid)] = segs
    return out


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_kill9_of_the_writer_mid_transfer_leaves_no_segment():
    before = dev_shm()
    child = _python(WRITER)
    try:
        d = json.loads(child.stdout.readline())
        tag = f"-{child.pid}-"
        assert list(holders(tag)) == [child.pid]  # the writer alone holds its segment
        reader = shm.Reader()
        expect = int(np.arange(1 << 20, dtype=np.uint8).sum())
        assert int(reader.read(_ref(d), np.dtype(np.uint8), d["length"]).sum()) == expect
        assert os.getpid() in holders(tag)  # mapped here while the call lasts
        os.kill(child.pid, signal.SIGKILL)  # mid-transfer: the reader still maps the segment
        child.wait(10)
        # the dead writer's handle is refused by name, and the reader dropped its mapping on the way
        with pytest.raises(
            shm.BadHandle,
            match=rf"shared\.pid: process {d['pid']} has no fd {d['fd']} \(the writer "
            r"exited",
        ):
            reader.read(_ref(d), np.dtype(np.uint8), d["length"])
        assert holders(tag) == {}  # no process of this host holds or maps it: the kernel has freed it
        reader.close()
        assert dev_shm() - before == set()  # and nothing was ever put in /dev/shm
    finally:
        child.kill()


def test_kill9_of_the_reader_leaves_no_segment_once_the_writer_drops_it():
    before = dev_shm()
    arena = shm.Arena("parent", slots=1, min_bytes=0)
    _, (ref,) = arena.pack([np.full(1 << 20, 3, np.uint8)])
    child = _python(READER)
    try:
        child.stdin.write(
            json.dumps(
                {
                    "pid": ref.pid,
                    "fd": ref.fd,
                    "offset": ref.offset,
                    "length": ref.length,
                    "generation": ref.generation,
                    "key": ref.key.hex(),
                }
            )
            + "\n"
        )
        child.stdin.flush()
        assert int(child.stdout.readline()) == 3 << 20  # another process read it
        name = arena.segments()[0].name
        assert set(holders(name)) == {os.getpid(), child.pid}  # ours open, the reader's mapped
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert set(holders(name)) == {os.getpid()}  # the killed reader holds nothing
        arena.release()
        arena.pack([np.zeros(1 << 20, np.uint8)], timeout=0.0)  # the writer goes on with its segment
        arena.close()
        assert holders(name) == {}
        assert dev_shm() - before == set()
    finally:
        child.kill()
        arena.close()


# --- The handshake -----------------------------------------------------------------------------------------------------
def test_the_handshake_accepts_a_sender_on_this_host_only():
    with shm.offer() as offer:
        assert offer.host == shm.host_identity()
        yes = shm.answer(offer, enabled=True)
        assert yes.accepted and yes.reason == "" and yes.host == shm.host_identity()
        off = shm.answer(offer, enabled=False)
        assert not off.accepted and off.reason == "cluster.shared_memory: inline"
        elsewhere = tensor_pb2.SharedMemoryOffer()
        elsewhere.CopyFrom(offer)
        elsewhere.host = "another-boot-id/pidns:1/uid:0"
        no = shm.answer(elsewhere, enabled=True)
        assert not no.accepted and "another host, pid namespace or uid" in no.reason
        bad = tensor_pb2.SharedMemoryOffer()
        bad.CopyFrom(offer)
        bad.probe.key = bytes(16)
        no = shm.answer(bad, enabled=True)
        assert not no.accepted and "cannot read the sender's segments: probe.shared.key" in no.reason
    assert "-probe-" not in " ".join(shm.segments_of())  # the probe lives only as long as the handshake


def test_a_weights_set_by_handle_assembles_to_the_inline_bits():
    import torch

    from rlfleet.wire import weights

    state = {
        "w": torch.randn(300, 300),
        "b16": torch.randn(256, 512).to(torch.bfloat16),
        "steps": torch.arange(20_000, dtype=torch.int64),
        "small": torch.randn(3),
    }
    arena, reader = shm.Arena("weights", slots=2), shm.Reader()
    try:
        chunks = [type(c).FromString(c.SerializeToString()) for c in weights.iter_chunks(state, 5, arena=arena)]
        assert [c.data.HasField("shared") for c in chunks] == [True, True, True, False]
        _, got, _, _, _ = weights.assemble(iter(chunks), shm=reader)
        _, inline, _, _, _ = weights.assemble(weights.iter_chunks(state, 5, chunk_bytes=4096))
        for k, t in state.items():
            assert got[k].dtype == inline[k].dtype == t.dtype and got[k].shape == t.shape
            assert torch.equal(
                got[k].view(torch.int16) if t.dtype == torch.bfloat16 else got[k],
                t.view(torch.int16) if t.dtype == torch.bfloat16 else t,
            ), k
        moved = weights.inference_pb2.WeightsChunk()
        moved.CopyFrom(chunks[0])
        moved.offset = 8
        with pytest.raises(codec.CodecError, match=r"weights\['w'\]: a shared-memory chunk at offset 8"):
            weights.assemble(iter([moved]), shm=reader)
    finally:
        reader.close()
        arena.close()
