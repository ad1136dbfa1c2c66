"""The env contract conformance kit (rlfleet.simulators.conformance, `coordinatorctl check-env`) against real servers: the
from-scratch example, the built-in env server (auto-reset on and off), a server of the first published contract,
a simulator in its own environment, and a deliberately broken server with one defect per case, each of which
the check of the rule it breaks must catch by name."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from rlfleet.simulators import conformance
from rlfleet.v1 import env_pb2, env_pb2_grpc, tensor_pb2
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-m", "services.coordinator.cli"]
NUM_CHECKS = len(conformance.Checker.NAMES)


def _example_module():
    spec = importlib.util.spec_from_file_location(
        "point_reach_example", ROOT / "examples" / "point_reach_env_server.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _example_module()
F32, F64 = tensor_pb2.FLOAT32, tensor_pb2.FLOAT64


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=12))
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _by_name(results):
    return {r.name: r for r in results}


def test_example_server_passes_every_check_from_the_cli():
    sim = subprocess.Popen(
        [sys.executable, "examples/point_reach_env_server.py", "--address", "127.0.0.1:0", "--num-envs", "4"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        address = sim.stdout.readline().split()[-1]
        proc = subprocess.run(
            [*CTL, "check-env", address, "--close"], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{NUM_CHECKS} passed, 0 failed, 0 skipped" in proc.stdout, proc.stdout
        assert "PASS  close" in proc.stdout and "PASS  simulator_crash" in proc.stdout
    finally:
        sim.kill()


def test_check_env_help_works_like_every_other_subcommand():
    proc = subprocess.run([*CTL, "check-env", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage: coordinatorctl check-env" in proc.stdout and "--max-steps" in proc.stdout
    assert all(name in proc.stdout for name in conformance.Checker.NAMES), proc.stdout
    for sub in ("start", "status", "deploy", "traces"):
        assert subprocess.run([*CTL, sub, "--help"], capture_output=True, timeout=60, cwd=ROOT).returncode == 0, sub


@pytest.mark.parametrize("auto_reset", [True, False])
def test_built_in_env_server_passes(auto_reset):
    from services.env.server import serve_env_only

    cfg = small_config(
        "env.train.total_num_envs=3",
        "rollout.pipeline_stage_num=1",
        "actor.global_batch_size=48",
        "actor.micro_batch_size=48",
        "env.train.max_episode_steps=12",
        f"env.train.auto_reset={str(auto_reset).lower()}",
    )
    server, address, env = serve_env_only(cfg, "127.0.0.1:0")
    try:
        results = conformance.check_env(address, close=True)
        failed = [(r.name, r.detail) for r in results if r.status == conformance.FAIL]
        assert not failed, failed
        by = _by_name(results)
        assert ("frozen until reset" in by["episode_end"].detail) == (not auto_reset)
        assert by["reset_state_ids"].detail.startswith("no fixed initial states")
        assert by["simulator_crash"].status == conformance.SKIP  # the optional fault request is not served here
    finally:
        server.stop(0)
        env.close()


def test_a_server_of_the_first_published_contract_is_checked_as_version_0(tmp_path):
    """contract_version '' is version 0: its zero values read as defaults (no chunks, no stated stream limit),
    final observations of every row are its form; what it lacks is skipped, the rest passes."""
    from tests.fixtures.env_contract_v0 import build_stubs, start_server

    sim, address = start_server(build_stubs(tmp_path / "stubs"))
    try:
        by = _by_name(conformance.check_env(address))
        assert not [r for r in by.values() if r.status == conformance.FAIL], by
        assert "version 0" in by["describe"].detail and "max_action_chunk 0 reads as 1" in by["describe"].detail
        assert {n for n, r in by.items() if r.status == conformance.SKIP} == {
            "instructions",
            "chunks",
            "reset_state_ids",
            "simulator_crash",
            "close",
        }
        assert "not stated" in by["stream_limit"].detail
    finally:
        sim.kill()


# --- a broken server: one defect per case ------------------------------------------------------------------------


class Broken(example.PointReach):
    """The example server with one contract breach (``defect``), or none. ``auto_reset=False`` adds the frozen
    envs of the auto-reset-off mode."""

    def __init__(self, defect: str | None, num_envs: int = 4, max_steps: int = 20, auto_reset: bool = True):
        self.defect, self.auto = defect, auto_reset
        self.done = np.zeros(num_envs, bool)
        self.started = np.ones(num_envs, bool)
        self.crashed = False
        self._stepping: np.ndarray = np.zeros(0, np.int64)
        super().__init__(num_envs, max_steps)
        self.first_descriptions = [self._instruction(i) for i in range(num_envs)]
        if defect == "crash_before_reset":
            self.started[:] = False

    # --- what each defect changes ---
    def Describe(self, request, context):
        d = self.defect
        spec = super().Describe(request, context)
        spec.auto_reset = self.auto
        if d == "unknown_version":
            spec.contract_version = "7"
        elif d == "incarnation_changes":
            spec.incarnation = uuid.uuid4().hex
        elif d == "stale_task_descriptions":
            del spec.task_descriptions[:]
            spec.task_descriptions.extend(self.first_descriptions)
        elif d == "obs_out_of_bounds":
            spec.observation_space["state"].high_per_element[0] = 0.25
        elif d == "no_stream_limit":
            spec.max_step_streams = 2  # but 4 are served
        return spec

    def _reset(self, i, seed, state):
        if self.defect == "seed_ignored":
            seed = None
        if self.defect == "seed_overrides_state" and seed is not None:
            state = -1
        super()._reset(i, seed, state)
        self.done[i] = False
        self.started[i] = True

    def Reset(self, request, context):
        d = self.defect
        if d == "crash_breaks_reset" and self.crashed:
            context.abort(grpc.StatusCode.INTERNAL, "the simulator is gone")
        ids, seeds, states = list(request.env_ids), list(request.seeds), list(request.reset_state_ids)
        if d == "state_below_minus_one_accepted":
            states = [max(-1, s) for s in states]
        if d == "state_count_mismatch_accepted" and states and ids:
            states = (states + [-1] * len(ids))[: len(ids)]
        if d == "duplicate_ids_in_reset_accepted":
            ids = list(dict.fromkeys(ids))
        if d == "seeds_count_accepted" and seeds and ids and len(seeds) != len(ids):
            seeds = []
        if d == "reset_rows_reversed" and len(ids) > 1:
            order = np.argsort(ids)
            ids = [ids[k] for k in order]
            seeds = [seeds[k] for k in order] if seeds else []
            states = [states[k] for k in order] if states else []
        return super().Reset(env_pb2.ResetRequest(env_ids=ids, seeds=seeds, reset_state_ids=states), context)

    def _ids(self, env_ids):
        if self.defect == "unknown_id_unnamed" and any(not 0 <= i < self.n for i in env_ids):
            raise example.BadRequest("no such env")
        if self.defect == "duplicate_ids_in_step_accepted" and getattr(self, "_in_step", False):
            return np.array(list(env_ids) or range(self.n), dtype=np.int64)
        return super()._ids(env_ids)

    def _actions(self, msg, n):
        d = self.defect
        shape = list(msg.shape)
        if msg.dtype != F32 and not (d == "float64_accepted" and msg.dtype == F64):
            raise example.BadRequest(f"actions: dtype {msg.dtype} where FLOAT32 was expected")
        if shape != [n, 2] and not (len(shape) == 3 and shape[0] == n and shape[2] == 2):
            raise example.BadRequest(f"actions: shape {shape}")
        item = 8 if msg.dtype == F64 else 4
        size = item * int(np.prod(shape))
        data = msg.data
        if len(data) != size:
            if d != "byte_count_unchecked":
                raise example.BadRequest(f"actions: {len(data)} data bytes for shape {shape}")
            data = (data + bytes(size))[:size]
        act = np.frombuffer(data, np.float64 if item == 8 else np.float32).reshape(shape).astype(np.float32)
        act = act[:, None] if act.ndim == 2 else act
        if not 1 <= act.shape[1] <= example.MAX_ACTION_CHUNK + (d == "chunk_over_max_accepted"):
            raise example.BadRequest(
                f"actions: chunk of {act.shape[1]} sub-steps; this server accepts 1..{example.MAX_ACTION_CHUNK}"
            )
        if not np.isfinite(act).all():
            if d == "bad_request_moves_env":
                self.pos[self._stepping] += 0.1  # stepped before validating
            raise example.BadRequest("actions: non-finite value")
        return act if d == "no_clipping" else np.clip(act, -1.0, 1.0)

    def Step(self, request_iterator, context):
        d = self.defect
        if d == "slow_stream_refusal":
            got = self.streams.acquire(timeout=20)  # waits for a slot instead of refusing at once
        else:
            got = self.streams.acquire(blocking=False)
        if not got:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many Step streams")
        crash = ("rlfleet-fault", "simulator-crash") in [tuple(m) for m in context.invocation_metadata()]
        try:
            for req in request_iterator:
                with self.lock:
                    if self.closed and d != "close_ignored":
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "closed")
                    try:
                        self._in_step = True
                        ids = self._ids(req.env_ids)
                        self._stepping = ids
                        act = self._actions(req.actions, len(ids))
                    except example.BadRequest as exc:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    finally:
                        self._in_step = False
                    if not self.started[ids].all():
                        raise RuntimeError("env never reset")  # an uncaught exception: UNKNOWN
                    if crash:
                        if d == "crash_as_unknown":
                            raise RuntimeError("physics exploded")
                        self.crashed = True
                        context.abort(grpc.StatusCode.INTERNAL, "physics step failed (simulated)")
                    yield self._step(ids, act, chunked=len(req.actions.shape) == 3)
        finally:
            if not (d == "abandoned_slot_kept" and not context.is_active()):
                self.streams.release()

    def Close(self, request, context):
        if self.defect != "close_ignored":
            self.closed = True
        return env_pb2.CloseResponse()

    def _step(self, ids, act, chunked):
        d = self.defect
        n, chunk = act.shape[:2]
        reward, success = np.zeros((n, chunk), np.float32), np.zeros((n, chunk), bool)
        terminated, truncated = np.zeros((n, chunk), bool), np.zeros((n, chunk), bool)
        frozen = [j for j, i in enumerate(ids) if self.done[i]]
        ended = np.zeros(n, bool)
        ended[frozen] = True
        terminated[frozen, 0] = True
        limit = 10**9 if d == "truncation_ignored" else self.max_steps
        if d == "unnamed_envs_move":
            self.pos[[k for k in range(self.n) if k not in set(ids.tolist())]] += 0.01
        final_rows, final_obs, episodes = [], [], []
        for c in range(chunk):
            for j, i in enumerate(ids):
                if j in frozen or (ended[j] and d != "later_substeps_run"):
                    continue
                self.pos[i] = np.clip(self.pos[i] + 0.1 * act[j, c], -2, 2)
                dist = float(np.linalg.norm(self.goal[i] - self.pos[i]))
                reward[j, c], success[j, c] = -dist, dist < 0.05
                if not (d == "steps_not_control_steps" and c > 0):
                    self.t[i] += 1
                self.ret[i] += -dist
                self.hit[i] |= success[j, c]
                if self.t[i] >= limit and not ended[j]:
                    truncated[j, c] = ended[j] = True
                    terminated[j, c] = d == "terminated_and_truncated"
                    final_rows.append(j)
                    final_obs.append(self._obs([i])[0])
                    stats = tensor_pb2.EpisodeStats(
                        env_id=int(i),
                        length=int(self.t[i]),
                        success_once=bool(self.hit[i]),
                        success_at_end=bool(success[j, c]),
                        instruction=self._instruction(i),
                        reset_state_id=-1 if d == "state_not_reported" else int(self.state_id[i]),
                    )
                    setattr(stats, "return", 0.0 if d == "wrong_episode_return" else float(self.ret[i]))
                    episodes.append(stats)
        if d == "frozen_success":
            success[frozen, 0] = True
        order = np.argsort(final_rows, kind="stable")
        final_rows = [final_rows[k] for k in order]
        final = np.stack([final_obs[k] for k in order]) if final_rows else np.zeros((0, 4), np.float32)
        if d == "final_obs_every_row":
            final = self._obs(ids)
        for j in final_rows:
            if self.auto:
                self._reset(ids[j], None, -1)
            else:
                self.done[ids[j]] = True
        if not chunked or (d == "chunk_of_one_flat" and chunk == 1):
            reward, terminated, truncated, success = reward[:, 0], terminated[:, 0], truncated[:, 0], success[:, 0]
        truncated_t = example.tensor(truncated)
        if d == "bool_bytes_2":
            truncated_t.data = truncated_t.data.replace(b"\x01", b"\x02")
        return env_pb2.StepResponse(
            observations=tensor_pb2.TensorMap(tensors={"state": example.tensor(self._obs(ids))}),
            rewards=example.tensor(reward),
            terminated=example.tensor(terminated),
            truncated=truncated_t,
            success=example.tensor(success),
            final_observations=tensor_pb2.TensorMap(tensors={"state": example.tensor(final)}),
            final_rows=final_rows,
            episodes=episodes,
            instructions=[self._instruction(i) for i in ids],
        )


# defect -> (the check that must fail, what its detail must say); one rule of docs/env-contract.md each
DEFECTS = {
    "unknown_version": ("describe", "contract_version is '7'"),
    "incarnation_changes": ("describe", "incarnation changed"),
    "crash_before_reset": ("step_before_reset", "Step of env 0 before any Reset"),
    "obs_out_of_bounds": ("reset_shapes", "outside its declared bounds"),
    "seed_ignored": ("seeded_reset_determinism", "seed 4242 twice gave different"),
    "reset_rows_reversed": ("reset_order", "do not follow the order of env_ids"),
    "stale_task_descriptions": ("instructions", "task_descriptions are each env's current instruction"),
    "bool_bytes_2": ("episode_end", "StepResponse.truncated: BOOL bytes must be 0 or 1"),
    "final_obs_every_row": ("step_shapes", "final_observations['state']: shape [4, 4] where [0, 4]"),
    "unnamed_envs_move": ("subset_step", "env 1 moved while only env 0 was stepped"),
    "truncation_ignored": ("episode_end", "did not end an episode within max_episode_steps=20"),
    "wrong_episode_return": ("episode_end", "is not the sum of the episode's rewards"),
    "terminated_and_truncated": ("episode_end", "terminated and truncated both true"),
    "frozen_success": ("episode_end", "success=false"),
    "chunk_of_one_flat": ("chunks", "a chunk of 1 ([n, 1, *action_shape]) answers per-step fields [n, 1]"),
    "chunk_over_max_accepted": ("chunks", "a chunk of 9 sub-steps (max_action_chunk=8): expected INVALID_ARGUMENT"),
    "later_substeps_run": ("chunks", "the later sub-steps must not run"),
    "steps_not_control_steps": ("chunks", "counts control steps, not Step rows"),
    "state_below_minus_one_accepted": ("reset_state_ids", "a state id below -1"),
    "state_count_mismatch_accepted": ("reset_state_ids", "2 reset_state_ids for 1 env"),
    "seed_overrides_state": ("reset_state_ids", "a fixed initial state gives the same start whatever the seed"),
    "state_not_reported": ("reset_state_ids", "reports EpisodeStats.reset_state_id -1"),
    "unknown_id_unnamed": ("bad_input", "unknown env id in Reset: expected INVALID_ARGUMENT naming 'env_ids'"),
    "duplicate_ids_in_reset_accepted": ("bad_input", "duplicate env ids in Reset"),
    "seeds_count_accepted": ("bad_input", "seeds count differs from env_ids"),
    "duplicate_ids_in_step_accepted": ("bad_input", "duplicate env ids in Step"),
    "float64_accepted": ("bad_input", "FLOAT64 actions"),
    "byte_count_unchecked": ("bad_input", "action bytes that do not match the shape"),
    "bad_request_moves_env": ("bad_input", "env 0 is not where it was"),
    "no_clipping": ("out_of_bounds_actions", "must clip actions"),
    "no_stream_limit": ("stream_limit", "stream 3 (max_step_streams=2) must fail at once"),
    "slow_stream_refusal": ("stream_limit", "DEADLINE_EXCEEDED"),
    "abandoned_slot_kept": ("abandoned_stream", "must free its slot"),
    "crash_as_unknown": ("simulator_crash", "must be answered INTERNAL"),
    "crash_breaks_reset": ("simulator_crash", "after INTERNAL, Reset of every env and a Step must work"),
    "close_ignored": ("close", "Step after Close: expected FAILED_PRECONDITION"),
}


@pytest.mark.parametrize("auto_reset", [True, False])
def test_the_unbroken_server_passes_in_both_modes(auto_reset):
    server, address = _serve(Broken(None, auto_reset=auto_reset))
    try:
        results = conformance.check_env(address, close=True)
        assert [r.status for r in results] == [conformance.PASS] * NUM_CHECKS, [
            (r.name, r.detail) for r in results if r.status != conformance.PASS
        ]
    finally:
        server.stop(0)


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_fails_the_check_of_its_rule_and_every_check_is_reported(defect):
    check, says = DEFECTS[defect]
    server, address = _serve(Broken(defect, auto_reset=defect != "frozen_success"))
    try:
        results = conformance.check_env(address, close=True)
        by = _by_name(results)
        assert [r.name for r in results] == list(conformance.Checker.NAMES)  # nothing stops the run of checks
        assert by[check].status == conformance.FAIL, (by[check].status, by[check].detail)
        assert says in by[check].detail, by[check].detail
        if check not in ("describe", "abandoned_stream"):  # (a leaked slot starves later checks too)
            assert by["describe"].status == conformance.PASS
    finally:
        server.stop(0)


def test_a_closed_server_is_one_line_not_a_dozen_failures():
    server, address = _serve(example.PointReach(2, 10))
    try:
        env_pb2_grpc.EnvServiceStub(grpc.insecure_channel(address)).Close(env_pb2.CloseRequest(), timeout=10)
        with pytest.raises(conformance.ServerClosed):
            conformance.check_env(address)
        proc = subprocess.run([*CTL, "check-env", address], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 2, proc.stdout
        assert proc.stdout.count("\n") == 3 and "was closed (Close)" in proc.stdout, proc.stdout  # header, describe
        assert not any(line.startswith("  FAIL") for line in proc.stdout.splitlines()), proc.stdout
    finally:
        server.stop(0)


def test_cli_exit_codes():
    server, address = _serve(Broken("unknown_version", 2, 10))
    try:
        proc = subprocess.run([*CTL, "check-env", address], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 1 and "FAIL  describe" in proc.stdout, proc.stdout
        assert f"{NUM_CHECKS - 2} passed, 1 failed, 1 skipped: describe" in proc.stdout, proc.stdout
    finally:
        server.stop(0)
    proc = subprocess.run(
        [*CTL, "check-env", "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2 and "no gRPC server answered at 127.0.0.1:1" in proc.stdout, proc.stdout
    proc = subprocess.run(
        [*CTL, "check-env", "127.0.0.1:1", "--only", "nonsense"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2 and "unknown check(s) ['nonsense']" in proc.stdout, proc.stdout


@pytest.mark.sim
def test_metaworld_env_server_in_its_own_environment_passes():
    from tests.simenv import run_in_env

    out = run_in_env(
        "metaworld",
        """
import json
from rlfleet.simulators import conformance
from rlfleet.config import load_config
from services.env.server import serve_env_only
cfg = load_config("metaworld_mt1_ppo_mlp", ["env.train.total_num_envs=2", "env.train.max_episode_steps=20",
                                             "actor.global_batch_size=64", "actor.micro_batch_size=64"])
server, address, env = serve_env_only(cfg, "127.0.0.1:0")
results = conformance.check_env(address, close=True)
print(json.dumps({r.name: [r.status, r.detail] for r in results}))
""",
    )
    failed = {k: v for k, v in out.items() if v[0] == conformance.FAIL}
    assert not failed, failed
    assert out["describe"][1].startswith("metaworld:")
