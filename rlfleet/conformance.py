"""Env contract conformance kit: checks a running EnvService against contract v1 (docs/env-contract.md).

    coordinatorctl check-env HOST:PORT [--only NAME ...] [--close] [--json]

Each check drives the server over gRPC exactly as rlfleet does and reports PASS, FAIL (with what was wrong and
what the contract says) or SKIP (the server does not offer that feature). It resets and steps the envs, so point
it at a standalone simulator server, not at one a run is using. Exit code: 0 all passed, 1 a check failed,
2 the server could not be reached or described.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc
import numpy as np

from rlfleet import codec, rpc
from rlfleet.spaces import TensorSpace, spaces_from_proto
from rlfleet.v1 import env_pb2, env_pb2_grpc

CONTRACT_VERSION = "1"
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class ContractError(AssertionError):
    """A server broke the contract; the message says how."""


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str
    seconds: float


class StepStream:
    """One Step stream: send a request, read its response (in order, as the contract requires)."""

    _END = object()

    def __init__(self, stub, timeout: float):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Step(iter(self._requests.get, self._END), timeout=timeout)

    def step(self, env_ids, actions: np.ndarray) -> env_pb2.StepResponse:
        self._requests.put(env_pb2.StepRequest(env_ids=[int(i) for i in env_ids], actions=codec.encode(actions)))
        return next(self._call)

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(self._END)
        self._call.cancel()


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ContractError(message)


def _code_of(fn: Callable[[], object]) -> tuple[grpc.StatusCode | None, str]:
    """Run a call that is expected to fail; -> (status code, details) or (None, '') when it succeeded."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return None, ""


class Checker:
    """The checks, in order. Each method ``check_<name>`` raises ContractError (FAIL) or returns a note; a
    returned string starting with 'skip:' is a SKIP."""

    NAMES = ("describe", "reset_shapes", "seeded_reset_determinism", "reset_order", "step_shapes", "subset_step",
             "episode_end", "chunks", "reset_state_ids", "bad_input", "out_of_bounds_actions", "stream_limit",
             "abandoned_stream", "close")

    def __init__(self, address: str, timeout: float = 60.0, max_steps: int = 2000, seed: int = 1234):
        self.address, self.timeout, self.max_steps = address, timeout, max_steps
        self.rng = np.random.default_rng(seed)
        self.channel = rpc.wait_ready(address, timeout, credential=False)
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)
        self.spec = self.stub.Describe(env_pb2.DescribeEnvRequest(), timeout=timeout)
        self.n = int(self.spec.num_envs)
        self.obs_specs = dict(self.spec.observation_space)
        self.obs_spaces: dict[str, TensorSpace] = {}
        self.action: TensorSpace | None = None
        self.include_close = False

    # --- helpers ----------------------------------------------------------------------------------------------
    def _reset(self, env_ids=(), seeds=(), states=()) -> tuple[dict[str, np.ndarray], list[str]]:
        resp = self.stub.Reset(env_pb2.ResetRequest(env_ids=list(env_ids), seeds=list(seeds),
                                                    reset_state_ids=list(states)), timeout=self.timeout)
        n = len(env_ids) or self.n
        try:
            obs = codec.decode_map(resp.observations, "ResetResponse.observations", specs=self.obs_specs, batch=n)
        except codec.CodecError as exc:
            raise ContractError(str(exc)) from None
        _require(len(resp.instructions) in (0, n),
                 f"ResetResponse.instructions: {len(resp.instructions)} strings for {n} reset envs")
        return obs, list(resp.instructions)

    def _actions(self, n: int, chunk: int | None = None, scale: float = 1.0) -> np.ndarray:
        low, high = self.action.low, self.action.high
        low = np.where(np.isfinite(low), low, -1.0)
        high = np.where(np.isfinite(high), high, 1.0)
        shape = (n, *self.action.shape) if chunk is None else (n, chunk, *self.action.shape)
        a = self.rng.uniform(low, high, size=shape) * scale
        return a.astype(np.float32)

    def _decode_step(self, resp, n: int, chunk: int | None) -> dict:
        per = [n] if chunk is None else [n, chunk]
        try:
            out = {
                "obs": codec.decode_map(resp.observations, "StepResponse.observations", specs=self.obs_specs, batch=n),
                "rewards": codec.decode(resp.rewards, "StepResponse.rewards", shape=per, dtype=np.float32,
                                        finite=True),
                "terminated": codec.decode(resp.terminated, "StepResponse.terminated", shape=per, dtype=bool),
                "truncated": codec.decode(resp.truncated, "StepResponse.truncated", shape=per, dtype=bool),
                "success": codec.decode(resp.success, "StepResponse.success", shape=per, dtype=bool),
            }
            rows = [int(r) for r in resp.final_rows]
            out["final_rows"] = rows
            out["final_obs"] = codec.decode_map(resp.final_observations, "StepResponse.final_observations",
                                                specs=self.obs_specs, batch=len(rows))
        except codec.CodecError as exc:
            raise ContractError(str(exc)) from None
        term, trunc = out["terminated"], out["truncated"]
        _require(not (term & trunc).any(), "StepResponse: terminated and truncated both true in one cell "
                 "(terminated wins; truncated must then be false)")
        _require(all(0 <= r < n for r in rows) and rows == sorted(set(rows)),
                 f"StepResponse.final_rows: {rows} must be distinct row positions in 0..{n - 1}, ascending")
        ended = (term | trunc).reshape(n, -1)
        for r in range(n):
            cells = np.flatnonzero(ended[r])
            if chunk is not None and cells.size:
                first = int(cells[0])
                later = slice(first + 1, None)
                _require(not out["rewards"][r, later].any() and not term[r, later].any()
                         and not trunc[r, later].any() and not out["success"][r, later].any(),
                         f"row {r}: its episode ended at sub-step {first}; the later sub-steps must not run "
                         f"(reward 0, flags false)")
        _require(len(resp.episodes) == len(rows),
                 f"StepResponse: {len(resp.episodes)} EpisodeStats for {len(rows)} final_rows (one per ended row)")
        _require(len(resp.instructions) in (0, n), f"StepResponse.instructions: {len(resp.instructions)} for {n} rows")
        out["episodes"] = list(resp.episodes)
        return out

    def _bounds_ok(self, obs: dict[str, np.ndarray], what: str) -> None:
        for k, v in obs.items():
            space = self.obs_spaces[k]
            if v.dtype.kind == "f":
                _require(np.isfinite(v).all(), f"{what}[{k!r}]: non-finite values")
            if not space.contains(v, atol=1e-4):
                flat = np.asarray(v, np.float64).reshape(len(v), -1)
                lo, hi = space.low.ravel(), space.high.ravel()
                out = np.flatnonzero(((flat < lo - 1e-4) | (flat > hi + 1e-4)).any(0))
                e = int(out[0])
                raise ContractError(f"{what}[{k!r}]: element {e} (flat index; {len(out)} element(s) in all) is "
                                    f"outside its declared bounds [{lo[e]:.4g}, {hi[e]:.4g}]: values "
                                    f"{flat[:, e].min():.4g}..{flat[:, e].max():.4g}")

    def _stream(self) -> StepStream:
        return StepStream(self.stub, self.timeout)

    def _steps_to_end(self, env_ids: list[int], stream: StepStream) -> dict[int, dict]:
        """Step ``env_ids`` with random in-bounds actions until each has ended an episode once (or max steps)."""
        limit = min(self.max_steps, int(self.spec.max_episode_steps or self.max_steps) + 1)
        first_end: dict[int, dict] = {}
        for t in range(limit):
            resp = stream.step(env_ids, self._actions(len(env_ids)))
            out = self._decode_step(resp, len(env_ids), None)
            for row, ep in zip(out["final_rows"], out["episodes"]):
                first_end.setdefault(env_ids[row], {"t": t + 1, "episode": ep})
            if len(first_end) == len(env_ids):
                break
        return first_end

    # --- checks -----------------------------------------------------------------------------------------------
    def check_describe(self) -> str:
        s = self.spec
        _require(s.contract_version == CONTRACT_VERSION,
                 f"EnvSpec.contract_version is {s.contract_version!r}; this kit checks contract {CONTRACT_VERSION!r}")
        _require(self.n >= 1, f"EnvSpec.num_envs is {self.n}; a server hosts at least one env")
        _require(s.max_episode_steps >= 1, f"EnvSpec.max_episode_steps is {s.max_episode_steps}; must be >= 1")
        _require(len(self.obs_specs) >= 1, "EnvSpec.observation_space is empty")
        try:
            self.obs_spaces = spaces_from_proto(self.obs_specs)
            self.action = TensorSpace.from_proto(s.action_space)
        except (ValueError, KeyError) as exc:
            raise ContractError(f"EnvSpec: bad space: {exc}") from None
        _require(self.action.dtype == np.float32, f"EnvSpec.action_space.dtype is {self.action.dtype}; the contract "
                 f"sends FLOAT32 actions")
        _require(len(self.action.shape) >= 1, "EnvSpec.action_space.shape is empty")
        _require(bool((self.action.low <= self.action.high).all()), "EnvSpec.action_space: low > high somewhere")
        _require(len(s.task_descriptions) in (0, self.n),
                 f"EnvSpec.task_descriptions: {len(s.task_descriptions)} strings for {self.n} envs")
        _require(s.max_action_chunk >= 1, f"EnvSpec.max_action_chunk is {s.max_action_chunk}; must be >= 1")
        _require(s.num_reset_states >= 0, f"EnvSpec.num_reset_states is {s.num_reset_states}")
        _require(s.max_step_streams >= 1, f"EnvSpec.max_step_streams is {s.max_step_streams}; must be >= 1")
        again = self.stub.Describe(env_pb2.DescribeEnvRequest(), timeout=self.timeout)
        _require(again.incarnation == s.incarnation, "EnvSpec.incarnation changed between two Describe calls "
                 "(it may only change when the server restarts)")
        return (f"{s.simulator or '?'}:{s.env_id}, {self.n} envs, action {list(self.action.shape)}, obs "
                f"{ {k: list(v.shape) for k, v in self.obs_spaces.items()} }, chunk <= {s.max_action_chunk}, "
                f"{s.num_reset_states} reset states, auto_reset={s.auto_reset}")

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
            _require(np.array_equal(a[k], b[k]), f"Reset of env 0 with seed 4242 twice gave different "
                     f"observations[{k!r}]: a seed must fix the initial state")
        _require(ia == ib, "Reset with the same seed gave different instructions")
        if self.n >= 2:
            c, _ = self._reset([0, self.n - 1], [777, 777])
            for k in c:
                _require(np.array_equal(c[k][0], c[k][1]), f"envs 0 and {self.n - 1} reset with the same seed "
                         f"start differently (observations[{k!r}]); GRPO groups rely on equal starts")
        d, _ = self._reset([0], [4243])
        note = "" if any(not np.array_equal(a[k], d[k]) for k in a) else \
            " (note: seeds 4242 and 4243 give the same start; fine if the task has one initial state)"
        return "same seed, same start" + note

    def check_reset_order(self) -> str:
        if self.n < 2:
            return "skip: needs 2 envs"
        last = self.n - 1
        a, _ = self._reset([0], [11])
        b, _ = self._reset([last], [22])
        both, _ = self._reset([last, 0], [22, 11])
        for k in a:
            _require(np.array_equal(both[k][0], b[k][0]) and np.array_equal(both[k][1], a[k][0]),
                     f"Reset(env_ids=[{last}, 0]): rows of observations[{k!r}] do not follow the order of env_ids")
        return "rows follow env_ids"

    def check_step_shapes(self) -> str:
        self._reset()
        stream = self._stream()
        try:
            for _ in range(3):
                out = self._decode_step(stream.step([], self._actions(self.n)), self.n, None)
                self._bounds_ok(out["obs"], "StepResponse.observations")
        finally:
            stream.close()
        return f"3 steps of all {self.n} envs (empty env_ids)"

    def check_subset_step(self) -> str:
        self._reset()
        ids = [self.n - 1, 0] if self.n >= 2 else [0]
        stream = self._stream()
        try:
            self._decode_step(stream.step(ids, self._actions(len(ids))), len(ids), None)
            self._decode_step(stream.step(ids[:1], self._actions(1)), 1, None)
        finally:
            stream.close()
        return f"env_ids {ids} then {ids[:1]}"

    def check_episode_end(self) -> str:
        T = int(self.spec.max_episode_steps)
        if T + 1 > self.max_steps:
            return f"skip: max_episode_steps {T} is over --max-steps {self.max_steps}"
        self._reset()
        ids = list(range(self.n))
        stream = self._stream()
        try:
            ends = self._steps_to_end(ids, stream)
            missing = [i for i in ids if i not in ends]
            _require(not missing, f"envs {missing} did not end an episode within max_episode_steps={T} steps "
                     f"(the server must truncate at max_episode_steps)")
            for i, e in ends.items():
                ep = e["episode"]
                _require(ep.env_id == i, f"EpisodeStats.env_id is {ep.env_id} for a row of env {i}")
                _require(1 <= ep.length <= T and ep.length == e["t"],
                         f"env {i}: EpisodeStats.length {ep.length} after {e['t']} steps (max {T})")
            note = "auto-reset"
            if not self.spec.auto_reset:  # finished envs stay frozen until reset
                out = self._decode_step(stream.step(ids, self._actions(self.n)), self.n, None)
                frozen = [i for i in ids if i in ends]
                _require(out["terminated"][frozen].all() and not out["rewards"][frozen].any()
                         and not out["final_rows"],
                         "auto_reset is off: stepping a finished env must answer terminated=true, reward 0, and "
                         "no new final row until it is reset")
                note = "frozen until reset (auto_reset off)"
        finally:
            stream.close()
        self._reset()
        lengths = sorted({e["episode"].length for e in ends.values()})
        return f"every env ended by step {max(e['t'] for e in ends.values())}; lengths {lengths[:5]}; {note}"

    def check_chunks(self) -> str:
        k = int(self.spec.max_action_chunk)
        self._reset()
        stream = self._stream()
        try:
            out = self._decode_step(stream.step([], self._actions(self.n, chunk=1)), self.n, 1)
            if k >= 2:
                c = min(k, 4)
                out = self._decode_step(stream.step([], self._actions(self.n, chunk=c)), self.n, c)
        finally:
            stream.close()
        stream = self._stream()
        try:
            code, details = _code_of(lambda: stream.step([], self._actions(self.n, chunk=k + 1)))
        finally:
            stream.close()
        _require(code == grpc.StatusCode.INVALID_ARGUMENT and "actions" in details,
                 f"a chunk of {k + 1} sub-steps (max_action_chunk={k}) must fail with INVALID_ARGUMENT naming "
                 f"'actions'; got {code.name if code else 'success'} {details!r}")
        self._reset()
        return f"chunk 1{' and ' + str(min(k, 4)) if k >= 2 else ''} accepted; {k + 1} refused"

    def check_reset_state_ids(self) -> str:
        m = int(self.spec.num_reset_states)
        if m == 0:
            code, details = _code_of(lambda: self._reset([0], states=[0]))
            _require(code == grpc.StatusCode.INVALID_ARGUMENT and "reset_state_ids" in details,
                     f"num_reset_states is 0: reset_state_ids=[0] must fail with INVALID_ARGUMENT naming "
                     f"'reset_state_ids'; got {code.name if code else 'success'} {details!r}")
            return "no fixed initial states; state id 0 refused"
        ids = [0, self.n - 1] if self.n >= 2 else [0]
        a, ia = self._reset(ids, [1, 2][:len(ids)], [m - 1] * len(ids))
        b, ib = self._reset(ids, [3, 4][:len(ids)], [m - 1] * len(ids))
        for k in a:
            _require(np.array_equal(a[k][0], b[k][0]) and np.array_equal(a[k][0], a[k][-1]),
                     f"reset_state_ids={m - 1}: observations[{k!r}] differ between envs or resets; a fixed initial "
                     f"state must give the same start")
        code, details = _code_of(lambda: self._reset([0], states=[m]))
        _require(code == grpc.StatusCode.INVALID_ARGUMENT and "reset_state_ids" in details,
                 f"reset_state_ids=[{m}] (num_reset_states={m}) must fail with INVALID_ARGUMENT naming "
                 f"'reset_state_ids'; got {code.name if code else 'success'} {details!r}")
        self._reset()
        return f"{m} states; state {m - 1} gives one start; {m} refused" + (f"; instruction {ia[0]!r}" if ia else "")

    def check_bad_input(self) -> str:
        self._reset()
        cases = []

        def expect(name: str, field: str, fn) -> None:
            code, details = _code_of(fn)
            _require(code == grpc.StatusCode.INVALID_ARGUMENT and field in details,
                     f"{name}: expected INVALID_ARGUMENT naming {field!r}, got "
                     f"{code.name if code else 'success'} {details!r}")
            cases.append(name)

        def step_once(ids, actions):
            stream = self._stream()
            try:
                return stream.step(ids, actions)
            finally:
                stream.close()

        expect("unknown env id in Reset", "env_ids", lambda: self._reset([self.n + 5]))
        expect("seeds count mismatch", "seeds", lambda: self._reset([0], [1, 2]))
        expect("unknown env id in Step", "env_ids", lambda: step_once([self.n + 5], self._actions(1)))
        wrong = np.zeros((1, self.action.size + 1), np.float32)
        expect("wrong action shape", "actions", lambda: step_once([0], wrong))
        nan = self._actions(1)
        nan.flat[0] = np.nan
        expect("NaN action", "actions", lambda: step_once([0], nan))
        self._reset()  # and nothing was lost: the server still works
        self._decode_step(step_once([0], self._actions(1)), 1, None)
        return ", ".join(cases) + "; server still serves"

    def check_out_of_bounds_actions(self) -> str:
        if not self.action.bounded:
            return "skip: the action space is unbounded"
        big = np.where(self.action.high > 0, self.action.high * 10 + 1, 1.0).astype(np.float32)[None]
        clipped = np.clip(big, self.action.low, self.action.high).astype(np.float32)
        results = []
        for actions in (big, clipped):
            self._reset([0], [99])
            stream = self._stream()
            try:
                results.append(self._decode_step(stream.step([0], actions), 1, None))
            finally:
                stream.close()
        for k in results[0]["obs"]:
            _require(np.allclose(results[0]["obs"][k], results[1]["obs"][k], atol=1e-5),
                     f"an action above the bounds gave a different observations[{k!r}] than the same action clipped "
                     f"to the bounds: the server must clip actions to action_space")
        _require(np.isclose(results[0]["rewards"], results[1]["rewards"]).all(),
                 "an action above the bounds gave a different reward than the clipped action")
        self._reset()
        return "clipped to the bounds (same result as the clipped action)"

    def check_stream_limit(self) -> str:
        cap = int(self.spec.max_step_streams)
        if cap > 32:
            return f"skip: max_step_streams {cap} is more than this check opens"
        self._reset()
        streams = [self._stream() for _ in range(cap)]
        try:
            for s in streams:
                s.step([0], self._actions(1))  # each stream is live on the server
            extra = self._stream()
            code, details = _code_of(lambda: extra.step([0], self._actions(1)))
            extra.close()
        finally:
            for s in streams:
                s.close()
        _require(code == grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"stream {cap + 1} (max_step_streams={cap}) must fail with RESOURCE_EXHAUSTED; got "
                 f"{code.name if code else 'success'} {details!r}")
        return f"{cap} concurrent streams served, one more refused"

    def check_abandoned_stream(self) -> str:
        cap = int(self.spec.max_step_streams)
        self._reset()
        for _ in range(cap + 2):  # cancelled streams must give their slot back
            s = self._stream()
            s.step([0], self._actions(1))
            s.cancel()
        deadline = time.monotonic() + 10.0
        while True:
            s = self._stream()
            try:
                self._decode_step(s.step([0], self._actions(1)), 1, None)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise ContractError(f"after {cap + 2} abandoned Step streams a new stream failed: "
                                        f"{rpc.describe_error(exc)} (an abandoned stream must free its slot)") from None
                time.sleep(0.2)
            finally:
                s.close()
        return f"{cap + 2} streams cancelled mid-episode; a new one is served"

    def check_close(self) -> str:
        if not self.include_close:
            return "skip: Close ends the server's envs; pass --close to check it (last)"
        self.stub.Close(env_pb2.CloseRequest(), timeout=self.timeout)
        code, details = _code_of(lambda: self._reset([0]))
        _require(code == grpc.StatusCode.FAILED_PRECONDITION,
                 f"Reset after Close must fail with FAILED_PRECONDITION; got {code.name if code else 'success'} "
                 f"{details!r}")
        return "Reset after Close refused with FAILED_PRECONDITION"

    # --- driver -----------------------------------------------------------------------------------------------
    def run(self, only=None, log: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
        results = []
        names = [n for n in self.NAMES if not only or n in only or n == "describe"]
        for name in names:
            t0 = time.perf_counter()
            try:
                note = getattr(self, f"check_{name}")()
                status, detail = (SKIP, note[5:].strip()) if note.startswith("skip:") else (PASS, note)
            except ContractError as exc:
                status, detail = FAIL, str(exc)
            except grpc.RpcError as exc:
                status, detail = FAIL, f"unexpected error: {rpc.describe_error(exc)}"
            result = CheckResult(name, status, detail, time.perf_counter() - t0)
            results.append(result)
            if log:
                log(result)
            if name == "describe" and status == FAIL:
                break  # nothing else can be checked against a bad description
        return results


def check_env(address: str, *, only=None, close: bool = False, timeout: float = 60.0, max_steps: int = 2000,
              log=None) -> list[CheckResult]:
    """Run the checks against ``address``. Raises TimeoutError / grpc.RpcError when it cannot be described."""
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

    ap = argparse.ArgumentParser(prog="coordinatorctl check-env", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="HOST:PORT of the EnvService to check")
    ap.add_argument("--only", nargs="+", metavar="CHECK", help=f"run only these checks ({', '.join(Checker.NAMES)})")
    ap.add_argument("--close", action="store_true", help="also check Close (ends the server's envs; runs last)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server and for each call")
    ap.add_argument("--max-steps", type=int, default=2000, help="longest episode the episode_end check steps through")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)

    def say(r: CheckResult) -> None:
        if not args.json:
            print(f"  {r.status}  {r.name:<26} {r.seconds:6.2f}s  {r.detail}", flush=True)

    if not args.json:
        print(f"checking {args.address} against env contract v{CONTRACT_VERSION} (docs/env-contract.md)", flush=True)
    try:
        results = check_env(args.address, only=args.only, close=args.close, timeout=args.timeout,
                            max_steps=args.max_steps, log=say)
    except ValueError as exc:
        print(f"check-env: {exc}")
        return 2
    except TimeoutError as exc:
        print(f"check-env: {exc}")
        return 2
    except grpc.RpcError as exc:
        print(f"check-env: {args.address} did not answer Describe: {rpc.describe_error(exc)}")
        return 2
    failed = [r for r in results if r.status == FAIL]
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        passed = sum(r.status == PASS for r in results)
        skipped = sum(r.status == SKIP for r in results)
        print(f"{passed} passed, {len(failed)} failed, {skipped} skipped"
              + (f": {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
