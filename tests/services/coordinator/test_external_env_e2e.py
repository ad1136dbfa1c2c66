"""`coordinatorctl start cluster.external_env_addresses=[...]` end to end against external simulators of other
contract versions: a server of the first published contract (stubs generated from that commit's protos, in its
own process) trains to the end; a server rlfleet cannot use is refused before anything starts, in one line naming
the field and the doc section. Real processes, real gRPC on loopback, real PPO."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from rlfleet.config import to_yaml
from rlfleet.v1 import env_pb2_grpc
from tests.conftest import small_config
from tests.fixtures.env_contract_v0 import build_stubs, start_server
from tests.services.coordinator.tiny_run import CTL
from tests.services.coordinator.tiny_run import TINY as TINY_RUN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TINY = [
    *TINY_RUN,
    "cluster.heartbeat_timeout_s=8",
]


def test_a_server_of_the_first_published_contract_trains_to_the_end(tmp_path):
    sim, address = start_server(build_stubs(tmp_path / "stubs"), num_envs=8, max_steps=20)
    try:
        proc = subprocess.run(
            [
                *CTL,
                "start",
                *TINY,
                f"runner.logger.log_path={tmp_path}",
                "runner.max_epochs=3",
                f"cluster.external_env_addresses=[{address}]",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run = tmp_path / "external_Cursor-v0"  # named after the simulator it ran, not the default config
        summary = json.loads((run / "summary.json").read_text())
        assert summary["epochs"] == 3 and summary["env_steps"] == 3 * 8 * 25, summary
        assert summary["lost_episodes"] == 0 and summary["final_eval"]["eval/num_episodes"] == 4, summary
        assert "env.train.max_episode_steps: 20 from the external server's Describe" in proc.stdout, proc.stdout
        first = (run / "logs" / "env_0.log").read_text().splitlines()[0]
        assert f"bridge to the external env {address}: external:Cursor-v0, 8 envs, env contract version 0" in first
        assert "PandaPickCube" not in first, first
        # the run did not close it: the simulator serves on, e.g. to check-env
        check = subprocess.run([*CTL, "check-env", address], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert check.returncode == 0, check.stdout
    finally:
        sim.kill()


def _unusable_server():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "point_reach_example", ROOT / "examples" / "point_reach_env_server.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class FromTheFuture(mod.PointReach):
        def Describe(self, request, context):
            spec = super().Describe(request, context)
            spec.contract_version = "7"
            return spec

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    env_pb2_grpc.add_EnvServiceServicer_to_server(FromTheFuture(8, 20), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_server_rlfleet_cannot_use_is_refused_before_anything_starts(tmp_path):
    server, address = _unusable_server()
    try:
        proc = subprocess.run(
            [
                *CTL,
                "start",
                *TINY,
                f"runner.logger.log_path={tmp_path}",
                "runner.max_epochs=3",
                f"cluster.external_env_addresses=[{address}]",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines == [
            f"coordinatorctl: config error: 'cluster.external_env_addresses[0]': the external env at "
            f"{address} cannot be used: EnvSpec.contract_version is '7'; rlfleet knows versions '0', "
            f"'1' ('' reads as '0') (docs/env-contract.md#versions)"
        ], proc.stderr
        assert not list(tmp_path.iterdir())  # no run folder, no service started
        # the bridge itself refuses it the same way (deployments that start it without coordinatorctl start)
        cfg = tmp_path / "run.yaml"
        cfg.write_text(to_yaml(small_config(f"cluster.external_env_addresses=[{address}]")))
        bridge = subprocess.run(
            [sys.executable, "-m", "services.env.server", "--config", str(cfg), "--external-env", address],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert bridge.returncode != 0
        assert bridge.stderr.strip().splitlines()[-1] == (
            f"rlfleet env[0]: cannot start the simulator: external env {address} cannot be used: "
            f"EnvSpec.contract_version is '7'; rlfleet knows versions '0', '1' ('' reads as '0') "
            f"(docs/env-contract.md#versions)"
        ), bridge.stderr
    finally:
        server.stop(0)
