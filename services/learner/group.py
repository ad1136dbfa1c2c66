"""The learner's rank group: N processes on torch.distributed, started through torchrun's environment contract.

Every launcher starts the learner the same way: ``torchrun`` (or anything that sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT: compose, a Kubernetes Indexed Job, a shell) runs ``python -m services.learner.server``
once per rank. Without WORLD_SIZE (or with 1) the learner is a group of one and nothing here touches
torch.distributed.

Rank 0 (the leader) is the learner's gRPC face; the other ranks (followers) serve nothing and do what the leader
tells them. The leader sends each command (a name and a JSON object, never pickle) to every follower through the
rendezvous store's queues, then every rank runs the same handler, so all ranks enter the same collectives in the
same order. Data moves only through collectives: a command's per-rank tensors are packed into one byte buffer per
rank and sent point to point over a gloo group (CPU), FSDP2's own all-gathers and reduce-scatters run on the
default group (NCCL on GPUs, gloo on CPU).

Faults: every rank bumps a heartbeat counter in the store each second and watches its peers (the leader watches
every follower, a follower watches the leader). A rank silent for ``heartbeat_timeout_s``, a collective that fails
(a peer died: gloo notices at once) or one that cannot complete within ``cluster.learner_collective_timeout_s``
ends this process with :data:`GROUP_BROKEN` and a line naming the rank; torchrun then stops the others, and a
rank started by hand sees its peer's heartbeat stop and ends too. No rank is left waiting.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("rlfleet.learner.group")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
GROUP_BROKEN = 4  # exit code of a rank whose group is broken (a peer died or went silent)
_PREFIX = "rlfleet/"


class GroupError(RuntimeError):
    """A rank of the learner's group is gone, or a collective among them failed; the message names the rank."""


def _pack(tensors: Mapping[str, torch.Tensor]) -> tuple[list, torch.Tensor]:
    """{name: tensor} -> (layout [[name, dtype, shape, offset, nbytes]], one uint8 buffer): any dtype, no pickle."""
    layout, parts, offset = [], [], 0
    for name, t in tensors.items():
        flat = t.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()])
        parts.append(raw)
        offset += raw.numel()
    return layout, (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))


def _unpack(layout: list, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, offset, nbytes in layout:
        raw = buffer[offset : offset + nbytes].clone()  # its own storage: aligned for any element size
        dt = getattr(torch, dtype)
        out[name] = (raw.view(dt) if nbytes else torch.empty(0, dtype=dt)).reshape(shape)
    return out


class RankGroup:
    """This process's place in the learner's rank group (or a group of one)."""

    def __init__(
        self,
        rank: int = 0,
        world: int = 1,
        local_rank: int = 0,
        device: str | torch.device = "cpu",
        store=None,
        timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 15.0,
        backend: str = "",
    ):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = torch.device(device)
        self.backend = backend
        self.timeout_s, self.heartbeat_timeout_s = timeout_s, heartbeat_timeout_s
        self.cpu_group = None  # gloo group for CPU byte buffers (the default group when it is gloo)
        self._store = store
        self._cmd_store = store.clone() if store is not None else None
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # the heartbeat and the watchdog (_start_heartbeats)
        self.lock = threading.RLock()  # leader: one command (and its collectives) at a time
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter value, when it last changed)

    # --- set-up -----------------------------------------------------------------------------------------------
    @classmethod
    def from_environ(cls, timeout_s: float = 300.0, heartbeat_timeout_s: float = 15.0) -> RankGroup:
        """Join the group torchrun's variables describe; a group of one when WORLD_SIZE is absent or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        if world <= 1:
            return cls(device=device, timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
        missing = [v for v in TORCHRUN_VARS if not os.environ.get(v)]
        if missing:
            raise SystemExit(
                f"learner: WORLD_SIZE={world} but {', '.join(missing)} not set: start the learner's "
                f"ranks with torchrun (or set all of {', '.join(TORCHRUN_VARS)})"
            )
        rank = int(os.environ["RANK"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # under torchrun the agent hosts the store at MASTER_ADDR:MASTER_PORT; started by hand, rank 0 hosts it
        hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world, hosts, timeout, wait_for_workers=False)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("rlfleet_pg", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if cuda else None,
        )
        group = cls(
            rank, world, local_rank, device, dist.PrefixStore(_PREFIX, store), timeout_s, heartbeat_timeout_s, backend
        )
        group.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        group._start_heartbeats()
        print(f"learner rank {rank}/{world} ({backend}, {device}) joined {host}:{port}", flush=True)
        return group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def close(self) -> None:
        self._stop.set()
        # the heartbeat threads out of their store calls first: a daemon thread still inside a store call when the
        # interpreter ends takes the process down with std::terminate (SIGABRT), seen under load in CI
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10.0)
        if self.distributed and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass

    # --- liveness ---------------------------------------------------------------------------------------------
    def _start_heartbeats(self) -> None:
        beat_store, watch_store = self._store.clone(), self._store.clone()

        def beat():
            while not self._stop.wait(1.0):
                try:
                    beat_store.add(f"hb/{self.rank}", 1)
                except Exception:  # noqa: BLE001 - the store's host (rank 0 or the agent) is gone
                    self.fail("the rendezvous store is unreachable (rank 0 or torchrun's agent is gone)")

        def watch():
            peers = range(1, self.world) if self.is_leader else (0,)
            now = time.monotonic()
            self._seen = {r: (-1, now) for r in peers}
            while not self._stop.wait(1.0):
                silent = self.silent_ranks(watch_store)
                if silent:
                    r, age = silent[0]
                    self.fail(f"learner rank {r} sent no heartbeat for {age:.0f}s")

        self._threads = [
            threading.Thread(target=beat, name="rank-heartbeat", daemon=True),
            threading.Thread(target=watch, name="rank-watchdog", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def silent_ranks(self, store=None) -> list[tuple[int, float]]:
        """Watched ranks whose heartbeat counter has not moved for heartbeat_timeout_s: [(rank, seconds)]."""
        store = store or self._store.clone()
        now, out = time.monotonic(), []
        for r, (last, since) in list(self._seen.items()):
            try:
                value = store.add(f"hb/{r}", 0)
            except Exception:  # noqa: BLE001
                value = last
            if value != last:
                self._seen[r] = (value, now)
            elif now - since > self.heartbeat_timeout_s:
                out.append((r, now - since))
        return out

    def fail(self, why: str) -> None:
        """The group is broken: say so naming the rank, and end this rank (its peers end through torchrun, or
        when its heartbeat stops)."""
        print(
            f"learner rank {self.rank}: the rank group is broken: {why}; ending this rank", file=sys.stderr, flush=True
        )
        self._stop.set()
        os._exit(GROUP_BROKEN)

    def broken(self, exc: BaseException) -> GroupError:
        """A collective failed: name the peers that went silent (waiting briefly for their heartbeats to tell)."""
        for _ in range(3):
            silent = [r for r, _age in self.silent_ranks()] if self.distributed else []
            if silent:
                return GroupError(f"learner rank(s) {silent} gone: {exc}")
            time.sleep(1.0)
        return GroupError(f"a collective among the learner's ranks failed on rank {self.rank}: {exc}")

    # --- commands (leader -> followers) -------------------------------------------------------------------------
    def command(
        self, name: str, meta: dict | None = None, tensors: list[Mapping[str, torch.Tensor]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Leader: tell every follower to run ``name`` with ``meta``; ``tensors``: one dict per rank (rank 0's
        included), sent point to point. Returns rank 0's own tensors. Call under ``lock``, then run the handler."""
        assert self.is_leader
        meta = dict(meta or {})
        if not self.distributed:
            return dict(tensors[0]) if tensors else {}
        packed = [_pack(t) for t in tensors] if tensors else None
        if packed:
            meta["_layouts"] = [p[0] for p in packed]
            meta["_nbytes"] = [int(p[1].numel()) for p in packed]
        text = json.dumps({"name": name, "meta": meta})
        self._seq += 1
        for r in range(1, self.world):
            self._cmd_store.queue_push(f"cmd/{r}", text)
        if packed:
            try:
                for r in range(1, self.world):
                    if packed[r][1].numel():
                        dist.send(packed[r][1], dst=r, group=self.cpu_group)
            except RuntimeError as exc:
                raise self.broken(exc) from exc
        return _unpack(*packed[0]) if packed else {}

    def next_command(self) -> tuple[str, dict, dict[str, torch.Tensor]]:
        """Follower: wait for the leader's next command (watching its heartbeat meanwhile)."""
        assert not self.is_leader
        store = self._cmd_store
        # a long wait between commands is normal (an evaluation, a slow rollout): the watchdog thread ends this
        # rank if rank 0 goes silent, so the wait only wakes now and then
        store.set_timeout(timedelta(seconds=30))
        while True:
            try:
                text = store.queue_pop(f"cmd/{self.rank}")
                break
            except Exception as exc:  # noqa: BLE001 - the wait ran out (or the store is gone)
                if "timeout" not in str(exc).lower():
                    self.fail(f"the rendezvous store failed ({exc}): rank 0 is gone")
        msg = json.loads(text)
        meta = msg["meta"]
        tensors: dict[str, torch.Tensor] = {}
        if "_layouts" in meta:
            nbytes = meta["_nbytes"][self.rank]
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                try:
                    dist.recv(buf, src=0, group=self.cpu_group)
                except RuntimeError as exc:
                    raise self.broken(exc) from exc
            tensors = _unpack(meta["_layouts"][self.rank], buf)
        return msg["name"], meta, tensors

    # --- collectives (every rank, same order) -----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the group (a no-op in a group of one); ``op``: sum | max | min."""
        if self.distributed:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            try:
                dist.all_reduce(t, op=ops[op])
            except RuntimeError as exc:
                raise self.broken(exc) from exc
        return t

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's tensors (in place)."""
        if not self.distributed:
            return
        try:
            for t in tensors:
                dist.broadcast(t, src=0)
        except RuntimeError as exc:
            raise self.broken(exc) from exc

    def max_int(self, n: int) -> int:
        if not self.distributed:
            return n
        return int(self.all_reduce(torch.tensor([n], dtype=torch.int64, device=self.device), "max").item())
