"""RemoteVecEnv: the vec-env interface (services.env.vec_env_interface) over an external simulator's EnvService (gRPC).

A bridge process (``python -m services.env.server --external-env HOST:PORT``) runs the rollout worker in front of
any simulator that implements ``rlfleet.v1.EnvService``, in any language, of any contract version
(rlfleet.wire.env_contract reads each version's fields and zero values).

What can go wrong with the simulator, and what the bridge does (docs/env-contract.md, "What rlfleet does with
your server"):

- It cannot be used at all (an unknown contract version, spaces rlfleet cannot act in, chunks shorter than the
  policy's): the constructor raises ``InvalidRequest`` naming the field, and the bridge exits before the first
  epoch with that one line.
- It dies, restarts, or answers as a crash would (UNAVAILABLE, CANCELLED, UNKNOWN, INTERNAL, DEADLINE_EXCEEDED),
  or it sends a response that breaks the contract (a malformed Reset/Step response): calls raise
  ``EnvConnectionLost``; the episodes in flight are lost, ``reconnect`` waits (with backoff, saying which address
  is down) until it answers again, and the rollout worker starts fresh episodes. ``answered`` tells a server that
  is up but misbehaving from one that is gone: the env server stops the run after a few of those in one call.
- It refuses a request (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...): that would happen
  again on every retry, so it raises ``InvalidRequest`` with the server's own message and the run stops with it.

Sizes a server claims are checked before anything is built from them (rlfleet/wire/limits.py,
docs/env-contract.md#limits): a Describe past the limits (envs, spaces, episode length, chunk, strings) is
refused like an unusable server, on every (re)connection; a Reset or Step reply with more rows, strings,
final rows or episodes than the request asked for, or tensors whose shape and bytes disagree, is a malformed
response. A Step answer is awaited at most ``call_timeout`` seconds (cluster.act_timeout_s), and an answer no
request asked for ends the stream: one request, one response.

The bridge never calls ``Close``: the simulator belongs to whoever started it, and stays usable after the run.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.untrusted import BadFile
from rlfleet.v1 import env_pb2
from rlfleet.wire import channels, codec, env_contract
from rlfleet.wire.spaces import TensorSpace, spaces_from_proto
from services.env.backends.base import StepResult

LOST_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
#: codes a server that is still up answers when its simulator failed (a crash in physics, an uncaught exception)
CRASH_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
#: failures of a simulator that is up (INTERNAL/UNKNOWN, a response breaking the contract) that one Collect or
#: Evaluate treats as crashes (episodes lost, fresh episodes); the next one stops the call and the run
MAX_SIMULATOR_FAULTS = 2
STREAM_SLOT_WAIT_S = 10.0  # a new Step stream refused RESOURCE_EXHAUSTED: the old one's slot is still being freed


class EnvConnectionLost(RuntimeError):
    """The external simulator stopped answering (crashed, restarted, network) or answered as a failed simulator
    does (INTERNAL, or a response that breaks the contract); its episodes in flight are lost. ``env`` is the
    RemoteVecEnv that lost it (to reconnect); ``answered``: the server is up and answered this way (as opposed to
    being unreachable)."""

    def __init__(self, message: str, env=None, *, answered: bool = False):
        super().__init__(message)
        self.env = env
        self.answered = answered


class RemoteVecEnv:
    def __init__(self, address: str, timeout: float = 60.0, call_timeout: float = 60.0, *, policy_chunk: int = 1):
        self.address = address
        self.call_timeout = call_timeout
        self.policy_chunk = policy_chunk
        self.spec: env_pb2.EnvSpec | None = None
        self._stream: env_contract.StepCall | None = None
        self._connect(timeout)

    # --- connection -------------------------------------------------------------------------------------------
    def _connect(self, timeout: float) -> None:
        self.channel = channels.wait_ready(self.address, timeout, credential=False)  # a simulator outside the run
        # replies are read as bytes and their counts scanned before protobuf builds anything (env_contract)
        self.client = env_contract.EnvClient(self.channel)
        try:
            spec = self.client.describe(timeout=timeout)
        except BadFile as exc:
            raise InvalidRequest(
                f"external env {self.address} cannot be used: {exc} ({env_contract.section('limits')})"
            ) from None
        # sizes first, on every (re)connection: nothing is built from a spec that claims past the limits
        problems = (
            env_contract.limit_problems(spec)
            if self.spec is not None
            else env_contract.run_problems(spec, policy_chunk=self.policy_chunk)
        )
        if problems:
            raise InvalidRequest(f"external env {self.address} cannot be used: {problems[0]}")
        if self.spec is not None:
            self._check_same(spec)
        self.spec = spec
        self.view = v = env_contract.read(spec)
        self.env_id = spec.env_id
        self.num_envs = spec.num_envs
        self.max_episode_steps = spec.max_episode_steps
        self.auto_reset = spec.auto_reset
        self.num_reset_states, self.max_action_chunk = v.num_reset_states, v.max_action_chunk
        self.simulator, self.contract_version = v.simulator, v.version
        self.obs_specs = dict(spec.observation_space)
        self.observation_space = spaces_from_proto(spec.observation_space)
        self.action_space = TensorSpace.from_proto(spec.action_space)
        self._act_low = self.action_space.low.astype(np.float32)
        self._act_high = self.action_space.high.astype(np.float32)
        # each env's current instruction: Describe's, then whatever Reset/Step responses say (absent: unchanged)
        self.instructions = list(spec.task_descriptions) or [""] * self.num_envs
        self._open_stream()

    def _open_stream(self) -> None:
        # answers are awaited with a deadline, and read no further than the requests sent (env_contract.StepCall)
        self._stream = self.client.stream()
        self._stream_fresh = True  # no response read yet

    def _check_same(self, spec) -> None:
        old = self.spec
        if (spec.num_envs, dict(spec.observation_space), spec.action_space) != (
            old.num_envs,
            dict(old.observation_space),
            old.action_space,
        ):
            raise InvalidRequest(
                f"external env {self.address} came back with different spaces or env count "
                f"({spec.num_envs} envs, was {old.num_envs}); restart the run"
            )

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.channel.close()

    def reconnect(self, timeout: float, log=print) -> float:
        """Wait until the simulator answers again (backoff 0.5 s -> 5 s), up to ``timeout`` seconds; returns the
        seconds it was down. Raises EnvConnectionLost when it stays down."""
        self._drop_stream()
        t0 = time.monotonic()
        delay, last_say = 0.5, 0.0
        log(f"external env {self.address} is down; reconnecting (up to {timeout:.0f}s)", flush=True)
        while True:
            try:
                self._connect(min(2.0, max(0.5, timeout - (time.monotonic() - t0))))
                down = time.monotonic() - t0
                log(f"external env {self.address} is back after {down:.1f}s", flush=True)
                return down
            except (TimeoutError, grpc.RpcError) as exc:
                waited = time.monotonic() - t0
                if waited >= timeout:
                    raise EnvConnectionLost(
                        f"external env {self.address} has been down for {waited:.0f}s "
                        f"(cluster.external_env_reconnect_timeout_s={timeout:.0f}); last error: "
                        f"{exc if isinstance(exc, TimeoutError) else channels.describe_error(exc)}"
                    ) from None
                if waited - last_say >= 5.0:
                    log(
                        f"external env {self.address} is down ({waited:.0f}s); retrying until {timeout:.0f}s",
                        flush=True,
                    )
                    last_say = waited
                time.sleep(delay)
                delay = min(5.0, delay * 2)

    def _failed(self, exc: grpc.RpcError, call: str) -> Exception:
        """An error status -> EnvConnectionLost (a crash: retry after reconnecting) or InvalidRequest (a refusal
        that a retry would meet again: the run stops with the server's message)."""
        code = exc.code()
        if code in LOST_CODES:
            return EnvConnectionLost(
                f"external env {self.address}: {call}: {channels.describe_error(exc)}",
                self,
                answered=code in CRASH_CODES,
            )
        hint = ""
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            hint = " (was it closed? rlfleet never calls Close; restart the simulator)"
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            hint = f" (another client holds its Step streams; a bridge needs one: {env_contract.section('streams')})"
        return InvalidRequest(f"external env {self.address} refused {call}: {channels.describe_error(exc)}{hint}")

    def _malformed(self, what: str, exc: Exception) -> EnvConnectionLost:
        # a size refusal (BadFile) already starts with the message it names: "StepResponse: episodes: ..."
        text = str(exc) if isinstance(exc, BadFile) else f"{what}: {exc}"
        return EnvConnectionLost(f"external env {self.address} sent a bad {text}", self, answered=True)

    # --- the vec-env interface ---------------------------------------------------------------------------------
    def _obs(self, msg, n: int, name: str) -> dict[str, np.ndarray]:
        return codec.decode_map(msg, name, specs=self.obs_specs, batch=n, writable=True)

    def _instructions(self, texts, ids: list[int]) -> list[str]:
        """Record the instructions of a response (one per row, or none = unchanged); -> each row's current one."""
        if texts:
            if len(texts) != len(ids):
                raise codec.CodecError(f"instructions: {len(texts)} strings for {len(ids)} rows (one per row, or none)")
            for i, text in zip(ids, texts):
                self.instructions[i] = text
        return [self.instructions[i] for i in ids]

    def _instruction_of(self, env_id: int) -> str:
        return self.instructions[env_id] if 0 <= env_id < self.num_envs else ""

    def reset(self, env_ids=None, seeds=None, reset_state_ids=None) -> dict[str, np.ndarray]:
        ids = [int(i) for i in env_ids] if env_ids is not None else []
        states = list(reset_state_ids or [])
        if states and self.view.version == "0" and any(int(s) != -1 for s in states):
            raise InvalidRequest(
                f"reset_state_ids: external env {self.address} implements contract version "
                f"{self.view.version}, which has no fixed initial states"
            )
        rows = ids or list(range(self.num_envs))
        try:
            resp = self.client.reset(
                env_pb2.ResetRequest(env_ids=ids, seeds=list(seeds or []), reset_state_ids=states),
                len(rows),
                timeout=self.call_timeout,
            )
        except grpc.RpcError as exc:
            raise self._failed(exc, "Reset") from exc
        except BadFile as exc:
            raise self._malformed("ResetResponse", exc) from exc
        try:
            obs = self._obs(resp.observations, len(rows), "observations")
            self._instructions(resp.instructions, rows)
        except codec.CodecError as exc:
            raise self._malformed("ResetResponse", exc) from exc
        return obs

    def _next_response(self, request: env_pb2.StepRequest, n: int) -> env_pb2.StepResponse:
        self._stream.send(request, n)
        deadline = time.monotonic() + STREAM_SLOT_WAIT_S
        while True:
            try:
                resp = self._stream.answer(wait=self.call_timeout)
                self._stream_fresh = False
                return resp
            except TimeoutError:
                self._stream.cancel()
                raise EnvConnectionLost(
                    f"external env {self.address} did not answer a Step within "
                    f"{self.call_timeout:.0f}s (cluster.act_timeout_s)",
                    self,
                    answered=True,
                ) from None
            except grpc.RpcError as exc:
                if (
                    exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    and self._stream_fresh
                    and time.monotonic() < deadline
                ):  # our own cancelled stream may still hold the slot
                    time.sleep(0.2)
                    self._open_stream()
                    self._stream.send(request, n)
                    continue
                raise self._failed(exc, "Step") from exc
            except env_contract.StepStreamError as exc:
                raise EnvConnectionLost(f"external env {self.address} {exc}", self, answered=True) from None
            except BadFile as exc:  # an answer past the limits (read_reply)
                raise self._malformed("StepResponse", exc) from exc

    def step(self, env_ids, actions) -> StepResult:
        ids = [int(i) for i in env_ids]
        actions = np.clip(np.asarray(actions, np.float32), self._act_low, self._act_high)  # the contract: in bounds
        rows_ids = ids or list(range(self.num_envs))
        n = len(rows_ids)
        resp = self._next_response(env_pb2.StepRequest(env_ids=ids, actions=codec.encode(actions)), n)
        per = [n] if actions.ndim == len(self.action_space.shape) + 1 else [n, actions.shape[1]]
        try:
            out = StepResult.from_proto(
                resp,
                per,
                self.obs_specs,
                self.view,
                instruction_of=self._instruction_of,
                record_instructions=lambda texts: self._instructions(texts, rows_ids),
            )
        except codec.CodecError as exc:
            raise self._malformed("StepResponse", exc) from exc
        return out

    def close(self) -> None:
        """End this bridge's Step stream. Close is not called: the simulator is its owner's to stop, and the next
        run (or `coordinatorctl check-env`) can use it as it is."""
        self._drop_stream()
