"""Inference benchmarks: policy throughput, weight updates and many concurrent streams.

actions/s   each policy at batch 1, 8, 32, 64: the InferenceEngine called in this process, and the same engine
            behind an inference server in another process, over loopback gRPC (one Act stream, one request in
            flight). A row is one observation; actions/s counts every action of a chunk.
weights     one weight update to that inference server (UpdateWeights stream): full set vs the partial set a
            LoRA policy sends (its adapters), bytes and seconds.
streams     256 concurrent Act streams on one inference server (MLP policy, 4 rows per request, 20 requests
            each): latency p50/p99/max and the fewest replies any stream got.

  python benchmarks/inference.py [--seconds 2] [--only actions,weights,streams]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlfleet.config import load_config, to_yaml  # noqa: E402
from rlfleet.policies import build_policy  # noqa: E402
from rlfleet.v1 import inference_pb2_grpc  # noqa: E402
from rlfleet.wire import channels, weights  # noqa: E402
from rlfleet.wire.clients import GrpcPolicyClient, _Stream  # noqa: E402
from rlfleet.wire.spaces import TensorSpace  # noqa: E402
from services.inference.engine import InferenceEngine  # noqa: E402

VISION = {
    "third_person": TensorSpace((64, 64, 3), "uint8"),
    "wrist": TensorSpace((64, 64, 3), "uint8"),
    "state": TensorSpace((7,), "float32"),
}
STATE = {"state": TensorSpace((13,), "float32")}
MODELS = {
    "mlp (256x256)": (["actor.model.model_type=mlp"], STATE),
    "cnn (64 px)": (["actor.model.model_type=cnn"], VISION),
    "openvla tiny": (["actor.model.model_type=openvla", "actor.model.image_key=third_person"], VISION),
    "openvla_oft tiny, chunk 4": (
        [
            "actor.model.model_type=openvla_oft",
            "actor.model.image_key=third_person",
            "actor.model.num_action_chunks=4",
            "env.train.max_steps_per_rollout_epoch=32",
        ],
        VISION,
    ),
    "openpi (pi0) tiny, chunk 4": (
        [
            "actor.model.model_type=openpi",
            "actor.model.num_action_chunks=4",
            "env.train.max_steps_per_rollout_epoch=32",
        ],
        VISION,
    ),
}
LORA = [
    "actor.model.model_type=openvla_oft",
    "actor.model.image_key=third_person",
    "actor.model.num_action_chunks=4",
    "env.train.max_steps_per_rollout_epoch=32",
    "actor.model.is_lora=true",
    "actor.model.lora_rank=8",
]
INSTR = "pick up the red cube and lift it"


def _obs(specs, n):
    rng = np.random.default_rng(0)
    return {
        k: (
            rng.integers(0, 256, (n, *s.shape), dtype=np.uint8)
            if s.dtype == "uint8"
            else rng.standard_normal((n, *s.shape)).astype(np.float32)
        )
        for k, s in specs.items()
    }


def _policy(overrides, specs):
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    return cfg, build_policy(cfg.actor.model, specs, 4, True, cfg.algorithm.logprob_type)


class Server:
    """An inference server in its own process, serving ``overrides``' policy."""

    def __init__(self, overrides):
        self.dir = tempfile.mkdtemp(prefix="rlfleet-bench-")
        cfg = load_config(None, [*overrides, "cluster.torch_num_threads=1"])
        path = os.path.join(self.dir, "config.yaml")
        with open(path, "w") as f:
            f.write(to_yaml(cfg))
        code = (
            "import sys, torch; torch.set_num_threads(1); from rlfleet.config import load_config; "
            "from services.inference.server import serve; "
            f"s, a, e, r = serve(load_config({path!r}), '127.0.0.1:0'); print(a, flush=True); sys.stdin.read()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        self.address = self.proc.stdout.readline().strip()

    def update(self, state, version, **kw) -> float:
        t0 = time.perf_counter()
        with channels.channel(self.address) as ch:
            inference_pb2_grpc.InferenceServiceStub(ch).UpdateWeights(
                weights.iter_chunks(state, version, **kw), timeout=120, wait_for_ready=True
            )
        return time.perf_counter() - t0

    def close(self):
        self.proc.kill()


def _rate(fn, seconds) -> float:
    fn()  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def bench_actions(seconds: float, models: list[str] | None = None) -> None:
    print("\n| policy | params | batch | in-process actions/s | inference server actions/s | server / in-process |")
    print("|---|---|---|---|---|---|")
    for name, (overrides, specs) in MODELS.items():
        if models and not any(m in name for m in models):
            continue
        cfg, policy = _policy(overrides, specs)
        chunk = policy.num_action_chunks
        engine = InferenceEngine(cfg.actor.model, logprob_type=cfg.algorithm.logprob_type)
        state = {k: v.clone() for k, v in policy.state_dict().items()}
        engine.set_weights(0, state, obs_specs=specs, action_dim=4)
        server = Server(overrides)
        server.update(state, 0, obs_specs=specs, action_dim=4)
        client = GrpcPolicyClient([server.address], 1, 4)
        params = sum(p.numel() for p in policy.parameters())
        try:
            for b in (1, 8, 32, 64):
                obs, texts = _obs(specs, b), [INSTR] * b
                local = _rate(lambda: engine.act_now(obs, False, texts), seconds) * b * chunk

                def remote():
                    client.submit(0, obs, False, texts)
                    client.result(0)

                over = _rate(remote, seconds) * b * chunk
                print(
                    f"| {name} | {params / 1e6:.2f}M | {b} | {local:,.0f} | {over:,.0f} | {over / local:.2f} |",
                    flush=True,
                )
        finally:
            client.close()
            server.close()


def bench_weights() -> None:
    print("\n| update | tensors | bytes | seconds |")
    print("|---|---|---|---|")
    _, policy = _policy(LORA, VISION)
    server = Server(LORA)
    try:
        full = {k: v.clone() for k, v in policy.state_dict().items()}
        sync = {k: v.clone() for k, v in policy.sync_state_dict().items()}
        t_first = server.update(full, 0, obs_specs=VISION, action_dim=4)
        rows = [("full set (first)", full, t_first)]
        rows.append(
            ("full set", full, np.median([server.update(full, v, obs_specs=VISION, action_dim=4) for v in (1, 2, 3)]))
        )
        rows.append(
            ("LoRA adapters (partial)", sync, np.median([server.update(sync, v, partial=True) for v in (4, 5, 6)]))
        )
        for name, state, sec in rows:
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            print(f"| {name} | {len(state)} | {nbytes:,} | {sec:.3f} |")
    finally:
        server.close()


def bench_streams(num_streams: int = 256, requests: int = 20, rows: int = 4) -> None:
    overrides = ["actor.model.model_type=mlp"]
    _, policy = _policy(overrides, STATE)
    server = Server(overrides)
    server.update({k: v.clone() for k, v in policy.state_dict().items()}, 0, obs_specs=STATE, action_dim=4)
    latencies: list[float] = []
    replies = [0] * num_streams
    lock = threading.Lock()
    obs = _obs(STATE, rows)
    start = threading.Barrier(num_streams + 1)

    def run(i):
        s = _Stream(server.address, 120.0)
        start.wait()
        try:
            for _ in range(requests):
                t0 = time.perf_counter()
                s.submit(obs, False)
                s.result(4)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    replies[i] += 1
        finally:
            s.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    server.close()
    lat = np.array(latencies) * 1000
    print("\n| streams | requests | wall s | p50 ms | p99 ms | max ms | fewest replies per stream |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {num_streams} | {len(lat)} | {wall:.1f} | {np.percentile(lat, 50):.1f} | {np.percentile(lat, 99):.1f} "
        f"| {lat.max():.1f} | {min(replies)} of {requests} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0, help="measuring time per cell")
    ap.add_argument("--only", default="actions,weights,streams")
    ap.add_argument("--models", default="", help="comma-separated substrings of policy names for 'actions'")
    args = ap.parse_args()
    torch.set_num_threads(1)
    parts = args.only.split(",")
    if "actions" in parts:
        bench_actions(args.seconds, [m for m in args.models.split(",") if m])
    if "weights" in parts:
        bench_weights()
    if "streams" in parts:
        bench_streams()


if __name__ == "__main__":
    main()
