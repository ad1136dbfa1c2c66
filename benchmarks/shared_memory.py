"""The zero-copy path on one host against plain gRPC (issue 34): an Act of N envs x two 224 px uint8 cameras, and
the PushRollout of one epoch of them (N envs x T steps), each through a real gRPC server on loopback in another
process, once with inline bytes and once by shared-memory handle.

The sender is the env server's own client code (rlfleet.wire.clients: ``GrpcPolicyClient``, ``push_rollout`` with
the rollout's observation buffers in its arena, as an env server keeps them); the receiver decodes what arrives as
the inference server and the learner do (``codec.decode_map`` with a ``shm.Reader``, the learner's concatenation
of chunks) and answers with the reply's shapes, so the numbers are the wire's and no policy's.

Per path: the round trip (wall, one request in flight), the sender's CPU (building, serialising, parsing, decoding:
``WireStats``), the receiver's decode, and the env steps/s one receiving process can take in when the wire is all
it does (rows / round trip).

    python -m benchmarks.shared_memory [--envs 64] [--steps 64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

IMAGE = (224, 224, 3)
CAMERAS = ("third_person", "wrist")


def serve() -> None:
    """The receiving process: InferenceService.Act and LearnerService.PushRollout as the servers decode them."""
    from rlfleet.v1 import inference_pb2, inference_pb2_grpc, learner_pb2, learner_pb2_grpc
    from rlfleet.wire import codec, servers, shm

    decode_s: list[float] = []

    class Inference(inference_pb2_grpc.InferenceServiceServicer):
        def SharedMemory(self, request, context):
            return shm.answer(request, True)

        def Act(self, request_iterator, context):
            reader = shm.Reader()
            try:
                for req in request_iterator:
                    t0 = time.perf_counter()
                    obs = codec.decode_map(req.observations, "observations", shm=reader)
                    decode_s.append(time.perf_counter() - t0)
                    n = next(iter(obs.values())).shape[0]
                    yield inference_pb2.ActResponse(
                        request_id=req.request_id,
                        actions=codec.encode(np.zeros((n, 4, 7), np.float32)),
                        log_probs=codec.encode(np.zeros((n, 1), np.float32)),
                        weights_version=1,
                    )
            finally:
                reader.close()

    class Learner(learner_pb2_grpc.LearnerServiceServicer):
        def SharedMemory(self, request, context):
            return shm.answer(request, True)

        def PushRollout(self, request_iterator, context):
            reader = shm.Reader()
            try:
                parts: dict[str, list] = {}
                t0 = time.perf_counter()
                for chunk in request_iterator:  # (the parse of each chunk happens in gRPC as it is pulled)
                    for k, v in codec.decode_map(chunk.data, "rollout", shm=reader).items():
                        parts.setdefault(k, []).append(v)
                kept = {
                    k: v[0] if len(v) == 1 and v[0].flags.writeable else np.concatenate(v) for k, v in parts.items()
                }
                decode_s.append(time.perf_counter() - t0)
                return learner_pb2.PushRolloutResponse(
                    num_steps=kept["rewards"].shape[0], num_envs=kept["rewards"].shape[1]
                )
            finally:
                reader.close()

        def Status(self, request, context):  # the receiver's decode times so far, then reset
            out = learner_pb2.LearnerStatus(last_checkpoint=json.dumps(decode_s))
            decode_s.clear()
            return out

    server = servers.make_server(max_workers=4)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(Inference(), server)
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(Learner(), server)
    print(servers.bind(server, "127.0.0.1:0"), flush=True)
    server.start()
    sys.stdin.readline()
    server.stop(0)


def _receiver_decode(address: str) -> list[float]:
    from rlfleet.v1 import learner_pb2, learner_pb2_grpc
    from rlfleet.wire import channels

    with channels.channel(address) as ch:
        st = learner_pb2_grpc.LearnerServiceStub(ch).Status(learner_pb2.LearnerStatusRequest(), timeout=30)
    return json.loads(st.last_checkpoint)


def act(address: str, envs: int, repeats: int, shared_memory: bool) -> dict:
    from rlfleet.wire.clients import GrpcPolicyClient

    rng = np.random.default_rng(0)
    obs = {k: rng.integers(0, 256, (envs, *IMAGE), dtype=np.uint8) for k in CAMERAS}
    obs["state"] = rng.normal(size=(envs, 7)).astype(np.float32)
    client = GrpcPolicyClient([address], 1, action_dim=7, shared_memory=shared_memory)
    assert (client.streams[0].arena is not None) == shared_memory, client.streams[0].shared_memory_why
    try:
        for _ in range(3):
            client.submit(0, obs)
            client.result(0)
        _receiver_decode(address)
        w0, walls = client.wire_stats(), []
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.submit(0, obs)
            client.result(0)
            walls.append(time.perf_counter() - t0)
        wire = client.wire_stats() - w0
    finally:
        client.close()
    rt = float(np.median(walls))
    return {
        "bytes": wire.bytes / repeats,
        "shm_bytes": wire.shm_bytes / repeats,
        "round_trip_ms": rt * 1e3,
        "sender_cpu_ms": wire.seconds / repeats * 1e3,
        "receiver_decode_ms": float(np.median(_receiver_decode(address))) * 1e3,
        "env_steps_per_s": envs / rt,
    }


def push(address: str, envs: int, steps: int, repeats: int, shared_memory: bool) -> dict:
    from rlfleet.wire import codec, shm
    from rlfleet.wire.clients import WireStats, push_rollout

    arena = shm.Arena("rollout", slots=1) if shared_memory else None
    layout = {f"obs.{k}": ((steps, envs, *IMAGE), np.uint8) for k in CAMERAS}
    layout["obs.state"] = ((steps, envs, 7), np.float32)
    walls, cpu, sent, by_handle = [], [], [], []
    try:
        for i in range(repeats + 1):
            # the epoch's buffers as the env server fills them (in its arena's segment when sharing)
            buf = codec.empty_buffers(steps, envs, {}, None)
            buf.update(
                arena.buffers(layout) if arena is not None else {k: np.empty(s, d) for k, (s, d) in layout.items()}
            )
            for k in CAMERAS:
                buf[f"obs.{k}"][:] = (i * 7 + len(k)) % 251
            buf["obs.state"][:] = 0.5
            buf["actions"] = np.zeros((steps, envs, 4, 7), np.float32)
            buf["log_probs"] = np.zeros((steps, envs, 1), np.float32)
            buf["fi.action_bins"] = np.zeros((steps, envs, 28), np.int64)
            buf["rewards"][:] = 0.0
            tail = codec.make_tail({k[4:]: v[-1].copy() for k, v in buf.items() if k.startswith("obs.")})
            rollout = codec.Rollout(buf, tail, [])
            stats = WireStats()
            t0 = time.perf_counter()
            push_rollout(address, rollout, 0, 0, "bench", timeout=600, arena=arena, stats=stats)
            if i:  # the first one faults the pages in
                walls.append(time.perf_counter() - t0)
                cpu.append(stats.seconds)
                sent.append(stats.bytes)
                by_handle.append(stats.shm_bytes)
            del buf, rollout
    finally:
        if arena is not None:
            arena.close()
    decode = _receiver_decode(address)[1:]
    rt = float(np.median(walls))
    return {
        "bytes": float(np.median(sent)),
        "shm_bytes": float(np.median(by_handle)),
        "round_trip_ms": rt * 1e3,
        "sender_cpu_ms": float(np.median(cpu)) * 1e3,
        "receiver_decode_ms": float(np.median(decode)) * 1e3,
        "env_steps_per_s": envs * steps / rt,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64, help="steps of the pushed epoch")
    parser.add_argument("--repeats", type=int, default=20, help="Act round trips per transport (pushes: a fifth)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    import torch

    torch.set_num_threads(1)
    receiver = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.shared_memory", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        address = receiver.stdout.readline().strip()
        load = os.getloadavg()[0]
        act_mb = args.envs * (2 * int(np.prod(IMAGE)) + 28) / 1e6
        print(
            f"# {args.envs} envs x two {IMAGE[0]} px cameras: one Act {act_mb:.1f} MB, one epoch "
            f"({args.steps} steps) {act_mb * args.steps / 1e3:.2f} GB; {os.cpu_count()} CPUs, load {load:.1f}"
        )
        print(
            f"{'path':9} {'transport':10} {'msg MB':>8} {'shm MB':>8} {'round trip ms':>14} {'sender CPU ms':>14} "
            f"{'receiver ms':>12} {'env steps/s':>12}"
        )
        for name, run in (
            ("act", lambda s: act(address, args.envs, args.repeats, s)),
            ("rollout", lambda s: push(address, args.envs, args.steps, max(2, args.repeats // 5), s)),
        ):
            for shared in (False, True):
                r = run(shared)
                print(
                    f"{name:9} {'shm' if shared else 'grpc':10} {r['bytes'] / 1e6:8.2f} {r['shm_bytes'] / 1e6:8.1f} "
                    f"{r['round_trip_ms']:14.1f} {r['sender_cpu_ms']:14.1f} {r['receiver_decode_ms']:12.1f} "
                    f"{r['env_steps_per_s']:12,.0f}",
                    flush=True,
                )
        print(f"# load at the end {os.getloadavg()[0]:.1f}")
    finally:
        receiver.stdin.close()
        receiver.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
