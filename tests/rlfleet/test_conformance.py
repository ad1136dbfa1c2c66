"""The env contract conformance kit (rlfleet.conformance, `coordinatorctl check-env`) against real servers:
the from-scratch example, the built-in env server (auto-reset on and off), a simulator in its own environment,
and deliberately broken servers that it must catch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from rlfleet import conformance
from rlfleet.v1 import env_pb2_grpc
from tests.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-m", "services.coordinator.cli"]


def _example_module():
    spec = importlib.util.spec_from_file_location("point_reach_example", ROOT / "examples" / "point_reach_env_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _example_module()


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=12))
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _by_name(results):
    return {r.name: r for r in results}


def test_example_server_passes_every_check_from_the_cli():
    sim = subprocess.Popen([sys.executable, "examples/point_reach_env_server.py", "--address", "127.0.0.1:0",
                            "--num-envs", "4"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        address = sim.stdout.readline().split()[-1]
        proc = subprocess.run([*CTL, "check-env", address, "--close"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "14 passed, 0 failed, 0 skipped" in proc.stdout, proc.stdout
        assert "PASS  close" in proc.stdout
    finally:
        sim.kill()


@pytest.mark.parametrize("auto_reset", [True, False])
def test_built_in_env_server_passes(auto_reset):
    from services.env.server import serve_env_only

    cfg = small_config("env.train.total_num_envs=3", "rollout.pipeline_stage_num=1", "actor.global_batch_size=48", "actor.micro_batch_size=48",
                       "env.train.max_episode_steps=12",
                       f"env.train.auto_reset={str(auto_reset).lower()}")
    server, address, env = serve_env_only(cfg, "127.0.0.1:0")
    try:
        results = conformance.check_env(address, close=True)
        failed = [(r.name, r.detail) for r in results if r.status == conformance.FAIL]
        assert not failed, failed
        by = _by_name(results)
        assert by["episode_end"].status == conformance.PASS
        assert ("frozen until reset" in by["episode_end"].detail) == (not auto_reset)
        assert by["reset_state_ids"].detail.startswith("no fixed initial states")
    finally:
        server.stop(0)
        env.close()


class _Broken(example.PointReach):
    """Three contract breaches: seeds ignored, actions not clipped, errors that do not name the field."""

    def _reset(self, i, seed, state):
        super()._reset(i, None, state)  # ignores the seed

    def _actions(self, msg, n):
        act = np.frombuffer(msg.data, np.float32).reshape(list(msg.shape))
        return (act[:, None] if act.ndim == 2 else act) * 1.0  # no clipping, no validation

    def _step(self, ids, act, chunked):
        self.pos[ids] += 0.0
        return super()._step(ids, np.clip(act, -50, 50), chunked)


def test_broken_server_fails_the_checks_that_matter():
    server, address = _serve(_Broken(4, 20))
    try:
        by = _by_name(conformance.check_env(address))
        assert by["seeded_reset_determinism"].status == conformance.FAIL
        assert "seed 4242 twice gave different" in by["seeded_reset_determinism"].detail
        assert by["out_of_bounds_actions"].status == conformance.FAIL
        assert "must clip actions" in by["out_of_bounds_actions"].detail
        assert by["bad_input"].status == conformance.FAIL  # a NaN/odd-shaped action went through
        assert by["describe"].status == by["episode_end"].status == by["stream_limit"].status == conformance.PASS
        assert by["close"].status == conformance.SKIP
    finally:
        server.stop(0)


class _AllFinalObs(example.PointReach):
    """The pre-release contract's habit: final observations for every row, not only the rows that ended."""

    def _step(self, ids, act, chunked):
        resp = super()._step(ids, act, chunked)
        resp.final_observations.tensors["state"].CopyFrom(example.tensor(self._obs(ids)))
        return resp


class _OldContract(example.PointReach):
    def Describe(self, request, context):
        spec = super().Describe(request, context)
        spec.contract_version = ""
        return spec


def test_final_observations_of_rows_that_did_not_end_are_caught():
    server, address = _serve(_AllFinalObs(4, 20))
    try:
        by = _by_name(conformance.check_env(address, only=["step_shapes"]))
        assert by["step_shapes"].status == conformance.FAIL
        assert "final_observations['state']: shape [4, 4] where [0, 4]" in by["step_shapes"].detail
    finally:
        server.stop(0)


def test_old_contract_stops_after_describe_and_cli_exit_codes():
    server, address = _serve(_OldContract(2, 10))
    try:
        results = conformance.check_env(address)
        assert [r.name for r in results] == ["describe"] and "contract_version is ''" in results[0].detail
        proc = subprocess.run([*CTL, "check-env", address], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 1 and "FAIL  describe" in proc.stdout, proc.stdout
    finally:
        server.stop(0)
    proc = subprocess.run([*CTL, "check-env", "127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "no gRPC server answered at 127.0.0.1:1" in proc.stdout, proc.stdout
    proc = subprocess.run([*CTL, "check-env", "127.0.0.1:1", "--only", "nonsense"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown check(s) ['nonsense']" in proc.stdout, proc.stdout


@pytest.mark.sim
def test_metaworld_env_server_in_its_own_environment_passes():
    from tests.simenv import run_in_env

    out = run_in_env("metaworld", """
import json
from rlfleet import conformance
from rlfleet.config import load_config
from services.env.server import serve_env_only
cfg = load_config("metaworld_mt1_ppo_mlp", ["env.train.total_num_envs=2", "env.train.max_episode_steps=20",
                                             "actor.global_batch_size=64", "actor.micro_batch_size=64"])
server, address, env = serve_env_only(cfg, "127.0.0.1:0")
results = conformance.check_env(address, close=True)
print(json.dumps({r.name: [r.status, r.detail] for r in results}))
""")
    failed = {k: v for k, v in out.items() if v[0] == conformance.FAIL}
    assert not failed, failed
    assert out["describe"][1].startswith("metaworld:")
