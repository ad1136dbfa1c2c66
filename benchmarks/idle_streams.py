"""Idle server-reflection streams against a live run (issue 25): does the run go on, are valid calls answered,
do heartbeats keep flowing?

    python benchmarks/idle_streams.py --streams 40 [--target coordinator|all] [--epochs 40] [--reopen 1.0]
        [--max-seconds 300]

Starts the tiny end-to-end run of the tests (coordinatorctl start, every service a local process), waits for
its second epoch, then holds ``--streams`` reflection streams that send nothing against the coordinator (or each
of the four servers), reopening each one ``--reopen`` seconds after it ends (refused or closed for idleness: a
persistent caller; -1: each is opened once). While they stand it calls the coordinator's Status, the learner's
Status and the env server's Describe every 0.5 s with the run's credentials and reads every service's heartbeat
age; a run that stops moving is killed after ``--max-seconds``. Prints one line of results (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlfleet.v1 import (  # noqa: E402
    coordinator_pb2,
    coordinator_pb2_grpc,
    env_pb2,
    env_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
)
from rlfleet.wire import auth  # noqa: E402

TINY = [
    "env.train.total_num_envs=8",
    "env.train.max_steps_per_rollout_epoch=25",
    "env.eval.total_num_envs=4",
    "env.eval.num_episodes=4",
    "actor.micro_batch_size=100",
    "actor.global_batch_size=100",
    "algorithm.update_epoch=2",
    "actor.model.hidden_dims=[32,32]",
    "runner.max_env_steps=null",
    "runner.max_wall_time_s=null",
    "runner.val_check_interval=0",
]


def credential(secret: str, to: str) -> list[tuple[str, str]]:
    """ctl's call metadata toward a server of role ``to`` (before per-role credentials: the token itself)."""
    if hasattr(auth, "metadata"):
        return auth.metadata(secret, "ctl", to=to)
    return [("authorization", f"Bearer {secret}"), ("x-rlfleet-role", "ctl")]


class IdleStreams:
    """``n`` reflection streams per address that send nothing, on one asyncio loop in a thread; each is opened
    again ``reopen`` s after it ends (< 0: never). ``outcomes``: status name -> count of ended streams."""

    def __init__(self, addresses: list[str], n: int, reopen: float):
        self.addresses, self.n, self.reopen = addresses, n, reopen
        self.outcomes: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _one(self, channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        while not self._stop.is_set():
            call = stub.ServerReflectionInfo()
            try:
                await call.read()
                self.outcomes["ended OK"] += 1
            except grpc.aio.AioRpcError as exc:
                self.outcomes[exc.code().name] += 1
            except asyncio.CancelledError:
                call.cancel()
                raise
            if self.reopen < 0:  # opened once
                return
            await asyncio.sleep(self.reopen)

    async def _main(self) -> None:
        channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        tasks = [asyncio.create_task(self._one(ch)) for ch in channels for _ in range(self.n)]
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--target", choices=["coordinator", "all"], default="coordinator")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--reopen", type=float, default=1.0)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="stop the run (SIGKILL) when the flood has lasted this long: a run that no longer moves",
    )
    args = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="idle_streams_"))
    cmd = [
        sys.executable,
        "-m",
        "services.coordinator.cli",
        "start",
        *TINY,
        f"runner.max_epochs={args.epochs}",
        f"runner.logger.log_path={tmp}",
        "runner.experiment_name=idle",
        "cluster.heartbeat_timeout_s=15",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp / "idle"
    t_start = time.monotonic()
    while not (run / "coordinator.json").exists() or not (run / "run_token").exists():
        time.sleep(0.2)
    secret = (run / "run_token").read_text()
    coord = json.loads((run / "coordinator.json").read_text())["address"]
    cstub = coordinator_pb2_grpc.CoordinatorServiceStub(grpc.insecure_channel(coord))
    ctl = credential(secret, "coordinator")
    while True:
        try:
            st = cstub.Status(coordinator_pb2.StatusRequest(), timeout=5, metadata=ctl)
            if st.epoch >= 1:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    addr = {coordinator_pb2.Role.Name(s.role).lower(): s.address for s in st.services}
    targets = [coord] if args.target == "coordinator" else [coord, *addr.values()]
    lstub = learner_pb2_grpc.LearnerServiceStub(grpc.insecure_channel(addr["learner"]))
    estub = env_pb2_grpc.EnvServiceStub(grpc.insecure_channel(addr["env"]))
    flood = IdleStreams(targets, args.streams, args.reopen) if args.streams else None
    t0, first_epoch = time.monotonic(), st.epoch
    worst = {"coordinator Status": 0.0, "learner Status": 0.0, "env Describe": 0.0}
    failures: Counter = Counter()
    max_age = 0.0
    last_epoch, stuck = st.epoch, False
    while proc.poll() is None:
        if time.monotonic() - t0 > args.max_seconds:
            stuck = True
            proc.kill()
            break
        for name, call in (
            ("coordinator Status", lambda: cstub.Status(coordinator_pb2.StatusRequest(), timeout=10, metadata=ctl)),
            (
                "learner Status",
                lambda: lstub.Status(
                    learner_pb2.LearnerStatusRequest(), timeout=10, metadata=credential(secret, "learner")
                ),
            ),
            (
                "env Describe",
                lambda: estub.Describe(env_pb2.DescribeEnvRequest(), timeout=10, metadata=credential(secret, "env")),
            ),
        ):
            c0 = time.monotonic()
            try:
                reply = call()
                worst[name] = max(worst[name], time.monotonic() - c0)
                if name == "coordinator Status":
                    st = reply
                    last_epoch = max(last_epoch, st.epoch)
                    ages = [s.last_heartbeat_age_s for s in st.services if s.alive]
                    max_age = max([max_age, *ages])
            except grpc.RpcError as exc:
                if proc.poll() is None and st.phase == "training":  # not the services leaving at the end
                    failures[f"{name}: {exc.code().name}"] += 1
        time.sleep(0.5)
    t1 = time.monotonic()
    if flood:
        flood.close()
    proc.wait()
    out = proc.stdout.read()
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    print(
        json.dumps(
            {
                "streams": args.streams,
                "target": args.target,
                "exit": proc.returncode,
                "killed_after_s": round(args.max_seconds) if stuck else None,
                "last_epoch_seen": last_epoch + 1,
                "epochs": summary.get("epochs"),
                "restarts": summary.get("restarts"),
                "epochs_per_s_under_flood": round((summary.get("epochs", 0) - first_epoch - 1) / (t1 - t0), 2),
                "worst_call_s": {k: round(v, 3) for k, v in worst.items()},
                "call_failures": dict(failures),
                "max_heartbeat_age_s": round(max_age, 2),
                "reflection_outcomes": dict(flood.outcomes) if flood else {},
                "run_wall_s": round(t1 - t_start, 1),
            }
        )
    )
    if proc.returncode:
        print(out[-3000:])
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
