"""Bounded request streams on a server: at most so many concurrent streams of one kind (:class:`StreamSlots`: an env
server's Step streams, every server's reflection streams), each holding a pool thread while its handler waits for
the caller's next message; a stream idle too long is closed (one watcher thread per process), and a full set of
slots gives a newcomer the slot of one idle long enough, or RESOURCE_EXHAUSTED."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

import grpc

from rlfleet.errors import ResourceExhausted

log = logging.getLogger("rlfleet.wire.streams")


def _end_stream(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End a call from another thread with a status (its handler, blocked on the next request, then returns)."""
    try:
        from grpc._common import STATUS_CODE_TO_CYGRPC_STATUS_CODE

        context._rpc_event.call.cancel(STATUS_CODE_TO_CYGRPC_STATUS_CODE[code], message)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - another gRPC version: a plain cancel still frees the thread
        context.cancel()


class _Watched:
    """A stream's request iterator that knows since when its handler waits for the caller's next message."""

    def __init__(self, requests, context, slots: "StreamSlots"):
        self._requests, self.context, self.slots = requests, context, slots
        self.waiting_since: float | None = None
        self.closed: str | None = None

    def __iter__(self):
        return self

    def __next__(self):
        self.waiting_since = time.monotonic()
        try:
            return next(self._requests)
        finally:
            self.waiting_since = None

    def idle_for(self, now: float) -> float:
        since = self.waiting_since
        return 0.0 if since is None else now - since

    def close(self, message: str) -> None:
        if self.closed is None:
            self.closed = message
            _end_stream(self.context, grpc.StatusCode.DEADLINE_EXCEEDED, message)


class StreamSlots:
    """At most ``limit`` concurrent request streams of one kind on a server (each holds a pool thread while its
    handler waits for the caller's next message). A stream that has waited ``idle_close_s`` is closed with
    DEADLINE_EXCEEDED; when every slot is taken, a newcomer gets the slot of the stream that has waited longest if
    that one has waited ``reclaim_idle_s`` (it is closed the same way), else RESOURCE_EXHAUSTED at once."""

    def __init__(
        self, limit: int, what: str, *, idle_close_s: float | None = None, reclaim_idle_s: float | None = None
    ):
        self.limit, self.what = limit, what
        self.idle_close_s, self.reclaim_idle_s = idle_close_s, reclaim_idle_s
        self._cond = threading.Condition()
        self._active: list[_Watched] = []
        if idle_close_s is not None:
            _IdleWatch.add(self)

    def __len__(self) -> int:
        return len(self._active)

    def admit(self, requests, context) -> _Watched:
        """A slot for this stream (its requests, watched), or ResourceExhausted."""
        with self._cond:
            now = time.monotonic()
            open_ = [s for s in self._active if s.closed is None]
            if len(open_) >= self.limit and self.reclaim_idle_s is not None:
                victim = max(open_, key=lambda s: s.idle_for(now))
                idle = victim.idle_for(now)
                if idle >= self.reclaim_idle_s:
                    victim.close(
                        f"{self.what} stream closed: idle for {idle:.0f}s while another caller needed its "
                        f"slot ({self.limit} at most)"
                    )
                    open_.remove(victim)
            if len(open_) < self.limit <= len(self._active):  # closed ones leave once their handlers see it
                self._cond.wait_for(lambda: len(self._active) < self.limit, timeout=2.0)
            if len(self._active) >= self.limit:
                raise ResourceExhausted(
                    f"this server serves {self.limit} concurrent {self.what} streams, all busy; "
                    f"close one first or retry later"
                )
            stream = _Watched(requests, context, self)
            self._active.append(stream)
            return stream

    def leave(self, stream: _Watched) -> None:
        with self._cond:
            if stream in self._active:
                self._active.remove(stream)
            self._cond.notify_all()

    @contextlib.contextmanager
    def stream(self, requests, context):
        """``with slots.stream(request_iterator, context) as requests:`` (ResourceExhausted when full)."""
        stream = self.admit(requests, context)
        try:
            yield stream
        finally:
            self.leave(stream)

    def close_idle(self, now: float) -> None:
        with self._cond:
            streams = list(self._active)
        for s in streams:
            idle = s.idle_for(now)
            if idle >= self.idle_close_s:
                s.close(
                    f"{self.what} stream idle for {idle:.0f}s; closed (at most {self.limit} at once, "
                    f"{self.idle_close_s:.0f}s idle each)"
                )


class _IdleWatch:
    """One thread per process that closes streams idle past their ``idle_close_s``."""

    _slots: "weakref.WeakSet[StreamSlots]" = None  # type: ignore[assignment]
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    @classmethod
    def add(cls, slots: StreamSlots) -> None:
        with cls._lock:
            if cls._slots is None:
                cls._slots = weakref.WeakSet()
            cls._slots.add(slots)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._loop, name="grpc-idle-watch", daemon=True)
                cls._thread.start()

    @classmethod
    def _loop(cls) -> None:
        while True:
            time.sleep(0.25)
            with cls._lock:
                watched = list(cls._slots)
            now = time.monotonic()
            for slots in watched:
                try:
                    slots.close_idle(now)
                except Exception:  # noqa: BLE001 - never let the watcher die
                    log.exception("idle watch")
