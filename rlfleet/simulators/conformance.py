"""Env contract conformance kit: checks a running EnvService against docs/env-contract.md.

    coordinatorctl check-env HOST:PORT [--only NAME ...] [--close] [--json] [--max-steps N] [--timeout S]

Every check drives the server over gRPC as rlfleet does and reports PASS, FAIL (what was wrong and which rule it
breaks) or SKIP (the server does not offer the feature, or the check needs something an earlier one found
missing). All checks run, whatever fails, so one run shows all that is left to do. The server is checked against
the contract version it declares (EnvSpec.contract_version; '' is version 0, the first published one), with zero
values read as their documented defaults (rlfleet.wire.env_contract).

It resets and steps the envs, so point it at a standalone simulator server, not at one a run is using. Exit code:
0 no check failed, 1 a check failed, 2 the server could not be reached, described, or was closed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc
import numpy as np

from rlfleet.untrusted import BadFile
from rlfleet.v1 import env_pb2
from rlfleet.wire import channels, codec, env_contract
from rlfleet.wire.spaces import TensorSpace, spaces_from_proto

CONTRACT_VERSION = env_contract.CURRENT
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BOUNDS_ATOL = 1e-4  # on top of the bounds rounded to the entry's dtype (docs/env-contract.md#tensors)
REFUSAL_WAIT_S = 5.0  # "one more stream fails at once": within this


class ContractError(AssertionError):
    """A server broke the contract; the message says how."""


class ServerClosed(RuntimeError):
    """The server answers Reset with FAILED_PRECONDITION: it was closed (Close) and must be restarted."""


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str
    seconds: float


class StepStream:
    """One Step stream: send a request, read its response (in order, as the contract requires). Answers are read
    no further than the requests sent (env_contract.StepCall): one nobody asked for, or a stream that ends without
    answering, is a ContractError; ``timeout`` is the stream's deadline."""

    def __init__(self, client: env_contract.EnvClient, num_envs: int, timeout: float, metadata=None, source=""):
        self._call = client.stream(timeout=timeout, metadata=metadata, source=source or "StepResponse")
        self._num_envs = num_envs

    def step(self, env_ids, actions) -> env_pb2.StepResponse:
        msg = actions if isinstance(actions, codec.Tensor) else codec.encode(actions)
        ids = [int(i) for i in env_ids]
        self._call.send(env_pb2.StepRequest(env_ids=ids, actions=msg), len(ids) or self._num_envs)
        try:
            return self._call.answer()
        except env_contract.StepStreamError as exc:
            raise ContractError(f"the server {exc}") from None
        except BadFile as exc:  # an answer past the limits: its counts were refused before it was parsed
            raise ContractError(str(exc)) from None

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._call.close()


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ContractError(message)


def _code_of(fn: Callable[[], object]) -> tuple[grpc.StatusCode | None, str]:
    """Run a call that is expected to fail; -> (status code, details) or (None, '') when it succeeded."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    except ContractError as exc:  # it was served, and the answer does not even fit the request
        return None, f"(and a bad answer: {exc})"
    return None, ""


def _got(code, details) -> str:
    return f"got {code.name if code else 'success'}" + (f" {details!r}" if details else "")


class Checker:
    """The checks, in order. Each ``check_<name>`` raises ContractError (FAIL) or returns a note; a note
    starting with 'skip:' is a SKIP."""

    NAMES = (
        "describe",
        "step_before_reset",
        "reset_shapes",
        "seeded_reset_determinism",
        "reset_order",
        "instructions",
        "step_shapes",
        "subset_step",
        "episode_end",
        "chunks",
        "reset_state_ids",
        "bad_input",
        "out_of_bounds_actions",
        "stream_limit",
        "abandoned_stream",
        "simulator_crash",
        "close",
    )

    def __init__(self, address: str, timeout: float = 60.0, max_steps: int = 2000, seed: int = 1234):
        self.address, self.timeout, self.max_steps = address, timeout, max_steps
        self.rng = np.random.default_rng(seed)
        self.channel = channels.wait_ready(address, timeout, credential=False)
        # replies are read as bytes, their counts scanned before protobuf builds anything (env_contract.EnvClient)
        self.env = env_contract.EnvClient(self.channel)
        self.include_close = False
        self.unusable = ""  # why the checks that reset and step cannot run (spaces that do not decode, no envs)
        self.obs_spaces: dict[str, TensorSpace] = {}
        self.action: TensorSpace | None = None
        # claims past rlfleet's limits (rlfleet/wire/limits.py): nothing is built from such a spec (no list per
        # env, no action batch of its shape); describe FAILs naming the claim and the other checks are SKIP
        try:
            self.spec = self.env.describe(timeout, source=f"{address} EnvSpec")
            self.too_large = env_contract.limit_problems(self.spec, f"{address} EnvSpec")
        except BadFile as exc:  # counts past the limits: not even parsed
            self.spec, self.too_large = env_pb2.EnvSpec(), [f"{exc} ({env_contract.section('limits')})"]
        self.view = env_contract.read(self.spec)
        too_large = self.too_large
        if too_large:
            self.n, self.obs_specs, self.instructions = 0, {}, []
            self.unusable = f"Describe claims more than rlfleet accepts ({too_large[0]})"
            return
        self.n = int(self.spec.num_envs)
        self.obs_specs = dict(self.spec.observation_space)
        try:
            self.obs_spaces = spaces_from_proto(self.obs_specs)
            self.action = TensorSpace.from_proto(self.spec.action_space)
        except (ValueError, KeyError) as exc:
            self.unusable = f"the spaces do not decode ({exc})"
        if not self.unusable and (
            self.n < 1 or not self.obs_specs or self.action.dtype != np.float32 or not self.action.shape
        ):
            self.unusable = "no envs, no observation entries, or no FLOAT32 action"
        self.instructions = list(self.spec.task_descriptions) or [""] * max(self.n, 0)

    # --- helpers ----------------------------------------------------------------------------------------------
    def _describe(self) -> env_pb2.EnvSpec:
        """Describe again (counts scanned before parsing: a reply past the limits is a ContractError)."""
        try:
            return self.env.describe(self.timeout, source=f"{self.address} EnvSpec")
        except BadFile as exc:
            raise ContractError(str(exc)) from None

    @property
    def v0(self) -> bool:
        return self.view.version == "0"

    def _reset(self, env_ids=(), seeds=(), states=()) -> tuple[dict[str, np.ndarray], list[str]]:
        n = len(env_ids) or self.n
        try:
            resp = self.env.reset(
                env_pb2.ResetRequest(env_ids=list(env_ids), seeds=list(seeds), reset_state_ids=list(states)),
                n,
                timeout=self.timeout,
                source=f"{self.address} ResetResponse",
            )
            obs = codec.decode_map(resp.observations, "ResetResponse.observations", specs=self.obs_specs, batch=n)
        except (codec.CodecError, BadFile) as exc:
            raise ContractError(str(exc)) from None
        _require(
            len(resp.instructions) in (0, n),
            f"ResetResponse.instructions: {len(resp.instructions)} strings for {n} reset envs (one each, or none)",
        )
        for i, text in zip(list(env_ids) or range(self.n), resp.instructions):
            self.instructions[i] = text
        return obs, list(resp.instructions)

    def _actions(self, n: int, chunk: int | None = None, scale: float = 1.0) -> np.ndarray:
        low, high = self.action.low, self.action.high
        low = np.where(np.isfinite(low), low, -1.0)
        high = np.where(np.isfinite(high), high, 1.0)
        shape = (n, *self.action.shape) if chunk is None else (n, chunk, *self.action.shape)
        a = self.rng.uniform(low, high, size=shape) * scale
        return a.astype(np.float32)

    def _decode_step(self, resp, env_ids: list[int], chunk: int | None, frozen=()) -> dict:
        """Decode and check a StepResponse for a request of ``env_ids`` (empty = all); ``frozen``: rows of envs
        that had ended with auto-reset off (they answer terminated but end no episode)."""
        ids = list(env_ids) or list(range(self.n))
        n = len(ids)
        per = [n] if chunk is None else [n, chunk]
        try:
            out = {
                "obs": codec.decode_map(resp.observations, "StepResponse.observations", specs=self.obs_specs, batch=n),
                "rewards": codec.decode(resp.rewards, "StepResponse.rewards", shape=per, dtype=np.float32, finite=True),
            }
            for name in ("terminated", "truncated", "success"):
                msg = getattr(resp, name)
                out[name] = codec.decode(msg, f"StepResponse.{name}", shape=per, dtype=bool)
                bad = set(msg.data) - {0, 1}
                _require(
                    not bad,
                    f"StepResponse.{name}: BOOL bytes must be 0 or 1, got {sorted(bad)[:3]} "
                    f"({env_contract.section('tensors')})",
                )
            term, trunc = out["terminated"], out["truncated"]
            flagged = np.flatnonzero((term | trunc).reshape(n, -1).any(1)).tolist()
            if self.view.lists_final_rows:
                rows = [int(r) for r in resp.final_rows]
                _require(
                    all(0 <= r < n for r in rows) and rows == sorted(set(rows)),
                    f"StepResponse.final_rows: {rows} must be distinct row positions in 0..{n - 1}, ascending",
                )
                ended = sorted(set(flagged) - set(frozen))
                _require(
                    rows == ended,
                    f"StepResponse.final_rows is {rows}; the rows whose episode ended in this step "
                    f"are {ended} (every ended row, and only those) ({env_contract.section('final')})",
                )
            else:
                rows = flagged
            out["final_rows"] = rows
            out["final_obs"] = env_contract.decode_final_observations(
                resp.final_observations,
                np.asarray(rows, np.int64),
                n,
                self.obs_specs,
                "StepResponse.final_observations",
                every_row_ok=self.v0,
            )
        except codec.CodecError as exc:
            raise ContractError(str(exc)) from None
        _require(
            not (term & trunc).any(),
            "StepResponse: terminated and truncated both true in one cell "
            "(terminated wins; truncated must then be false)",
        )
        if chunk is not None:
            ended_cells = (term | trunc).reshape(n, -1)
            for r in range(n):
                cells = np.flatnonzero(ended_cells[r])
                if cells.size:
                    first = int(cells[0])
                    later = slice(first + 1, None)
                    _require(
                        not out["rewards"][r, later].any()
                        and not term[r, later].any()
                        and not trunc[r, later].any()
                        and not out["success"][r, later].any(),
                        f"row {r}: its episode ended at sub-step {first}; the later sub-steps must not run "
                        f"(reward 0, flags false) ({env_contract.section('chunks')})",
                    )
        live = [r for r in rows if r not in frozen]
        _require(
            len(resp.episodes) == len(live),
            f"StepResponse: {len(resp.episodes)} EpisodeStats for {len(live)} ended rows (one per ended row)",
        )
        _require(
            sorted(e.env_id for e in resp.episodes) == sorted(ids[r] for r in live),
            f"StepResponse.episodes: env ids {sorted(e.env_id for e in resp.episodes)} for the ended envs "
            f"{sorted(ids[r] for r in live)}",
        )
        _require(
            len(resp.instructions) in (0, n),
            f"StepResponse.instructions: {len(resp.instructions)} for {n} "
            f"rows (one each, or none) ({env_contract.section('instructions')})",
        )
        out["episodes"] = list(resp.episodes)
        out["instructions_before"] = [self.instructions[i] for i in ids]
        for i, text in zip(ids, resp.instructions):
            self.instructions[i] = text
        self._bounds_ok(out["obs"], "StepResponse.observations")
        self._bounds_ok(out["final_obs"], "StepResponse.final_observations")
        return out

    def _bounds_ok(self, obs: dict[str, np.ndarray], what: str) -> None:
        """Declared bounds, rounded to the entry's dtype, hold for every value (BOUNDS_ATOL on top)."""
        for k, v in obs.items():
            if not len(v):
                continue
            space = self.obs_spaces[k]
            if v.dtype.kind == "f":
                _require(np.isfinite(v).all(), f"{what}[{k!r}]: non-finite values")
            lo, hi = space.low.reshape(-1), space.high.reshape(-1)
            if v.dtype.kind == "f":  # the bounds as the entry's dtype holds them
                with np.errstate(over="ignore"):
                    lo, hi = lo.astype(v.dtype).astype(np.float64), hi.astype(v.dtype).astype(np.float64)
            # each element's smallest and largest value over the rows, in the entry's own dtype: no float64 copy
            # of the whole batch (8x the bytes of a uint8 image batch)
            rows = v.reshape(len(v), -1)
            vmin, vmax = rows.min(0).astype(np.float64), rows.max(0).astype(np.float64)
            out = np.flatnonzero((vmin < lo - BOUNDS_ATOL) | (vmax > hi + BOUNDS_ATOL))
            if out.size:
                e = int(out[0])
                raise ContractError(
                    f"{what}[{k!r}]: element {e} (flat index; {len(out)} element(s) in all) is "
                    f"outside its declared bounds [{lo[e]:.6g}, {hi[e]:.6g}]: values "
                    f"{vmin[e]:.6g}..{vmax[e]:.6g} ({env_contract.section('tensors')})"
                )

    def _stream(self, metadata=None, timeout: float | None = None) -> StepStream:
        return StepStream(self.env, self.n, timeout or self.timeout, metadata, f"{self.address} StepResponse")

    def _step_once(self, ids, actions, metadata=None) -> env_pb2.StepResponse:
        stream = self._stream(metadata)
        try:
            return stream.step(ids, actions)
        finally:
            stream.close()

    def _expect(self, code_want, field: str | None, fn) -> str | None:
        """None when ``fn`` fails with ``code_want`` naming ``field``; else what happened instead."""
        code, details = _code_of(fn)
        if code == code_want and (field is None or field in details):
            return None
        return f"expected {code_want.name}" + (f" naming {field!r}" if field else "") + f", {_got(code, details)}"

    def _deterministic_step(self, env: int, seed: int, actions: list[np.ndarray]) -> dict[str, np.ndarray] | None:
        """Reset ``env`` with ``seed``, step it with ``actions``; -> its last observation."""
        self._reset([env], [seed])
        stream = self._stream()
        try:
            out = None
            for a in actions:
                out = self._decode_step(stream.step([env], a), [env], None)
        finally:
            stream.close()
        return out["obs"]

    def _episode_to_end(self, env: int, stream: StepStream, chunk: int | None = None) -> tuple[int, object]:
        """Step ``env`` until its episode ends; -> (control steps executed, its EpisodeStats)."""
        T = int(self.spec.max_episode_steps)
        steps = 0
        for _ in range(min(self.max_steps, T + 1)):
            out = self._decode_step(stream.step([env], self._actions(1, chunk)), [env], chunk)
            if out["final_rows"]:
                cells = np.flatnonzero((out["terminated"] | out["truncated"]).reshape(-1))
                return steps + int(cells[0]) + 1, out["episodes"][0] if out["episodes"] else None
            steps += chunk or 1
        raise ContractError(f"env {env} did not end an episode within max_episode_steps={T} control steps")

    # --- checks -----------------------------------------------------------------------------------------------
    def check_describe(self) -> str:
        s, v = self.spec, self.view
        # a claim past rlfleet's limits is named with the server's address; nothing else is decoded then
        _require(not self.too_large, "; ".join(self.too_large))
        problems = env_contract.spec_problems(s)
        again = self._describe()
        if again.incarnation != s.incarnation:
            problems.append(
                "EnvSpec.incarnation changed between two Describe calls (it may only change when the server restarts)"
            )
        _require(not problems, "; ".join(problems))
        defaults = [f"contract_version {s.contract_version!r} reads as version 0"] if not s.contract_version else []
        defaults += ["max_action_chunk 0 reads as 1"] if not s.max_action_chunk else []
        defaults += ["max_step_streams not stated (0)"] if not s.max_step_streams else []
        return (
            f"{v.simulator}:{s.env_id}, version {v.version}, {self.n} envs, action {list(self.action.shape)}, "
            f"obs { {k: list(sp.shape) for k, sp in self.obs_spaces.items()} }, chunk <= {v.max_action_chunk}, "
            f"{v.num_reset_states} reset states, auto_reset={s.auto_reset}"
            + (f" ({'; '.join(defaults)})" if defaults else "")
        )

    def check_step_before_reset(self) -> str:
        """Before this kit's first Reset: Step is refused naming env_ids (never reset), or served well-formed (a
        server that starts its envs itself, or one reset before this kit ran)."""
        code, details = None, ""
        try:
            resp = self._step_once([0], self._actions(1))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        if code is None:
            self._decode_step(resp, [0], None)
            return "served (env 0 was started by the server, or reset before this check)"
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            raise ServerClosed(details)
        _require(
            code == grpc.StatusCode.INVALID_ARGUMENT and "env_ids" in details,
            f"Step of env 0 before any Reset: refuse it with INVALID_ARGUMENT naming 'env_ids', or serve it; "
            f"{_got(code, details)} ({env_contract.section('step')})",
        )
        return "refused with INVALID_ARGUMENT naming env_ids (never reset)"

    def check_reset_shapes(self) -> str:
        obs, instr = self._reset()
        self._bounds_ok(obs, "ResetResponse.observations")
        one, _ = self._reset([self.n - 1])
        self._bounds_ok(one, "ResetResponse.observations")
        return f"all {self.n} envs and a subset of 1; {len(instr)} instructions"

    def check_seeded_reset_determinism(self) -> str:
        a, ia = self._reset([0], [4242])
        b, ib = self._reset([0], [4242])
        for k in a:
            _require(
                np.array_equal(a[k], b[k]),
                f"Reset of env 0 with seed 4242 twice gave different "
                f"observations[{k!r}]: a seed must fix the initial state",
            )
        _require(ia == ib, "Reset with the same seed gave different instructions")
        if self.n >= 2:
            c, _ = self._reset([0, self.n - 1], [777, 777])
            for k in c:
                _require(
                    np.array_equal(c[k][0], c[k][1]),
                    f"envs 0 and {self.n - 1} reset with the same seed "
                    f"start differently (observations[{k!r}]); GRPO groups rely on equal starts",
                )
        d, _ = self._reset([0], [4243])
        note = (
            ""
            if any(not np.array_equal(a[k], d[k]) for k in a)
            else " (note: seeds 4242 and 4243 give the same start; fine if the task has one initial state)"
        )
        return "same seed, same start" + note

    def check_reset_order(self) -> str:
        if self.n < 2:
            return "skip: needs 2 envs"
        last = self.n - 1
        a, _ = self._reset([0], [11])
        b, _ = self._reset([last], [22])
        both, _ = self._reset([last, 0], [22, 11])
        for k in a:
            _require(
                np.array_equal(both[k][0], b[k][0]) and np.array_equal(both[k][1], a[k][0]),
                f"Reset(env_ids=[{last}, 0]): rows of observations[{k!r}] do not follow the order of env_ids",
            )
        return "rows follow env_ids"

    def check_instructions(self) -> str:
        """Describe's task_descriptions are each env's current instruction: after a Reset, the new episodes'."""
        if self.v0:
            return "skip: version 0 has no instructions in Reset/Step responses (Describe's task_descriptions only)"
        _, instr = self._reset()
        described = list(self._describe().task_descriptions)
        if not instr:
            _require(
                not any(described),
                f"Reset sent no instructions, but Describe.task_descriptions is "
                f"{described[:3]}...: a server without instructions sends none (or '') in both "
                f"({env_contract.section('instructions')})",
            )
            return "no instructions (none in Reset, none or '' in Describe)"
        _require(
            described == instr,
            f"after Reset, Describe.task_descriptions {described[:2]}... differ from the "
            f"instructions Reset returned {instr[:2]}...: task_descriptions are each env's current instruction "
            f"({env_contract.section('instructions')})",
        )
        self._decode_step(self._step_once([], self._actions(self.n)), [], None)
        described = list(self._describe().task_descriptions)
        now = [self.instructions[i] for i in range(self.n)]
        _require(
            described == now,
            f"after a Step, Describe.task_descriptions {described[:2]}... differ from each "
            f"env's current instruction {now[:2]}... ({env_contract.section('instructions')})",
        )
        more = " ..." if len(set(instr)) > 1 else ""
        return f"Describe's task_descriptions follow Reset and Step: {instr[0]!r}{more}"

    def check_step_shapes(self) -> str:
        self._reset()
        stream = self._stream()
        try:
            for _ in range(3):
                self._decode_step(stream.step([], self._actions(self.n)), [], None)
        finally:
            stream.close()
        return f"3 steps of all {self.n} envs (empty env_ids)"

    def check_subset_step(self) -> str:
        self._reset()
        ids = [self.n - 1, 0] if self.n >= 2 else [0]
        stream = self._stream()
        try:
            self._decode_step(stream.step(ids, self._actions(len(ids))), ids, None)
            self._decode_step(stream.step(ids[:1], self._actions(1)), ids[:1], None)
        finally:
            stream.close()
        if self.n < 2:
            return f"env_ids {ids} then {ids[:1]}"
        # envs not named in a request do not move: env 1's step gives the same result whether env 0 stepped before
        a = [self._actions(1) for _ in range(2)]
        ref = [self._deterministic_step(1, 31, a) for _ in range(2)]
        if any(not np.allclose(ref[0][k], ref[1][k], atol=1e-5) for k in ref[0]):
            return (
                f"env_ids {ids} then {ids[:1]} (the dynamics are not deterministic: that unnamed envs stay put "
                f"was not checked)"
            )
        self._reset([1], [31])
        stream = self._stream()
        try:
            for _ in range(3):
                self._decode_step(stream.step([0], self._actions(1)), [0], None)
            for x in a:
                moved = self._decode_step(stream.step([1], x), [1], None)["obs"]
        finally:
            stream.close()
        for k in moved:
            _require(
                np.allclose(moved[k], ref[0][k], atol=1e-5),
                f"env 1 moved while only env 0 was stepped "
                f"(observations[{k!r}]): envs not named in a request do not move "
                f"({env_contract.section('step')})",
            )
        return f"env_ids {ids} then {ids[:1]}; envs not named stay put"

    def check_episode_end(self) -> str:
        T = int(self.spec.max_episode_steps)
        if T + 1 > self.max_steps:
            return f"skip: max_episode_steps {T} is over --max-steps {self.max_steps}"
        self._reset()
        ids = list(range(self.n))
        first: dict[int, dict] = {}
        ret, hit = np.zeros(self.n), np.zeros(self.n, bool)
        stream = self._stream()
        try:
            for t in range(T + 1):
                frozen = [] if self.spec.auto_reset else [r for r, i in enumerate(ids) if i in first]
                out = self._decode_step(stream.step(ids, self._actions(self.n)), ids, None, frozen=frozen)
                ret += np.where([i not in first for i in ids], out["rewards"], 0.0)
                hit |= out["success"] & np.array([i not in first for i in ids])
                by_env = {e.env_id: e for e in out["episodes"]}
                for row in out["final_rows"]:
                    i = ids[row]
                    if i not in first:
                        first[i] = {
                            "t": t + 1,
                            "episode": by_env.get(i),
                            "ret": float(ret[i]),
                            "hit": bool(hit[i]),
                            "succ_end": bool(out["success"][row]),
                            "instruction": out["instructions_before"][row],
                        }
                if len(first) == self.n:
                    break
            missing = [i for i in ids if i not in first]
            _require(
                not missing,
                f"envs {missing} did not end an episode within max_episode_steps={T} steps "
                f"(the server must truncate at max_episode_steps)",
            )
            for i, e in first.items():
                ep = e["episode"]
                _require(ep is not None, f"env {i}: no EpisodeStats for its ended episode")
                _require(ep.env_id == i, f"EpisodeStats.env_id is {ep.env_id} for a row of env {i}")
                _require(
                    1 <= ep.length <= T and ep.length == e["t"],
                    f"env {i}: EpisodeStats.length {ep.length} after {e['t']} control steps (max {T})",
                )
                _require(
                    abs(codec.episode_return(ep) - e["ret"]) <= 1e-3 * max(1.0, abs(e["ret"])),
                    f"env {i}: EpisodeStats.return {codec.episode_return(ep):.6g} is not the sum of the "
                    f"episode's rewards {e['ret']:.6g}",
                )
                _require(
                    ep.success_once == e["hit"] and ep.success_at_end == e["succ_end"],
                    f"env {i}: EpisodeStats success_once={ep.success_once} success_at_end={ep.success_at_end}; "
                    f"the episode's success cells say {e['hit']} / {e['succ_end']}",
                )
                if not self.v0:
                    m = self.view.num_reset_states
                    _require(
                        ep.reset_state_id == -1 if m == 0 else -1 <= ep.reset_state_id < m,
                        f"env {i}: EpisodeStats.reset_state_id {ep.reset_state_id} of an episode reset without a "
                        f"state id (-1, or the fixed state the server drew, in [0, {m})) "
                        f"({env_contract.section('final')})",
                    )
                    _require(
                        not ep.instruction or ep.instruction == e["instruction"],
                        f"env {i}: EpisodeStats.instruction {ep.instruction!r}; the episode's instruction was "
                        f"{e['instruction']!r}",
                    )
            note = "auto-reset"
            if not self.spec.auto_reset:  # finished envs stay frozen until reset
                last = {k: v.copy() for k, v in out["obs"].items()}
                frozen_rows = [r for r, i in enumerate(ids) if i in first]
                again = self._decode_step(stream.step(ids, self._actions(self.n)), ids, None, frozen=frozen_rows)
                f = frozen_rows
                _require(
                    again["terminated"][f].all()
                    and not again["truncated"][f].any()
                    and not again["success"][f].any()
                    and not again["rewards"][f].any()
                    and not again["final_rows"]
                    and not again["episodes"],
                    "auto_reset is off: stepping a finished env must answer terminated=true, truncated=false, "
                    "success=false, reward 0, and no final row or EpisodeStats until it is reset "
                    f"({env_contract.section('final')})",
                )
                for k in last:
                    _require(
                        np.array_equal(again["obs"][k][f], last[k][f]),
                        f"auto_reset is off: a finished env "
                        f"must answer its last observation (observations[{k!r}] changed)",
                    )
                note = "frozen until reset (auto_reset off)"
        finally:
            stream.close()
        self._reset()
        lengths = sorted({e["episode"].length for e in first.values()})
        return f"every env ended by step {max(e['t'] for e in first.values())}; lengths {lengths[:5]}; {note}"

    def check_chunks(self) -> str:
        if self.v0:
            return "skip: version 0 has no action chunks"
        k = self.view.max_action_chunk
        self._reset()
        stream = self._stream()
        try:
            try:  # a chunk of 1: per-step fields are [n, 1], not [n]
                self._decode_step(stream.step([], self._actions(self.n, chunk=1)), [], 1)
            except ContractError as exc:
                raise ContractError(
                    f"a chunk of 1 ([n, 1, *action_shape]) answers per-step fields [n, 1]: {exc}"
                ) from None
            # a chunk length that does not divide the episode limit, so an episode ends inside a chunk
            c = next((x for x in range(min(k, 4), 1, -1) if int(self.spec.max_episode_steps) % x), min(k, 4))
            if k >= 2:
                self._decode_step(stream.step([], self._actions(self.n, chunk=c)), [], c)
        finally:
            stream.close()
        what = self._expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            "actions",  # one row: the refusal is per request
            lambda: self._step_once([0], self._actions(1, chunk=k + 1)),
        )
        _require(
            what is None,
            f"a chunk of {k + 1} sub-steps (max_action_chunk={k}): {what} ({env_contract.section('errors')})",
        )
        note = ""
        T = int(self.spec.max_episode_steps)
        if k >= 2 and T + 1 <= self.max_steps:  # max_episode_steps counts control steps, not Step rows
            self._reset([0])
            stream = self._stream()
            try:
                steps, ep = self._episode_to_end(0, stream, chunk=c)
            finally:
                stream.close()
            _require(
                steps <= T and (ep is None or ep.length == steps),
                f"with chunks of {c}, env 0's episode ran {steps} control steps (EpisodeStats.length "
                f"{ep.length if ep else '?'}); max_episode_steps={T} counts control steps, not Step rows "
                f"({env_contract.section('chunks')})",
            )
            note = f"; an episode in chunks of {c} ends within {T} control steps"
        self._reset()
        return f"chunk 1 ([n, 1] fields){' and ' + str(c) if k >= 2 else ''} accepted; {k + 1} refused" + note

    def check_reset_state_ids(self) -> str:
        if self.v0:
            return "skip: version 0 has no reset_state_ids"
        m = self.view.num_reset_states
        fails = []

        def expect(what: str, fn) -> None:
            bad = self._expect(grpc.StatusCode.INVALID_ARGUMENT, "reset_state_ids", fn)
            if bad:
                fails.append(f"{what}: {bad}")

        try:
            self._reset([0], states=[-1])
        except grpc.RpcError as exc:
            fails.append(f"reset_state_ids=[-1] (none) must be accepted, got {channels.describe_error(exc)}")
        expect("a state id below -1 ([-2])", lambda: self._reset([0], states=[-2]))
        expect("2 reset_state_ids for 1 env", lambda: self._reset([0], states=[-1, -1]))
        if m == 0:
            expect("num_reset_states is 0: reset_state_ids=[0]", lambda: self._reset([0], states=[0]))
            _require(not fails, "; ".join(fails) + f" ({env_contract.section('reset')})")
            return "no fixed initial states; [-1] accepted; 0, -2 and a count mismatch refused"
        expect(f"reset_state_ids=[{m}] (num_reset_states={m})", lambda: self._reset([0], states=[m]))
        ids = [0, self.n - 1] if self.n >= 2 else [0]
        a, ia = self._reset(ids, [1, 2][: len(ids)], [m - 1] * len(ids))
        b, ib = self._reset(ids, [3, 4][: len(ids)], [m - 1] * len(ids))
        for k in a:
            if not (np.array_equal(a[k][0], b[k][0]) and np.array_equal(a[k][0], a[k][-1])):
                fails.append(
                    f"reset_state_ids={m - 1}: observations[{k!r}] differ between envs or seeds; a fixed "
                    f"initial state gives the same start whatever the seed"
                )
                break
        # a state id and a seed together: the state fixes the start, the seed the later randomness
        acts = [self._actions(1) for _ in range(3)]
        runs = []
        for _ in range(2):
            self._reset([0], [5], [m - 1])
            stream = self._stream()
            try:
                runs.append([self._decode_step(stream.step([0], x), [0], None)["obs"] for x in acts])
            finally:
                stream.close()
        if any(not np.array_equal(r0[k], r1[k]) for r0, r1 in zip(*runs) for k in r0):
            fails.append(
                f"Reset with seed 5 and state {m - 1} twice, then the same actions: different observations "
                f"(a state id fixes the start, its seed the episode's later randomness)"
            )
        T = int(self.spec.max_episode_steps)
        if T + 1 <= self.max_steps:
            self._reset([0], [6], [m - 1])
            stream = self._stream()
            try:
                _, ep = self._episode_to_end(0, stream)
            finally:
                stream.close()
            if ep is not None and ep.reset_state_id != m - 1:
                fails.append(
                    f"an episode started from reset_state_ids=[{m - 1}] reports EpisodeStats.reset_state_id "
                    f"{ep.reset_state_id}"
                )
        self._reset()
        _require(not fails, "; ".join(fails) + f" ({env_contract.section('reset')})")
        return (
            f"{m} states; state {m - 1} gives one start, with a seed one episode, and is reported; "
            f"{m}, -2 and a count mismatch refused" + (f"; instruction {ia[0]!r}" if ia else "")
        )

    def check_bad_input(self) -> str:
        self._reset()
        fails, cases = [], []
        A = self.action.shape

        def expect(name: str, field: str, fn) -> None:
            cases.append(name)
            bad = self._expect(grpc.StatusCode.INVALID_ARGUMENT, field, fn)
            if bad:
                fails.append(f"{name}: {bad}")

        good = self._actions(1)
        f64 = codec.encode(good.astype(np.float64))
        short = codec.encode(good)
        short.data = short.data[:-1]
        nan, inf = good.copy(), good.copy()
        nan.flat[0], inf.flat[-1] = np.nan, np.inf
        # every bad request names env 0: afterwards env 0 must be where it was (a bad request loses nothing)
        acts = [self._actions(1) for _ in range(2)]
        ref = [self._deterministic_step(0, 57, acts) for _ in range(2)]
        deterministic = all(np.allclose(ref[0][k], ref[1][k], atol=1e-5) for k in ref[0])
        self._reset([0], [57])
        expect("unknown env id in Reset", "env_ids", lambda: self._reset([self.n + 5]))
        if self.n >= 2:
            expect("duplicate env ids in Reset", "env_ids", lambda: self._reset([1, 1]))
        expect("seeds count differs from env_ids", "seeds", lambda: self._reset([0], [1, 2]))
        expect("unknown env id in Step", "env_ids", lambda: self._step_once([self.n + 5], good))
        expect("duplicate env ids in Step", "env_ids", lambda: self._step_once([0, 0], self._actions(2)))
        expect(
            "wrong action shape",
            "actions",
            lambda: self._step_once([0], np.zeros((1, self.action.size + 1), np.float32)),
        )
        expect("actions of another row count", "actions", lambda: self._step_once([0], self._actions(2)))
        expect("FLOAT64 actions", "actions", lambda: self._step_once([0], f64))
        expect("action bytes that do not match the shape", "actions", lambda: self._step_once([0], short))
        expect("NaN action", "actions", lambda: self._step_once([0], nan))
        expect("inf action", "actions", lambda: self._step_once([0], inf))
        stream = self._stream()  # the server still serves, and env 0 kept its state
        try:
            for x in acts:
                after = self._decode_step(stream.step([0], x), [0], None)["obs"]
        finally:
            stream.close()
        if deterministic:
            for k in after:
                if not np.allclose(after[k], ref[0][k], atol=1e-5):
                    fails.append(
                        f"after the refused requests env 0 is not where it was (observations[{k!r}]): a bad "
                        f"request must change nothing"
                    )
                    break
        _require(not fails, "; ".join(fails) + f" ({env_contract.section('errors')}; shape {list(A)})")
        return (
            f"{len(cases)} bad requests refused naming the field; "
            + ("nothing moved; " if deterministic else "")
            + "the server still serves"
        )

    def check_out_of_bounds_actions(self) -> str:
        if not self.action.bounded:
            return "skip: the action space is unbounded"
        big = np.where(self.action.high > 0, self.action.high * 10 + 1, 1.0).astype(np.float32)[None]
        clipped = np.clip(big, self.action.low, self.action.high).astype(np.float32)
        results = []
        for actions in (big, clipped):
            self._reset([0], [99])
            results.append(self._decode_step(self._step_once([0], actions), [0], None))
        for k in results[0]["obs"]:
            _require(
                np.allclose(results[0]["obs"][k], results[1]["obs"][k], atol=1e-5),
                f"an action above the bounds gave a different observations[{k!r}] than the same action clipped "
                f"to the bounds: the server must clip actions to action_space",
            )
        _require(
            np.isclose(results[0]["rewards"], results[1]["rewards"]).all(),
            "an action above the bounds gave a different reward than the clipped action",
        )
        self._reset()
        return "clipped to the bounds (same result as the clipped action)"

    def check_stream_limit(self) -> str:
        cap = self.view.max_step_streams
        if cap > 32:
            return f"skip: max_step_streams {cap} is more than this check opens"
        self._reset()
        streams = [self._stream() for _ in range(cap)]
        try:
            for s in streams:
                self._decode_step(s.step([0], self._actions(1)), [0], None)  # each stream is live on the server
            if not self.view.streams_stated:
                return "max_step_streams not stated (0): one stream served; no refusal of more is promised"
            extra = self._stream(timeout=REFUSAL_WAIT_S)
            t0 = time.monotonic()
            code, details = _code_of(lambda: extra.step([0], self._actions(1)))
            waited = time.monotonic() - t0
            extra.close()
        finally:
            for s in streams:
                s.close()
        _require(
            code == grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"stream {cap + 1} (max_step_streams={cap}) must fail at once (at its opening or first request) with "
            f"RESOURCE_EXHAUSTED; {_got(code, details)}"
            + (f" after {waited:.1f}s" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "")
            + f" ({env_contract.section('streams')})",
        )
        return f"{cap} concurrent streams served, one more refused in {waited:.2f}s"

    def check_abandoned_stream(self) -> str:
        cap = self.view.max_step_streams
        self._reset()
        for k in range(cap + 2):  # cancelled streams must give their slot back
            s = self._stream()
            try:
                s.step([0], self._actions(1))
            except grpc.RpcError as exc:
                raise ContractError(
                    f"stream {k + 1} was refused while no other stream of this kit was open "
                    f"({channels.describe_error(exc)}): an abandoned or closed stream must free its slot "
                    f"({env_contract.section('streams')})"
                ) from None
            s.cancel()
        deadline = time.monotonic() + 10.0
        while True:
            s = self._stream()
            try:
                self._decode_step(s.step([0], self._actions(1)), [0], None)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise ContractError(
                        f"after {cap + 2} abandoned Step streams a new stream failed: "
                        f"{channels.describe_error(exc)} (an abandoned stream must free its slot)"
                    ) from None
                time.sleep(0.2)
            finally:
                s.close()
        return f"{cap + 2} streams cancelled mid-episode; a new one is served"

    def check_simulator_crash(self) -> str:
        """A simulator failure is INTERNAL naming what failed, and the server goes on: Describe answers (same
        incarnation), Reset starts fresh episodes, Step serves. Exercised through the optional fault request."""
        self._reset()
        code, details = None, ""
        try:
            self._step_once([0], self._actions(1), metadata=[env_contract.FAULT_METADATA])
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        if code is None:
            key, value = env_contract.FAULT_METADATA
            return (
                f"skip: the server does not fail on request (metadata {key}: {value}, optional), so INTERNAL "
                f"on a simulator crash was not exercised"
            )
        _require(
            code == grpc.StatusCode.INTERNAL and details.strip(),
            f"a simulator failure must be answered INTERNAL with a message saying what failed; "
            f"{_got(code, details)}"
            + (" (UNKNOWN is what an uncaught exception gives)" if code == grpc.StatusCode.UNKNOWN else "")
            + f" ({env_contract.section('errors')})",
        )
        spec = self._describe()
        _require(
            spec.incarnation == self.spec.incarnation,
            "after INTERNAL the server restarted (a new "
            "incarnation): a simulator failure must not take the server down",
        )
        try:
            self._reset()
            self._decode_step(self._step_once([], self._actions(self.n)), [], None)
        except grpc.RpcError as exc:
            raise ContractError(
                f"after INTERNAL, Reset of every env and a Step must work; got "
                f"{channels.describe_error(exc)} ({env_contract.section('errors')})"
            ) from None
        return f"INTERNAL {details[:60]!r}; the server went on (Reset, Step)"

    def check_close(self) -> str:
        if not self.include_close:
            return "skip: Close ends the server's envs; pass --close to check it (last)"
        self.env.close(env_pb2.CloseRequest(), timeout=self.timeout)
        fails = []
        for what, fn in (("Reset", lambda: self._reset([0])), ("Step", lambda: self._step_once([0], self._actions(1)))):
            bad = self._expect(grpc.StatusCode.FAILED_PRECONDITION, None, fn)
            if bad:
                fails.append(f"{what} after Close: {bad}")
        try:
            self._describe()
        except grpc.RpcError as exc:
            fails.append(f"Describe after Close must still answer; got {channels.describe_error(exc)}")
        _require(not fails, "; ".join(fails) + f" ({env_contract.section('close')})")
        return "Reset and Step after Close refused with FAILED_PRECONDITION; Describe answers"

    # --- driver -----------------------------------------------------------------------------------------------
    def _closed(self) -> str | None:
        """The server's answer when it was closed (Reset is FAILED_PRECONDITION), else None."""
        code, details = _code_of(lambda: self._reset())
        return (details or "FAILED_PRECONDITION") if code == grpc.StatusCode.FAILED_PRECONDITION else None

    def run(self, only=None, log: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
        """Run the checks (all, or ``only`` those plus describe). Raises ServerClosed when the server was closed
        before the checks began."""
        results = []
        names = [n for n in self.NAMES if not only or n in only or n == "describe"]
        for name in names:
            t0 = time.perf_counter()
            if name != "describe" and self.unusable:
                status, detail = SKIP, f"needs the spaces of Describe: {self.unusable}"
            else:
                try:
                    note = getattr(self, f"check_{name}")()
                    status, detail = (SKIP, note[5:].strip()) if note.startswith("skip:") else (PASS, note)
                except ContractError as exc:
                    status, detail = FAIL, str(exc)
                except (ServerClosed, grpc.RpcError) as exc:
                    closed = str(exc) if isinstance(exc, ServerClosed) else None
                    if closed is None and exc.code() == grpc.StatusCode.FAILED_PRECONDITION and name != "close":
                        closed = self._closed()
                    if closed is not None and not any(r.status == PASS and r.name != "describe" for r in results):
                        raise ServerClosed(closed) from None
                    status, detail = (
                        FAIL,
                        (
                            f"the server was closed during the checks: {closed}"
                            if closed
                            else f"unexpected error: {channels.describe_error(exc)}"
                        ),
                    )
            result = CheckResult(name, status, detail, time.perf_counter() - t0)
            results.append(result)
            if log:
                log(result)
        return results


def check_env(
    address: str, *, only=None, close: bool = False, timeout: float = 60.0, max_steps: int = 2000, log=None
) -> list[CheckResult]:
    """Run the checks against ``address``. Raises TimeoutError / grpc.RpcError when it cannot be described,
    ServerClosed when it was closed."""
    unknown = sorted(set(only or ()) - set(Checker.NAMES))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are {list(Checker.NAMES)}")
    checker = Checker(address, timeout, max_steps)
    checker.include_close = close
    try:
        return checker.run(only, log)
    finally:
        checker.channel.close()


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="coordinatorctl check-env", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("address", help="HOST:PORT of the EnvService to check")
    ap.add_argument("--only", nargs="+", metavar="CHECK", help=f"run only these checks ({', '.join(Checker.NAMES)})")
    ap.add_argument("--close", action="store_true", help="also check Close (ends the server's envs; runs last)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server and for each call")
    ap.add_argument("--max-steps", type=int, default=2000, help="longest episode the episode checks step through")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)

    def say(r: CheckResult) -> None:
        if not args.json:
            print(f"  {r.status}  {r.name:<26} {r.seconds:6.2f}s  {r.detail}", flush=True)

    if not args.json:
        print(
            f"checking {args.address} against the env contract ({env_contract.DOC}; this kit knows versions "
            f"{', '.join(env_contract.KNOWN_VERSIONS)})",
            flush=True,
        )
    try:
        results = check_env(
            args.address, only=args.only, close=args.close, timeout=args.timeout, max_steps=args.max_steps, log=say
        )
    except (ValueError, TimeoutError) as exc:
        print(f"check-env: {exc}")
        return 2
    except ServerClosed as exc:
        print(
            f"check-env: the server at {args.address} was closed (Close): Reset answers FAILED_PRECONDITION "
            f"({exc}); restart it to check it"
        )
        return 2
    except grpc.RpcError as exc:
        print(f"check-env: {args.address} did not answer Describe: {channels.describe_error(exc)}")
        return 2
    failed = [r for r in results if r.status == FAIL]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        passed = sum(r.status == PASS for r in results)
        skipped = sum(r.status == SKIP for r in results)
        print(
            f"{passed} passed, {len(failed)} failed, {skipped} skipped"
            + (f": {', '.join(r.name for r in failed)}" if failed else "")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
