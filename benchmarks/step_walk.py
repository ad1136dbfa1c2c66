"""Which hand-written files one env step runs through (docs/architecture.md's walk), measured, not listed by hand.

    python -m benchmarks.step_walk

Starts an env server, an inference server and a learner (real gRPC servers on loopback, in this process, as the
tests' fleet does), collects one epoch to warm up, then profiles a second Collect of one step on every thread:
the env server's Collect, its Act to the inference server, the env step, and the push of the rollout to the learner.
Prints the repository's files whose functions ran (generated protobuf code left out), in first-run order, plus the
coordinator's side (it sends Collect: services/coordinator/coordinator.py). Episodes last 9 steps, so the profiled
step (the 9th) ends every env's episode: the walk includes the auto-reset and the episode's statistics too.

Tracing is on, as in a run with the default config (``telemetry.traces: file``, ``step_spans: true``; spans and
metrics go to a temporary folder): ``tracing.setup`` runs before the profiler is installed, so the OTel SDK's
exporter threads, started then, are not profiled; the spans and metrics the step makes on the servers' threads are.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MUJOCO_GL", "egl")

import torch  # noqa: E402

torch.set_num_threads(1)

from rlfleet.config import load_config  # noqa: E402
from rlfleet.v1 import env_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.wire import channels, tracing  # noqa: E402


def main() -> None:
    from services.env import server as env_server
    from services.inference import server as inf_server
    from services.learner import server as learner_server

    seen: dict[str, None] = {}
    active = threading.Event()

    def profile(frame, event, arg):  # on every thread the servers start (set before they exist)
        if event == "call" and active.is_set():
            path = frame.f_code.co_filename
            if path.startswith(str(ROOT)) and path not in seen:
                seen[path] = None

    cfg = load_config(
        None,
        [
            "env.train.total_num_envs=4",
            "env.train.max_steps_per_rollout_epoch=8",
            "env.train.max_episode_steps=9",
            "actor.micro_batch_size=8",
            "actor.global_batch_size=32",
        ],
    )
    run = tempfile.mkdtemp()
    assert cfg.telemetry.traces == "file" and cfg.telemetry.step_spans  # the default config's telemetry
    os.environ.pop(tracing.TRACE_DIR_ENV, None)
    tracing.setup("walk", 0, cfg, run)  # before the profiler: the exporters' threads are not profiled
    threading.setprofile(profile)
    inf, inf_addr, engine, _ = inf_server.serve(cfg, "127.0.0.1:0")
    lrn, learner_addr, learner, _ = learner_server.serve(cfg, "127.0.0.1:0", run)
    env, env_addr, worker, _ = env_server.serve(cfg, "127.0.0.1:0")
    rs = rollout_pb2_grpc.RolloutServiceStub(channels.channel(env_addr))
    learner_pb2_grpc.LearnerServiceStub(channels.channel(learner_addr)).PublishWeights(
        learner_pb2.PublishWeightsRequest(
            env_spec=rs.Describe(env_pb2.DescribeEnvRequest()), inference_addresses=[inf_addr]
        ),
        timeout=60,
    )

    def collect(epoch: int, steps: int) -> None:  # what the coordinator's Coordinator._collect sends
        rs.Collect(
            rollout_pb2.CollectRequest(
                epoch=epoch, num_steps=steps, inference_addresses=[inf_addr], learner_address=learner_addr
            ),
            timeout=60,
        )

    collect(0, 8)  # warm-up: first reset, the policy's spaces, the Act stream
    sys.setprofile(profile)
    active.set()
    try:
        collect(1, 1)
        time.sleep(1.0)  # the learner's intake of the pushed rollout finishes on its own thread
    finally:
        active.clear()
        sys.setprofile(None)
        threading.setprofile(None)
    files = [str(pathlib.Path(p).relative_to(ROOT)) for p in seen]
    files = [f for f in files if not f.startswith(("rlfleet/v1/", "benchmarks/", "tests/", ".venv/"))]
    walk = ["services/coordinator/coordinator.py", *files]
    print(f"one env step (Collect of 1 step on 4 envs: act, step, push) ran code in {len(walk)} hand-written files:")
    for i, f in enumerate(walk, 1):
        print(f"{i:3d}. {f}")
    for s in (env, inf, lrn):
        s.stop(0)
    engine.stop()
    worker.close()
    learner.close()
    tracing.shutdown()


if __name__ == "__main__":
    main()
