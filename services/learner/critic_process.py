"""The critic's half of each PPO step in a helper process beside the learner (``cluster.learner_critic_process``).

Where the critic is apart from the actor (``Trainer.critic_apart``: an MLP policy, one rank, a synchronous run on
2+ cores) each optimizer step runs the critic's forward, value loss and backward beside the actor's. On a second
thread of the learner the two halves share one GIL: every tensor operation either half calls from Python hands it
over, and on a VM whose idle vCPUs halt each hand-off is a wake-up (238 voluntary context switches per default
update, docs/benchmarks.md). In a process of its own the critic's half has its own interpreter and core, and the
two sides meet twice per micro batch through shared memory.

**Shared memory.** One memfd (anonymous, no name in any file system; it goes when both processes do), mapped by
both: the critic's parameters, their gradients, one micro batch's inputs (features, old values, returns, row
weights) and a control block. The learner's critic parameters *are* views of it, so the learner's optimizer step
is what the helper computes with next, and the helper's backward writes the gradients the learner clips and steps.

**One step.** The learner writes the micro batch's rows, then the step's number (``GO``); the helper, spinning on
that word for the length of an update (its core is the one the critic's thread would hold), runs
:func:`services.learner.ppo.value_half` on them and writes its losses, then the number back (``DONE``); the
learner, after its actor half, spins for that. Between updates the helper sleeps on a pipe: the learner wakes it
at an update's start with the update's number and ends the update by writing the number into ``END``.

**The same bits as on a thread**: the same operations on the same numbers, in the same order (the learner tests
compare every weight and statistic of several updates). x86-64 Linux only (memfd, and a store order both cores see
alike); elsewhere, and for anything but ``nn.Linear`` layers and this project's activations in float32/float64, the
critic stays on the learner's thread.

**Faults.** A helper that exits, crashes or stays silent for ``timeout_s`` is killed; that micro batch's critic
half runs on the learner's thread and every later one too (logged once): the run goes on with the same numbers. A
learner that dies closes the pipe's writing end: the helper reads the end of the pipe and exits, and while it spins
it checks every few milliseconds that its parent is still the learner.

Run as ``python -m services.learner.critic_process`` by the learner only (the pipe and the memfd are its fds).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import platform
import struct
import subprocess
import sys
import time
import weakref

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

# the control block's int64 words
GO, DONE, ROWS, FIRST, END, READY, FAILED, RESULT_DTYPE, OLD_DTYPE, RET_DTYPE, WR_DTYPE = range(11)
_CTL_WORDS = 16
_ERROR_BYTES = 1024  # the helper's last error, UTF-8
_DTYPES = (torch.float32, torch.float64)  # codes 0 and 1
_SPINS_PER_CHECK = 1 << 14  # spins between two looks at the other side (a few ms)


def unsupported_here() -> str | None:
    """Why this platform runs no helper process (None: it can)."""
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        return "no memfd_create (not Linux)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"a {platform.machine()} CPU (the shared control words assume x86's store order)"
    return None


def unsupported(model) -> str | None:
    """Why ``model``'s critic cannot run in a helper process (None: it can): the platform, or a critic that is not
    a plain stack of ``nn.Linear`` layers and this project's activations in float32/float64 on the CPU."""
    why = unsupported_here()
    if why is not None:
        return why
    if getattr(model, "autocast_dtype", None) is not None:
        return "autocast"
    try:
        _layers(model.critic)
    except (AttributeError, ValueError) as exc:
        return str(exc)
    return None


def _layers(critic) -> list[list]:
    """``critic`` (an ``nn.Sequential``) -> its layers as the helper rebuilds them: ["linear", in, out] or [name]
    of an activation in ``rlfleet.policies.models.activations.ACTIVATIONS``."""
    from rlfleet.policies.models.activations import ACTIVATIONS

    if not isinstance(critic, nn.Sequential):
        raise ValueError(f"the critic is a {type(critic).__name__}, not an nn.Sequential")
    names = {cls: name for name, cls in ACTIVATIONS.items()}
    out, dtypes = [], set()
    for m in critic:
        if type(m) is nn.Linear and m.bias is not None:
            out.append(["linear", m.in_features, m.out_features])
            dtypes |= {m.weight.dtype, m.bias.dtype}
            if m.weight.device.type != "cpu":
                raise ValueError("the critic is not on the CPU")
        elif type(m) in names and (type(m) is not nn.ELU or (m.alpha == 1.0 and not m.inplace)):
            out.append([names[type(m)]])
        else:
            raise ValueError(f"the critic's layer {type(m).__name__} is not a linear layer or a known activation")
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise ValueError(f"the critic's parameters are {sorted(map(str, dtypes))}, not one of float32/float64")
    return out


def _build(layers: list[list], dtype: torch.dtype) -> nn.Sequential:
    from rlfleet.policies.models.activations import ACTIVATIONS

    mods = [
        nn.Linear(layer[1], layer[2], dtype=dtype) if layer[0] == "linear" else ACTIVATIONS[layer[0]]()
        for layer in layers
    ]
    return nn.Sequential(*mods)


class _Block:
    """The shared memory's layout, the same on both sides: the offsets of every region (JSON-able)."""

    def __init__(self, shapes: list[list[int]], itemsize: int, rows: int, features: int):
        off = 0

        def take(nbytes: int) -> int:
            nonlocal off
            at, off = off, off + (nbytes + 63) // 64 * 64
            return at

        self.params = [take(int(np.prod(s)) * itemsize) for s in shapes]
        self.grads = [take(int(np.prod(s)) * itemsize) for s in shapes]
        self.features = take(rows * features * itemsize)
        self.old_values, self.returns, self.weights = (take(rows * 8) for _ in range(3))  # room for float64
        self.ctl = take(_CTL_WORDS * 8)
        self.result = take(16)
        self.error = take(_ERROR_BYTES)
        self.size = off

    def as_dict(self) -> dict:
        return dict(vars(self))


class _Views:
    """numpy/torch views of a mapped block."""

    def __init__(self, buf, block: dict, shapes: list[list[int]], dtype: torch.dtype, rows: int, features: int):
        npd = np.float32 if dtype == torch.float32 else np.float64

        def arr(offset, shape, dt):
            return np.ndarray(shape, dtype=dt, buffer=buf, offset=offset)

        self.params = [torch.from_numpy(arr(o, s, npd)) for o, s in zip(block["params"], shapes)]
        self.grads = [torch.from_numpy(arr(o, s, npd)) for o, s in zip(block["grads"], shapes)]
        self.features = torch.from_numpy(arr(block["features"], (rows, features), npd))
        # each of the row vectors in float32 and float64 (the learner says which, per step)
        self.rowvecs = {
            name: [torch.from_numpy(arr(block[name], (rows,), dt)) for dt in (np.float32, np.float64)]
            for name in ("old_values", "returns", "weights")
        }
        self.ctl = arr(block["ctl"], (_CTL_WORDS,), np.int64)
        self.result = arr(block["result"], (2,), np.float64)
        self.error = arr(block["error"], (_ERROR_BYTES,), np.uint8)


class CriticProcess:
    """The learner's side: spawns the helper, shares the critic with it, hands it each micro batch (a job whose
    :meth:`result` is the critic's half), and notices when it is gone."""

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.failed: str | None = None  # why the helper is no longer used
        self._views: _Views | None = None
        self._params: list[torch.Tensor] = []
        self._seq = self._update = 0
        self._memfd = os.memfd_create("rlfleet-critic", os.MFD_CLOEXEC)
        read, self._pipe = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        args = [sys.executable, "-m", "services.learner.critic_process", str(read), str(self._memfd)]
        try:
            self._proc = subprocess.Popen(args, pass_fds=(read, self._memfd), env=env)
        finally:
            os.close(read)
        self._map: mmap.mmap | None = None
        self._started, self._ready_at = time.monotonic(), None
        self._finalizer = weakref.finalize(self, _shut, self._proc, self._pipe, self._memfd)

    # --- set-up -----------------------------------------------------------------------------------------------
    def attach(
        self, critic: nn.Sequential, rows: int, *, value_clip, huber_delta, value_loss_coef, core: int | None = None
    ) -> None:
        """Share ``critic``'s parameters (they become views of the shared block, values kept) for micro batches of
        up to ``rows`` rows, and send the helper what it needs to build its copy (and the ``core`` it then runs
        on)."""
        layers = _layers(critic)
        params = list(critic.parameters())
        dtype = params[0].dtype
        shapes = [list(p.shape) for p in params]
        features = layers[0][1]
        block = _Block(shapes, params[0].element_size(), rows, features)
        os.ftruncate(self._memfd, block.size)
        self._map = mmap.mmap(self._memfd, block.size)
        self._views = _Views(self._map, block.as_dict(), shapes, dtype, rows, features)
        self.rows, self._params = rows, params
        self.own()
        setup = {
            "layers": layers,
            "dtype": str(dtype).removeprefix("torch."),
            "shapes": shapes,
            "rows": rows,
            "block": block.as_dict(),
            "value_clip": value_clip,
            "huber_delta": huber_delta,
            "value_loss_coef": value_loss_coef,
            "core": core,
        }
        data = json.dumps(setup).encode()
        self._write(struct.pack("<q", len(data)) + data)

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach` has shared a critic with the helper."""
        return self._views is not None

    def own(self) -> None:
        """The critic's parameters as views of the block (again, where something replaced their data)."""
        for p, view in zip(self._params, self._views.params):
            if p.data.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(p.data)
                p.data = view

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the helper has built its copy of the critic (-> True), or it failed or ``timeout_s`` passed
        (benchmarks and tests; a run uses the thread until the helper is ready)."""
        deadline = time.monotonic() + timeout_s
        while not (self._views is not None and self._views.ctl[READY]):
            if self.failed is not None or self._proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    @property
    def ready_after_s(self) -> float:
        """Seconds from the helper's start to the first update that found it ready (an upper bound)."""
        return (self._ready_at or time.monotonic()) - self._started

    @property
    def steps(self) -> int:
        """Micro batches handed to the helper so far."""
        return self._seq

    def usable(self, critic) -> bool:
        """Whether this update's critic halves can go to the helper: it is up and built, and ``critic`` is still
        the module it shares (the same parameter objects)."""
        if self.failed is not None or self._views is None or not self._views.ctl[READY]:
            return False
        if self._ready_at is None:
            self._ready_at = time.monotonic()
        params = list(critic.parameters())
        if len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            return False
        if self._proc.poll() is not None:
            self.fail(f"it exited with code {self._proc.returncode} between updates")
            return False
        self.own()
        return True

    # --- one update -------------------------------------------------------------------------------------------
    def begin(self) -> bool:
        """Wake the helper for an update (-> False if it cannot be)."""
        self._update += 1
        return self._write(struct.pack("<q", self._update))

    def end(self) -> None:
        """The update is over: the helper goes back to sleep."""
        if self._views is not None:
            self._views.ctl[END] = self._update

    def submit(self, features, old_values, returns, weights, first: bool) -> CriticProcess:
        """Hand the helper one micro batch (``first``: the step's first, its gradients start from zero)."""
        v, n = self._views, len(features)
        with torch.no_grad():
            v.features[:n].copy_(features)
            codes = []
            for name, t in (("old_values", old_values), ("returns", returns), ("weights", weights)):
                code = _DTYPES.index(t.dtype)
                v.rowvecs[name][code][:n].copy_(t)
                codes.append(code)
        ctl = v.ctl
        ctl[OLD_DTYPE], ctl[RET_DTYPE], ctl[WR_DTYPE] = codes
        ctl[ROWS], ctl[FIRST] = n, int(first)
        self._seq += 1
        ctl[GO] = self._seq  # last: the helper reads the rows once it sees the number
        return self

    def accepts(self, features, old_values, returns, weights) -> bool:
        """Whether a micro batch fits the block (rows, feature width and dtypes)."""
        v = self._views
        return (
            len(features) <= self.rows
            and features.dtype == v.features.dtype
            and features.shape[1:] == v.features.shape[1:]
            and all(t.dtype in _DTYPES and t.dim() == 1 for t in (old_values, returns, weights))
        )

    def result(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The critic's half of the last micro batch: (value loss, clipped share); its gradients are the critic's
        parameters' ``.grad``. None when the helper failed (it is then not used again)."""
        v, seq = self._views, self._seq
        ctl, spins, started = v.ctl, 0, None
        while ctl[DONE] != seq:
            if ctl[FAILED] == seq:
                text = bytes(v.error).split(b"\0", 1)[0].decode(errors="replace")
                self.fail(f"it failed on a micro batch: {text}")
                return None
            spins += 1
            if spins % _SPINS_PER_CHECK == 0:
                if self._proc.poll() is not None:
                    self.fail(f"it exited with code {self._proc.returncode}")
                    return None
                now = time.monotonic()
                started = started or now
                if now - started > self.timeout_s:
                    self.fail(f"it did not answer a micro batch in {self.timeout_s:.0f} s")
                    return None
        for p, g in zip(self._params, v.grads):
            p.grad = g
        dtype = _DTYPES[int(ctl[RESULT_DTYPE])]
        return torch.tensor(v.result[0], dtype=dtype), torch.tensor(v.result[1], dtype=dtype)

    # --- faults and the end -----------------------------------------------------------------------------------
    def _write(self, data: bytes) -> bool:
        try:
            os.write(self._pipe, data)
            return True
        except OSError as exc:
            self.fail(f"its pipe is closed ({exc})")
            return False

    def fail(self, why: str) -> None:
        """Stop using the helper (logged once) and kill it."""
        if self.failed is None:
            self.failed = why
            log.warning(
                "the critic's helper process (pid %d): %s; the critic runs on the learner's thread from now "
                "on (the same numbers)",
                self._proc.pid,
                why,
            )
            self._proc.kill()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        self._finalizer()


def _shut(proc: subprocess.Popen, pipe: int, memfd: int) -> None:
    """Close the helper's pipe (it exits on reading its end) and reap it; kill it if it lingers."""
    for fd in (pipe, memfd):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- the helper ---------------------------------------------------------------------------------------------------
def _read(fd: int, n: int) -> bytes | None:
    """Exactly ``n`` bytes from the pipe, or None at its end (the learner closed it or died)."""
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _serve(pipe: int, memfd: int) -> None:
    from services.learner import ppo  # imported now, while the learner starts: the first update finds it ready

    torch.set_num_threads(1)
    parent = os.getppid()
    head = _read(pipe, 8)
    if head is None:
        return
    body = _read(pipe, struct.unpack("<q", head)[0])
    if body is None:  # the learner went before it had sent the critic
        return
    setup = json.loads(body)
    if setup["core"] is not None:
        try:
            os.sched_setaffinity(0, {int(setup["core"])})
        except OSError:
            pass
    dtype = getattr(torch, setup["dtype"])
    shapes, rows, block = setup["shapes"], setup["rows"], setup["block"]
    buf = mmap.mmap(memfd, block["size"])
    v = _Views(buf, block, shapes, dtype, rows, setup["layers"][0][1])
    critic = _build(setup["layers"], dtype)
    params = list(critic.parameters())
    for p, data, grad in zip(params, v.params, v.grads):
        p.data, p.grad = data, grad  # the learner's parameters; the backward accumulates into the shared gradients
    clip, huber, coef = setup["value_clip"], setup["huber_delta"], setup["value_loss_coef"]
    ctl, last = v.ctl, 0
    ctl[READY] = 1
    while True:
        head = _read(pipe, 8)
        if head is None:
            return
        (update,) = struct.unpack("<q", head)
        spins = 0
        while True:
            go = int(ctl[GO])
            if go != last:
                last = go
                try:
                    n = int(ctl[ROWS])
                    if ctl[FIRST]:
                        torch._foreach_zero_(v.grads)
                    values = critic(v.features[:n]).squeeze(-1)
                    rv = v.rowvecs
                    v_loss, v_clip = ppo.value_half(
                        values,
                        rv["old_values"][int(ctl[OLD_DTYPE])][:n],
                        rv["returns"][int(ctl[RET_DTYPE])][:n],
                        rv["weights"][int(ctl[WR_DTYPE])][:n],
                        value_clip=clip,
                        huber_delta=huber,
                        value_loss_coef=coef,
                    )
                    v.result[0], v.result[1] = v_loss.item(), v_clip.item()
                    ctl[RESULT_DTYPE] = _DTYPES.index(v_loss.dtype)
                except Exception as exc:  # noqa: BLE001 - reported to the learner, which takes the step over
                    text = f"{type(exc).__name__}: {exc}".encode()[: _ERROR_BYTES - 1]
                    v.error[:] = 0
                    v.error[: len(text)] = np.frombuffer(text, dtype=np.uint8)
                    ctl[FAILED] = last
                    raise
                ctl[DONE] = last
                continue
            if ctl[END] == update:
                break
            spins += 1
            if spins % _SPINS_PER_CHECK == 0 and os.getppid() != parent:
                return  # the learner is gone


def main(argv: list[str]) -> int:
    _serve(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
