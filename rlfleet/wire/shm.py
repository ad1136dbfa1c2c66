"""Tensors through shared memory between services on one host: the writer places an array's bytes in a segment it
owns and the message's ``Tensor`` carries a :class:`SharedRef` (``shared``) instead of ``data``; the reader checks
the handle, copies the bytes out (one memcpy) and tells the writer it has them. The plain gRPC path stays the
contract: a sender uses handles only toward a receiver that accepted them in the ``SharedMemory`` handshake, and
every receiver takes inline bytes.

Segments that cannot leak. A segment is a Linux memfd (``memfd_create``: anonymous memory with no name in any file
system, nothing in /dev/shm) that only its writer holds open; its name is ``rlfleet-<kind>-<writer pid>-<n>``. A
reader opens ``/proc/<pid>/fd/<fd>`` of the writer, maps it and closes the fd at once; it drops the mapping when its
call ends (a stream, a push, a weights set). The kernel frees the memory when the last fd and mapping are gone, so a
kill -9 of either side leaves nothing: the writer's fds close with it, and a reader's mappings end with the call that
the dead writer's connection breaks.

What a handle must pass before a byte is read (:class:`Reader`, a :class:`BadHandle` naming the field otherwise):
``/proc/<pid>/fd/<fd>`` links to an ``rlfleet-`` memfd (checked again on the opened fd, and the file takes memfd
seals, which no file on disk does, sealed against shrinking so a mapping can never fault), the segment's header has
the magic and the handle's 16-byte random key, ``[offset, offset + length)`` lies in the segment and matches the
tensor's dtype and shape, and the segment is still at the handle's generation, before and after the copy (a writer
that rewrote it in between makes the read a "stale handle", never torn data).

Generations and reuse. A writer's :class:`Arena` is a ring of segments; each message it packs takes the next one and
bumps its generation. A segment is rewritten only once its reader has acknowledged every byte of the previous
message (the reader adds what it copied to the header's ``acked`` count) or the writer released it (its call ended:
an Act answer, a PushRollout reply). The env server's rollout buffers can live in an arena segment
(:meth:`Arena.buffers`), so pushing a rollout costs the writer no copy at all.

Host identity (:func:`host_identity`): the boot id, the pid namespace and the uid; the handshake's probe proves the
rest (that the receiver may open the sender's fds). Where any of it fails (another host, a container of its own,
``cluster.shared_memory: inline``, no memfd), the peers use inline bytes.

numpy and the generated protobuf code only: env servers run in simulator environments.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import itertools
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from rlfleet.v1 import tensor_pb2
from rlfleet.wire.codec import CodecError

SharedRef = tensor_pb2.SharedRef

NAME_PREFIX = "rlfleet-"
MAGIC = b"RLFSHM01"
KEY_BYTES = 16
HEADER_BYTES = 64  # magic 8 | key 16 | generation u64 @24 | acked u64 @32 | capacity u64 @40 | pid u64 @48 | 8 free
_GEN, _ACKED, _CAPACITY, _PID = 24, 32, 40, 48
ALIGN = 64
# arrays smaller than this travel inline (a handle costs more than copying them); RLFLEET_SHM_MIN_BYTES overrides it
# for a process and its children (tests send everything by handle with 0)
MIN_BYTES = int(os.environ.get("RLFLEET_SHM_MIN_BYTES", 64 << 10))
MAX_SEGMENT_BYTES = 1 << 40  # a reader refuses to map a "segment" larger than this
MAX_MAPPINGS = 16  # segments one reader keeps mapped (a stream's ring of two, a weights set's...)
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)


class BadHandle(CodecError):
    """A shared-memory handle this process will not read (forged, stale, out of range, not an rlfleet segment, its
    writer gone); the message names the field. Servers answer INVALID_ARGUMENT."""


class Abandoned(RuntimeError):
    """A writer gave up waiting for a reader to take a segment's previous message (its call ended or timed out)."""


# --- Whether this host can do it, and who it is ----------------------------------------------------------------------
def unavailable() -> str:
    """Why shared memory cannot be used in this process ("" when it can)."""
    if not hasattr(os, "memfd_create"):
        return "no memfd_create (not Linux)"
    if not os.path.isdir("/proc/self/fd"):
        return "no /proc"
    try:
        _boot_id()
    except OSError as exc:
        return f"no boot id ({exc.strerror})"
    return ""


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def host_identity() -> str:
    """This process's host as shared memory sees it: the boot id (the machine, this boot), the pid namespace (the
    pids a handle names) and the uid (whose fds it may open)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{_boot_id()}/pidns:{ns}/uid:{os.getuid()}"


# --- The writer's side -------------------------------------------------------------------------------------------------
_serial = itertools.count()


class Segment:
    """One memfd owned by this process: a 64-byte header, then ``capacity`` data bytes; sealed against resizing."""

    def __init__(self, capacity: int, kind: str):
        self.capacity = int(capacity)
        self.name = f"{NAME_PREFIX}{kind}-{os.getpid()}-{next(_serial)}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + self.capacity)
            fcntl.fcntl(self.fd, _F_ADD_SEALS, _SEALS)
            self.mm = mmap.mmap(self.fd, HEADER_BYTES + self.capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.key = secrets.token_bytes(KEY_BYTES)
        self.mm[:8] = MAGIC
        self.mm[8 : 8 + KEY_BYTES] = self.key
        struct.pack_into("<QQQQ", self.mm, _GEN, 0, 0, self.capacity, os.getpid())
        view = np.frombuffer(self.mm, np.uint8, count=1)
        self.base = view.ctypes.data + HEADER_BYTES  # the address of data byte 0 in this process
        del view
        self.owed = 0  # the reader has taken everything once ``acked`` reaches this
        self.released = True  # the writer's word that nobody reads the current message any more

    @property
    def generation(self) -> int:
        return struct.unpack_from("<Q", self.mm, _GEN)[0]

    def acked(self) -> int:
        return struct.unpack_from("<Q", self.mm, _ACKED)[0]

    def taken(self) -> bool:
        return self.released or self.acked() >= self.owed

    def wait_taken(self, abandon: Callable[[], bool] | None = None, timeout: float = 300.0) -> None:
        """Until the reader has taken the current message (or the writer released it)."""
        deadline = time.monotonic() + timeout
        pause = 0.0002
        while not self.taken():
            if abandon is not None and abandon():
                raise Abandoned(
                    f"shared memory {self.name}: the reader's call ended before it took generation {self.generation}"
                )
            if time.monotonic() > deadline:
                raise Abandoned(
                    f"shared memory {self.name}: the reader did not take generation {self.generation} "
                    f"within {timeout:.0f}s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def begin(self) -> int:
        """A new message: bump the generation (before any byte changes: a reader of the old one sees it)."""
        gen = self.generation + 1
        struct.pack_into("<Q", self.mm, _GEN, gen)
        self.released = False
        self.owed = self.acked()
        return gen

    def owe(self, nbytes: int) -> None:
        if self.released:
            self.released = False
            self.owed = self.acked()
        self.owed += nbytes

    def write(self, offset: int, array: np.ndarray) -> None:
        src = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        dst = np.frombuffer(self.mm, np.uint8, count=src.size, offset=HEADER_BYTES + offset)
        dst[:] = src
        del dst

    def holds(self, array: np.ndarray) -> int | None:
        """The data offset of ``array`` when its bytes lie in this segment (C-contiguous), else None."""
        if not array.flags.c_contiguous or array.nbytes == 0:
            return None
        start = array.__array_interface__["data"][0] - self.base
        return start if 0 <= start and start + array.nbytes <= self.capacity else None

    def ref(self, offset: int, length: int, generation: int | None = None) -> SharedRef:
        return SharedRef(
            pid=os.getpid(),
            fd=self.fd,
            offset=HEADER_BYTES + offset,
            length=length,
            generation=self.generation if generation is None else generation,
            key=self.key,
        )

    def close(self) -> None:
        if getattr(self, "fd", -1) < 0:
            return
        with contextlib.suppress(BufferError):  # arrays still view it (rollout buffers): unmapped when they go
            self.mm.close()
        os.close(self.fd)
        self.fd = -1

    def __del__(self):  # an arena dropped without close (a servicer of a stopped server): no fd outlives it
        with contextlib.suppress(Exception):
            self.close()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A writer's segments for one peer: a ring of ``slots`` segments, one per message in flight (an Act stream's
    requests, a weights set's buckets), plus optional buffers (:meth:`buffers`) whose arrays are sent without a copy.
    ``shm_bytes`` counts the bytes handed out in handles."""

    def __init__(self, kind: str, slots: int = 2, min_bytes: int | None = None):
        self.kind = kind
        self.min_bytes = MIN_BYTES if min_bytes is None else int(min_bytes)
        self.ring: list[Segment | None] = [None] * max(1, slots)
        self.next = 0
        self.buffer: Segment | None = None
        self.shm_bytes = 0
        self.lock = threading.Lock()
        self.abandon: Callable[[], bool] | None = None  # the owner's "the reader's call is over" (default of pack)
        self.timeout = 300.0  # the longest pack waits for a reader to take a segment

    def pack(
        self, arrays: Sequence[np.ndarray], *, abandon: Callable[[], bool] | None = None, timeout: float | None = None
    ) -> tuple[int | None, list[SharedRef]]:
        """Handles for ``arrays`` (C-contiguous, little-endian): those that lie in the buffers as they are, the
        others copied into the ring's next segment (grown when too small; reused once its reader took the previous
        message). -> (the ring slot used or None, one handle per array)."""
        abandon = abandon or self.abandon
        timeout = self.timeout if timeout is None else timeout
        with self.lock:
            refs: list[SharedRef | None] = [None] * len(arrays)
            copies, total = [], 0
            for i, a in enumerate(arrays):
                at = self.buffer.holds(a) if self.buffer is not None else None
                if at is not None:
                    refs[i] = self.buffer.ref(at, a.nbytes)
                    self.buffer.owe(a.nbytes)
                else:
                    copies.append((i, total))
                    total += _aligned(a.nbytes)
            slot = None
            if copies:
                slot = self.next
                self.next = (self.next + 1) % len(self.ring)
                seg = self.ring[slot]
                if seg is not None:  # its last message taken first, whether it is reused or replaced
                    seg.wait_taken(abandon, timeout)
                if seg is None or seg.capacity < total:
                    if seg is not None:  # (a reader still mapping it keeps it for itself until it is done)
                        seg.close()
                    seg = self.ring[slot] = Segment(max(total + total // 4, 1 << 20), self.kind)
                gen = seg.begin()
                for i, offset in copies:
                    seg.write(offset, arrays[i])
                    refs[i] = seg.ref(offset, arrays[i].nbytes, gen)
                seg.owe(sum(arrays[i].nbytes for i, _ in copies))
            self.shm_bytes += sum(a.nbytes for a in arrays)
            return slot, refs  # type: ignore[return-value]

    def buffers(
        self,
        layout: Mapping[str, tuple[Sequence[int], np.dtype]],
        *,
        abandon: Callable[[], bool] | None = None,
        timeout: float = 300.0,
    ) -> dict[str, np.ndarray]:
        """Arrays of these shapes and dtypes in this arena's buffer segment (a rollout's observation buffers):
        :meth:`pack` hands them out without copying. The segment is reused once its reader took the last message
        (or :meth:`release`); its generation moves on, so a handle to the previous contents is stale."""
        with self.lock:
            sizes = {
                k: int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for k, (shape, dt) in layout.items()
            }
            total = sum(_aligned(n) for n in sizes.values())
            seg = self.buffer
            if seg is not None:
                seg.wait_taken(abandon, timeout)
            if seg is None or seg.capacity < total:
                if seg is not None:
                    seg.close()
                seg = self.buffer = Segment(max(total, ALIGN), f"{self.kind}-buffers")
            seg.begin()
            seg.released = True  # nobody was handed this generation yet
            out, offset = {}, 0
            for k, (shape, dt) in layout.items():
                dt = np.dtype(dt)
                out[k] = np.frombuffer(seg.mm, dt, count=sizes[k] // dt.itemsize, offset=HEADER_BYTES + offset).reshape(
                    tuple(shape)
                )
                offset += _aligned(sizes[k])
            return out

    def release(self, slot: int | None = None) -> None:
        """The reader's call is over (answered or failed): segment ``slot`` (None: every one, and the buffers) may
        be rewritten without waiting for its acknowledgement."""
        with self.lock:
            segs = self.ring if slot is None else [self.ring[slot]]
            for seg in [*segs, *([self.buffer] if slot is None else [])]:
                if seg is not None:
                    seg.released = True

    def segments(self) -> list[Segment]:
        return [s for s in [*self.ring, self.buffer] if s is not None]

    def close(self) -> None:
        with self.lock:
            for seg in self.segments():
                seg.close()
            self.ring = [None] * len(self.ring)
            self.buffer = None


# --- The reader's side -------------------------------------------------------------------------------------------------
class _Mapped:
    def __init__(self, mm: mmap.mmap, key: bytes, size: int, link: str):
        self.mm, self.key, self.size, self.link = mm, key, size, link

    def generation(self) -> int:
        return struct.unpack_from("<Q", self.mm, _GEN)[0]


def _not_rlfleet(name: str, pid: int, fd: int, why: str = "") -> BadHandle:
    return BadHandle(
        f"{name}.shared.fd: fd {fd} of process {pid} is not an rlfleet shared-memory segment"
        + (f" ({why})" if why else "")
    )


class Reader:
    """The reading side of shared memory for one call (an Act stream, a PushRollout, an UpdateWeights): validates
    handles, copies their bytes out, acknowledges them to the writer; keeps up to ``max_mappings`` segments mapped
    until :meth:`close`. ``shm_bytes`` counts the bytes read."""

    def __init__(self, max_mappings: int = MAX_MAPPINGS):
        self.max_mappings = max_mappings
        self.maps: OrderedDict[tuple[int, int], _Mapped] = OrderedDict()
        self.shm_bytes = 0

    def _open(self, pid: int, fd: int, name: str) -> _Mapped:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            link = os.readlink(path)
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            raise BadHandle(
                f"{name}.shared.pid: process {pid} has no fd {fd} (the writer exited or closed the segment)"
            ) from None
        except PermissionError:
            raise BadHandle(f"{name}.shared.pid: this process may not open the fds of process {pid}") from None
        except OSError as exc:
            raise BadHandle(f"{name}.shared.pid: {path}: {exc.strerror}") from None
        if not link.startswith(f"/memfd:{NAME_PREFIX}"):  # before opening: a FIFO or a device is never opened
            raise _not_rlfleet(name, pid, fd)
        try:
            own = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
        except FileNotFoundError:
            raise BadHandle(
                f"{name}.shared.pid: process {pid} has no fd {fd} (the writer exited or closed the segment)"
            ) from None
        except OSError as exc:
            raise BadHandle(f"{name}.shared.fd: fd {fd} of process {pid} cannot be opened ({exc.strerror})") from None
        try:
            # what was opened, not what the link said a moment ago
            if not os.readlink(f"/proc/self/fd/{own}").startswith(f"/memfd:{NAME_PREFIX}"):
                raise _not_rlfleet(name, pid, fd)
            st = os.fstat(own)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 0:
                raise _not_rlfleet(name, pid, fd, "not an anonymous memory file")
            try:
                seals = fcntl.fcntl(own, _F_GET_SEALS)
            except OSError:
                raise _not_rlfleet(name, pid, fd, "takes no memfd seals") from None
            if not seals & _F_SEAL_SHRINK:
                raise _not_rlfleet(name, pid, fd, "not sealed against shrinking")
            size = st.st_size
            if not HEADER_BYTES <= size <= MAX_SEGMENT_BYTES:
                raise _not_rlfleet(name, pid, fd, f"{size} bytes")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(own, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(own)  # the mapping keeps the segment; no fd of ours outlives this call
        if mm[:8] != MAGIC:
            mm.close()
            raise _not_rlfleet(name, pid, fd, "no rlfleet header")
        return _Mapped(mm, bytes(mm[8 : 8 + KEY_BYTES]), size, link)

    def _mapping(self, ref: SharedRef, name: str) -> _Mapped:
        where = (ref.pid, ref.fd)
        m = self.maps.get(where)
        if m is not None:
            # still the writer's segment at that fd (each segment's name is unique): a dead writer's, or a replaced
            # one, is dropped at once and looked up again (and named, when gone)
            try:
                alive = os.readlink(f"/proc/{ref.pid}/fd/{ref.fd}") == m.link
            except OSError:
                alive = False
            if alive and hmac.compare_digest(m.key, ref.key):
                self.maps.move_to_end(where)
                return m
            self._drop(where)
        m = self._open(ref.pid, ref.fd, name)
        if not hmac.compare_digest(m.key, ref.key):
            m.mm.close()
            raise BadHandle(
                f"{name}.shared.key: does not match the key of segment fd {ref.fd} of process "
                f"{ref.pid} (a forged handle, or one to a segment that was replaced)"
            )
        self.maps[where] = m
        while len(self.maps) > self.max_mappings:
            self._drop(next(iter(self.maps)))
        return m

    def _drop(self, where) -> None:
        m = self.maps.pop(where, None)
        if m is not None:
            with contextlib.suppress(BufferError):
                m.mm.close()

    def read(self, ref: SharedRef, dtype: np.dtype, count: int, name: str = "tensor") -> np.ndarray:
        """A private 1-D copy of the ``count`` elements of ``dtype`` that ``ref`` points at, after every check."""
        nbytes = count * dtype.itemsize
        if len(ref.key) != KEY_BYTES:
            raise BadHandle(f"{name}.shared.key: {len(ref.key)} bytes; a segment's key has {KEY_BYTES}")
        if ref.length != nbytes:
            raise BadHandle(f"{name}.shared.length: {ref.length} bytes where the dtype and shape need {nbytes}")
        if ref.offset < HEADER_BYTES:
            raise BadHandle(
                f"{name}.shared.offset: {ref.offset} lies in the segment's header (data starts at {HEADER_BYTES})"
            )
        m = self._mapping(ref, name)
        if ref.offset + ref.length > m.size:
            raise BadHandle(
                f"{name}.shared.offset: bytes [{ref.offset}, {ref.offset + ref.length}) lie outside "
                f"the segment's {m.size} bytes"
            )
        gen = m.generation()
        if gen != ref.generation:
            raise BadHandle(
                f"{name}.shared.generation: {ref.generation}, the segment is at generation {gen} "
                f"(a stale handle: its writer has moved on)"
            )
        out = np.empty(count, dtype)
        if nbytes:
            src = np.frombuffer(m.mm, np.uint8, count=nbytes, offset=ref.offset)
            out.view(np.uint8)[:] = src
            del src
        now = m.generation()
        if now != ref.generation:
            raise BadHandle(
                f"{name}.shared.generation: the writer moved segment fd {ref.fd} of process {ref.pid} "
                f"to generation {now} while it was read (a stale handle)"
            )
        acked = struct.unpack_from("<Q", m.mm, _ACKED)[0]
        struct.pack_into("<Q", m.mm, _ACKED, acked + ref.length)
        self.shm_bytes += nbytes
        return out

    def close(self) -> None:
        for where in list(self.maps):
            self._drop(where)


# --- The handshake -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def offer() -> Iterator[tensor_pb2.SharedMemoryOffer]:
    """A SharedMemoryOffer of this process, with a probe segment that lives while the handshake runs."""
    probe = Segment(ALIGN, "probe")
    try:
        gen = probe.begin()
        probe.write(0, np.frombuffer(b"rlfleet!", np.uint8))
        yield tensor_pb2.SharedMemoryOffer(host=host_identity(), probe=probe.ref(0, 8, gen))
    finally:
        probe.close()


def answer(request: tensor_pb2.SharedMemoryOffer, enabled: bool) -> tensor_pb2.SharedMemoryAnswer:
    """A receiver's answer to an offer: accepted when shared memory is on here, the sender is on this host (boot,
    pid namespace, uid) and its probe reads back."""
    missing = unavailable()
    here = "" if missing else host_identity()
    why = "cluster.shared_memory: inline" if not enabled else missing
    if not why and request.host != here:
        why = "the sender is on another host, pid namespace or uid"
    if not why:
        reader = Reader()
        try:
            if reader.read(request.probe, np.dtype(np.uint8), 8, "probe").tobytes() != b"rlfleet!":
                why = "the probe read back wrong"
        except BadHandle as exc:
            why = f"cannot read the sender's segments: {exc}"
        finally:
            reader.close()
    return tensor_pb2.SharedMemoryAnswer(accepted=not why, reason=why, host=here)


def segments_of(pid: int | str = "self") -> list[str]:
    """The rlfleet segments process ``pid`` holds open or mapped (names, with duplicates removed): for tests and
    operators (a segment of a dead writer in a survivor's list is a leak)."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith(f"/memfd:{NAME_PREFIX}"):
                    found.add(link[len("/memfd:") :].split(" ")[0])
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            at = line.find(f"/memfd:{NAME_PREFIX}")
            if at >= 0:
                found.add(line[at + len("/memfd:") :].split(" ")[0].strip())
    return sorted(found)
