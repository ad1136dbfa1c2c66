"""The env contract's versions, and how rlfleet reads what a server of any of them sends (docs/env-contract.md).

proto3 does not send a field at its zero value, so a server written before a field existed cannot be told from
one that sets it to zero. Every field added after the first published contract therefore reads its zero value as
its documented default, and what changed meaning between versions is read by the version a server declares:

    EnvSpec.contract_version ''  -> version "0", the first published contract
    EnvSpec.max_action_chunk 0   -> 1 (no chunks)
    EnvSpec.max_step_streams 0   -> not stated: one stream (what rlfleet opens); no refusal is promised
    EnvSpec.num_reset_states 0   -> no fixed initial states
    EnvSpec.simulator ''         -> "external"
    version 0: StepResponse.final_observations has a row for every stepped env, the ended rows are those whose
               terminated or truncated is set (version 1 lists them in final_rows and sends only those rows);
               EpisodeStats.reset_state_id (absent then) reads as -1.

The env side's bridge to external servers, `coordinatorctl start`'s check of external servers and the conformance kit
(rlfleet.simulators.conformance) all read specs through this module, so they agree on every version. They also
read a server's replies through it (:class:`EnvClient`): bytes first, whose counts are scanned against
rlfleet/wire/limits.py before protobuf parses them, then :func:`limit_problems` (a Describe) or
:func:`check_reply` (a Reset or Step reply), so a server that claims absurd sizes costs a one-line refusal, not
the memory its claim describes (docs/env-contract.md#limits).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rlfleet.untrusted import BadFile
from rlfleet.wire import codec, limits

DOC = "docs/env-contract.md"
CURRENT = "1"
KNOWN_VERSIONS = ("0", "1")
DEFAULT_MAX_STEP_STREAMS = 1  # max_step_streams 0 (not stated): the one stream a bridge keeps open
#: gRPC metadata that asks a server to fail that Step stream's first request as a simulator crash would
#: (INTERNAL); optional for servers, used by `check-env`'s simulator_crash check (docs/env-contract.md#errors)
FAULT_METADATA = ("rlfleet-fault", "simulator-crash")

_ANCHORS = {  # section titles of docs/env-contract.md -> their anchors
    "versions": "versions",
    "tensors": "tensors",
    "describe": "describe",
    "reset": "reset",
    "step": "step",
    "chunks": "action-chunks",
    "final": "episode-end-and-final-observations",
    "instructions": "instructions",
    "close": "close",
    "streams": "streams-and-concurrency",
    "errors": "errors",
    "rlfleet": "what-rlfleet-does-with-your-server",
    "limits": "limits",
}


def section(name: str) -> str:
    """``docs/env-contract.md#anchor`` of a section (names above)."""
    return f"{DOC}#{_ANCHORS[name]}"


def version_of(spec) -> str:
    """The contract version a server declares ('' = "0", the first published contract)."""
    return spec.contract_version or "0"


@dataclass(frozen=True)
class View:
    """An EnvSpec as rlfleet reads it: zero values replaced by their documented defaults."""

    version: str
    num_envs: int
    max_episode_steps: int
    max_action_chunk: int
    max_step_streams: int
    streams_stated: bool  # max_step_streams was set (a refusal of one more stream is promised)
    num_reset_states: int
    simulator: str
    auto_reset: bool

    @property
    def lists_final_rows(self) -> bool:
        """Version >= 1: final_rows names the ended rows and final_observations holds only those."""
        return self.version != "0"

    @property
    def has_instructions(self) -> bool:
        """Version >= 1: ResetResponse/StepResponse may carry instructions; EpisodeStats its reset_state_id."""
        return self.version != "0"


def read(spec) -> View:
    return View(
        version=version_of(spec),
        num_envs=int(spec.num_envs),
        max_episode_steps=int(spec.max_episode_steps),
        max_action_chunk=int(spec.max_action_chunk) or 1,
        max_step_streams=int(spec.max_step_streams) or DEFAULT_MAX_STEP_STREAMS,
        streams_stated=spec.max_step_streams > 0,
        num_reset_states=max(0, int(spec.num_reset_states)),
        simulator=spec.simulator or "external",
        auto_reset=bool(spec.auto_reset),
    )


_ANY = -(1 << 63)  # no lower bound (spec_problems says what is too small, in its own words)


def limit_problems(spec, source: str = "EnvSpec") -> list[str]:
    """What an EnvSpec claims beyond rlfleet's limits (rlfleet/wire/limits.py, docs/env-contract.md#limits); one
    line each, naming ``source``, the field, the limit and the claimed value. Counted from the message's fields
    alone, before anything is built from them (no list per env, no array per space): every reader of a peer's
    Describe (the bridge, `coordinatorctl start`, `check-env`) calls it first and uses nothing of a spec it
    refuses."""
    out: list[str] = []

    def run(check, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except BadFile as exc:
            out.append(f"{exc} ({section('limits')})")
            return None

    check, chars = limits.check, limits.check_chars
    n = run(check, source, "num_envs", spec.num_envs, "MAX_ENVS", minimum=_ANY)
    run(check, source, "max_episode_steps", spec.max_episode_steps, "MAX_EPISODE_STEPS", minimum=_ANY)
    chunk = run(check, source, "max_action_chunk", spec.max_action_chunk, "MAX_ACTION_CHUNK", minimum=_ANY)
    run(check, source, "num_reset_states", spec.num_reset_states, "MAX_RESET_STATES", minimum=_ANY)
    for name in ("env_id", "simulator", "incarnation", "contract_version"):
        run(chars, source, name, getattr(spec, name))
    if run(check, source, "task_descriptions (count)", len(spec.task_descriptions), "MAX_ENVS") is not None:
        for i, text in enumerate(spec.task_descriptions):
            if run(chars, source, f"task_descriptions[{i}]", text, "MAX_INSTRUCTION_CHARS") is None:
                break
    per_env = 0  # bytes of one env's observation
    if run(check, source, "observation_space (entries)", len(spec.observation_space), "MAX_OBS_ENTRIES") is not None:
        for key, entry in spec.observation_space.items():
            field = f"observation_space['{key[:40]}']"
            if run(chars, source, f"{field} (key)", key) is None:
                break
            count = _elements(entry, f"{field}.shape", "MAX_SPACE_ELEMENTS", source, run)
            if count is None:
                break
            per_env += count * _itemsize(entry.dtype)
        else:
            if (
                run(
                    check,
                    source,
                    "observation_space (bytes of one env's observation)",
                    per_env,
                    "MAX_ENV_STEP_BYTES",
                    per="bytes per env",
                )
                is not None
                and n is not None
                and n > 0
            ):
                run(
                    check,
                    source,
                    f"num_envs x observation bytes ({n:,} x {per_env:,}: a Reset of every env)",
                    n * per_env,
                    "MAX_MESSAGE_BYTES",
                    per="bytes, one reply (host fewer envs per server)",
                )
    actions = _elements(spec.action_space, "action_space.shape", "MAX_ACTION_ELEMENTS", source, run)
    if actions is not None and chunk is not None:
        row = actions * 4  # FLOAT32
        if (
            run(
                check,
                source,
                f"max_action_chunk x action bytes ({max(chunk, 1):,} x {row:,})",
                max(chunk, 1) * row,
                "MAX_ENV_STEP_BYTES",
                per="bytes per env",
            )
            is not None
            and n is not None
            and n > 0
        ):
            run(
                check,
                source,
                f"num_envs x action bytes ({n:,} x {row:,}: a Step of every env)",
                n * row,
                "MAX_MESSAGE_BYTES",
                per="bytes, one request (host fewer envs per server)",
            )
    return out


def _itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype (1 for one that is not a dtype: decoding the space refuses it)."""
    try:
        return codec.numpy_dtype(dtype).itemsize
    except codec.CodecError:
        return 1


def _elements(entry, field: str, name: str, source: str, run) -> int | None:
    """Elements per env of a TensorSpec's shape, or None when its rank or count is past the limits (``run``
    records why). Negative dimensions count as 0 here; decoding the space refuses them."""
    if run(limits.check, source, f"{field} (dimensions)", len(entry.shape), "MAX_DIMS") is None:
        return None
    count = 1
    for d in entry.shape:
        count *= max(int(d), 0)
    return run(limits.check, source, f"{field} (elements)", count, name, per="per env")


def check_reply(resp, n: int, source: str, *, step: bool) -> None:
    """Counts a ResetResponse (``step=False``) or StepResponse claims, checked against the ``n`` rows the request
    asked for before anything of it is decoded (the codec then checks every tensor's rows, shape and bytes):
    map entries, instructions (count and characters), and for a Step ``final_rows`` and ``episodes`` (one per
    ended row at most). Raises :class:`~rlfleet.untrusted.TooLarge` naming ``source`` (e.g.
    ``StepResponse``), the field, the limit and the claimed count."""
    maps = ("observations", "final_observations") if step else ("observations",)
    for name in maps:
        limits.check(source, f"{name} (entries)", len(getattr(resp, name).tensors), "MAX_OBS_ENTRIES")
    asked = f"(one per row asked for, or none; {n:,} rows were asked for)"
    limits.check(source, "instructions (count)", len(resp.instructions), cap=n, per=asked)
    for i, text in enumerate(resp.instructions):
        limits.check_chars(source, f"instructions[{i}]", text, "MAX_INSTRUCTION_CHARS")
    if step:
        ended = f"(one per ended row; {n:,} rows were stepped)"
        limits.check(source, "final_rows (count)", len(resp.final_rows), cap=n, per=ended)
        limits.check(source, "episodes (count)", len(resp.episodes), cap=n, per=ended)
        for i, ep in enumerate(resp.episodes):
            limits.check_chars(source, f"episodes[{i}].instruction", ep.instruction, "MAX_INSTRUCTION_CHARS")


def spec_problems(spec) -> list[str]:
    """What in an EnvSpec no version of the contract allows; one line each, naming the field and the section.
    Claims past rlfleet's limits (:func:`limit_problems`) come first, and then nothing is decoded."""
    from rlfleet.wire.spaces import TensorSpace, spaces_from_proto

    out = limit_problems(spec)
    if out:
        return out
    if version_of(spec) not in KNOWN_VERSIONS:
        out.append(
            f"EnvSpec.contract_version is {spec.contract_version!r}; rlfleet knows versions "
            f"{', '.join(repr(v) for v in KNOWN_VERSIONS)} ('' reads as '0') ({section('versions')})"
        )
    if spec.num_envs < 1:
        out.append(f"EnvSpec.num_envs is {spec.num_envs}; a server hosts at least one env ({section('describe')})")
    if spec.max_episode_steps < 1:
        out.append(
            f"EnvSpec.max_episode_steps is {spec.max_episode_steps}; must be >= 1: rlfleet takes the episode "
            f"limit of an external server from Describe ({section('describe')})"
        )
    for name in ("max_action_chunk", "max_step_streams", "num_reset_states"):
        if getattr(spec, name) < 0:
            out.append(
                f"EnvSpec.{name} is {getattr(spec, name)}; must be >= 0 (0 reads as its default) "
                f"({section('describe')})"
            )
    if len(spec.task_descriptions) not in (0, spec.num_envs):
        out.append(
            f"EnvSpec.task_descriptions: {len(spec.task_descriptions)} strings for {spec.num_envs} envs "
            f"(one per env, or none) ({section('describe')})"
        )
    if not spec.observation_space:
        out.append(f"EnvSpec.observation_space is empty ({section('describe')})")
    try:
        spaces_from_proto(spec.observation_space)
    except (ValueError, KeyError) as exc:
        out.append(f"EnvSpec.observation_space: {exc} ({section('tensors')})")
    try:
        action = TensorSpace.from_proto(spec.action_space)
    except (ValueError, KeyError) as exc:
        out.append(f"EnvSpec.action_space: {exc} ({section('tensors')})")
    else:
        if action.dtype != np.float32 or not action.shape:
            out.append(
                f"EnvSpec.action_space is {action.dtype} {list(action.shape)}; rlfleet sends FLOAT32 actions "
                f"of at least one dimension ({section('describe')})"
            )
        elif not (action.low <= action.high).all():
            out.append(f"EnvSpec.action_space: low > high somewhere ({section('tensors')})")
    return out


def run_problems(spec, *, policy_chunk: int = 1) -> list[str]:
    """Why a run cannot use this server (empty: it can): spec_problems, and a policy chunk the server does not
    accept. Checked when the run starts, never in the middle of it."""
    out = spec_problems(spec)
    k = read(spec).max_action_chunk
    if policy_chunk > k:
        out.append(
            f"EnvSpec.max_action_chunk is {spec.max_action_chunk}"
            + (" (0 reads as 1)" if not spec.max_action_chunk else "")
            + f"; the policy acts in chunks of {policy_chunk} (actor.model.num_action_chunks) "
            f"({section('chunks')})"
        )
    return out


def ended_rows(final_rows: Sequence[int], terminated: np.ndarray, truncated: np.ndarray, view: View) -> np.ndarray:
    """Positions of the rows whose episode ended in a step: ``final_rows`` (version >= 1), or the rows with a
    terminated or truncated cell (version 0, which had no final_rows)."""
    if view.lists_final_rows:
        return np.asarray([int(r) for r in final_rows], np.int64)
    n = terminated.shape[0]
    return np.flatnonzero((np.asarray(terminated) | np.asarray(truncated)).reshape(n, -1).any(1)).astype(np.int64)


def decode_final_observations(
    msg,
    rows: np.ndarray,
    n: int,
    specs: Mapping,
    name: str = "final_observations",
    *,
    every_row_ok: bool = True,
    writable: bool = False,
) -> dict[str, np.ndarray]:
    """The final observations of the ended ``rows`` (positions among the ``n`` stepped rows).

    Accepted: one row per ended row, in ``rows`` order; with ``every_row_ok`` also one row per stepped row
    (version 0's form, whose ended rows are then picked); and, when no row ended, an empty map (absent entries
    read as [0, ...] tensors). Raises codec.CodecError naming the entry otherwise."""
    k = len(rows)
    if k == 0 and not msg.tensors:
        return {key: np.zeros((0, *s.shape), codec.numpy_dtype(s.dtype)) for key, s in specs.items()}
    if every_row_ok and k != n and msg.tensors and all(t.shape[:1] == [n] for t in msg.tensors.values()):
        every = codec.decode_map(msg, name, specs=specs, batch=n, writable=writable)
        return {key: v[rows] for key, v in every.items()}
    return codec.decode_map(msg, name, specs=specs, batch=k, writable=writable)


# --- an EnvService's replies, read as rlfleet reads them: bytes first, counts scanned, then parsed and checked ------
_SERVICE = "/rlfleet.v1.EnvService"
_SHAPE = {2: limits.Rule("shape", "MAX_DIMS", unit="dimensions", packed=True)}  # of a Tensor or a TensorSpec
ENV_SPEC_RULES = {
    3: limits.Rule(
        "observation_space", "MAX_OBS_ENTRIES", unit="entries", keyed=True, rules={2: limits.Rule("", rules=_SHAPE)}
    ),
    4: limits.Rule("action_space", rules=_SHAPE),
    6: limits.Rule("task_descriptions", "MAX_ENVS", unit="count"),
}


def _map(name: str) -> limits.Rule:
    """A TensorMap field: its entries counted, each entry's tensor shape too."""
    return limits.Rule(
        name,
        rules={
            1: limits.Rule("", "MAX_OBS_ENTRIES", unit="entries", keyed=True, rules={2: limits.Rule("", rules=_SHAPE)})
        },
    )


def reply_rules(n: int, *, step: bool) -> dict[int, limits.Rule]:
    """How :func:`limits.scan` counts a ResetResponse (``step=False``) or StepResponse for ``n`` rows asked for."""
    asked = f"(one per row asked for, or none; {n:,} rows were asked for)"
    if not step:
        return {1: _map("observations"), 2: limits.Rule("instructions", unit="count", cap=n, per=asked)}
    ended = f"(one per ended row; {n:,} rows were stepped)"
    return {
        1: _map("observations"),
        **{
            i: limits.Rule(name, rules=_SHAPE)
            for i, name in ((2, "rewards"), (3, "terminated"), (4, "truncated"), (5, "success"))
        },
        6: _map("final_observations"),
        7: limits.Rule("episodes", unit="count", cap=n, per=ended),
        8: limits.Rule("final_rows", unit="count", cap=n, per=ended, packed=True),
        9: limits.Rule("instructions", unit="count", cap=n, per=asked),
    }


def read_reply(raw: bytes, n: int, source: str, *, step: bool):
    """A ResetResponse or StepResponse from its bytes, for ``n`` rows asked for: its counts scanned before it is
    parsed (:func:`reply_rules`), then :func:`check_reply`. Raises TooLarge / BadFile naming ``source``."""
    from rlfleet.v1 import env_pb2

    limits.scan(raw, reply_rules(n, step=step), source)
    kind = env_pb2.StepResponse if step else env_pb2.ResetResponse
    try:
        resp = kind.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise BadFile(source, "message", f"a serialized {kind.__name__}", f"{type(exc).__name__}: {exc}") from None
    check_reply(resp, n, source, step=step)
    return resp


class EnvClient:
    """An EnvService on ``channel`` whose replies are read as bytes, their counts scanned against the limits
    before protobuf builds anything from them (a reply of a million tiny records costs ~50x its size once
    parsed), then parsed and checked: what the bridge and `check-env` call a server through. The calls raise
    grpc.RpcError as a stub's do, and TooLarge / BadFile for a reply past the limits."""

    def __init__(self, channel):
        from rlfleet.v1 import env_pb2

        self._describe = channel.unary_unary(
            f"{_SERVICE}/Describe", request_serializer=env_pb2.DescribeEnvRequest.SerializeToString
        )
        self._reset = channel.unary_unary(
            f"{_SERVICE}/Reset", request_serializer=env_pb2.ResetRequest.SerializeToString
        )
        self.step_call = channel.stream_stream(
            f"{_SERVICE}/Step", request_serializer=env_pb2.StepRequest.SerializeToString
        )
        self.close = channel.unary_unary(
            f"{_SERVICE}/Close",
            request_serializer=env_pb2.CloseRequest.SerializeToString,
            response_deserializer=env_pb2.CloseResponse.FromString,
        )

    def describe(self, timeout: float | None = None, source: str = "EnvSpec"):
        """The server's EnvSpec; its counts scanned first (:data:`ENV_SPEC_RULES`). The other limits are
        :func:`limit_problems`' to check (spec_problems and run_problems include them)."""
        from rlfleet.v1 import env_pb2

        raw = self._describe(env_pb2.DescribeEnvRequest(), timeout=timeout)
        limits.scan(raw, ENV_SPEC_RULES, source)
        try:
            return env_pb2.EnvSpec.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError
            raise BadFile(source, "message", "a serialized EnvSpec", f"{type(exc).__name__}: {exc}") from None

    def reset(self, request, n: int, timeout: float | None = None, source: str = "ResetResponse"):
        """Reset; ``n``: the rows asked for (the server's num_envs when ``env_ids`` is empty)."""
        return read_reply(self._reset(request, timeout=timeout), n, source, step=False)

    def stream(self, *, timeout: float | None = None, metadata=None, source: str = "StepResponse") -> StepCall:
        return StepCall(self, timeout=timeout, metadata=metadata, source=source)


class StepStreamError(RuntimeError):
    """A Step stream broke "one response per request, in order": it ended without answering, or it sent an
    answer no request asked for (a stream that never ends)."""


class StepCall:
    """One Step stream driven as rlfleet drives it (the bridge, `check-env`): :meth:`send` a request for ``n``
    rows, then :meth:`answer` reads its response. A reader thread moves answers into a queue, so an answer can be
    awaited with a deadline; it reads no further than the requests sent, so a server that streams answers nobody
    asked for costs one message (the stream is then cancelled and :meth:`answer` raises StepStreamError), not
    memory without end. Each answer is read by :func:`read_reply` (counts scanned before it is parsed, then
    checked): one past the limits is raised by :meth:`answer` as TooLarge / BadFile, and the stream goes on.
    ``timeout`` is the whole stream's gRPC deadline (None: none)."""

    _END = object()

    def __init__(self, client: EnvClient, *, timeout: float | None = None, metadata=None, source: str = "StepResponse"):
        self.source = source
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = client.step_call(iter(self._requests.get, self._END), timeout=timeout, metadata=metadata)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._rows: list[int] = []  # the rows of each request sent and not yet answered, in order
        self._reader = threading.Thread(target=self._read, name="step-answers", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import grpc

        try:
            for raw in self.call:
                with self._lock:
                    n = self._rows.pop(0) if self._rows else None
                if n is None:
                    self._answers.put(
                        StepStreamError(
                            f"sent a StepResponse no request asked for (one response per request: {section('step')})"
                        )
                    )
                    self.call.cancel()
                    return
                try:
                    self._answers.put(read_reply(raw, n, self.source, step=True))
                except BadFile as exc:
                    self._answers.put(_Refused(exc))
            self._answers.put(StepStreamError("ended the Step stream without answering"))
        except grpc.RpcError as exc:
            self._answers.put(exc)

    def send(self, request, n: int) -> None:
        """Send a request stepping ``n`` rows (its env_ids, or the server's num_envs when they are empty)."""
        with self._lock:
            self._rows.append(int(n))
        self._requests.put(request)

    def answer(self, wait: float | None = None):
        """The next response; raises the stream's gRPC error, StepStreamError, TooLarge / BadFile (an answer past
        the limits), or TimeoutError after ``wait`` seconds without one (None: wait for the stream's own
        deadline). An ended stream raises again."""
        try:
            item = self._answers.get(timeout=wait)
        except queue.Empty:
            raise TimeoutError(f"no Step answer within {wait:.0f}s") from None
        if isinstance(item, _Refused):
            raise item.exc
        if isinstance(item, BaseException):
            self._answers.put(item)  # the stream is over: every later answer() says so too
            raise item
        return item

    def cancel(self) -> None:
        self.call.cancel()

    def close(self, wait: float = 5.0) -> None:
        """End the stream and wait (up to ``wait`` seconds) for its reader thread to see the end: a reader still
        inside gRPC when the interpreter exits can leave the process hanging in its finalisation."""
        self._requests.put(self._END)
        self.call.cancel()
        if self._reader is not threading.current_thread():
            self._reader.join(wait)


class _Refused:
    """An answer the reader refused (past the limits); the stream itself goes on."""

    def __init__(self, exc: BadFile):
        self.exc = exc
