"""Inference backends compared (rollout.backend: hf | vllm): actions/s of the tiny OpenVLA policy (or a bigger one
given with --vla) through the InferenceEngine at batch 1, 8, 32, 64, sampled actions with per-row noise keys, as an
inference server acts for the env servers; and the seconds one full weights update takes (the learner's publish:
the hf backend loads its idle copy, the vllm backend also reloads vLLM's language model).

Each backend runs with its own environment's python (vllm: built on first use, like a run builds it); the table
is printed by the process you start.

    python benchmarks/inference_backends.py [--backends hf,vllm] [--seconds 3] [--batches 1,8,32,64]
        [--vla llm_layers=8,llm_hidden_size=1024,...] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(
    backend: str,
    batches: list[int],
    seconds: float,
    vla: list[str],
    threads: int,
    value: bool = True,
    keyed: bool = True,
) -> list[dict]:
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    from rlfleet.config import load_config
    from rlfleet.policies import build_policy
    from rlfleet.wire.spaces import TensorSpace
    from services.inference.engine import InferenceEngine

    cfg = load_config(
        "pandapickcube_vision_ppo_openvla_tiny",
        [f"rollout.backend={backend}", f"actor.model.add_value_head={value}", *[f"actor.model.vla.{kv}" for kv in vla]],
    )
    size = int(cfg.actor.model.vla.image_size)
    specs = {"third_person": TensorSpace((size, size, 3), "uint8"), "state": TensorSpace((18,), "float32")}
    torch.manual_seed(0)
    policy = build_policy(cfg.actor.model, specs, 4, True, "token_level")
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    engine = InferenceEngine(
        cfg.actor.model, logprob_type="token_level", backend=backend, max_batch_size=max(batches), seed=0
    )
    engine.start()
    t0 = time.perf_counter()
    engine.set_weights(0, state, obs_specs=specs, action_dim=4)
    first = time.perf_counter() - t0
    updates = []
    for v in (1, 2, 3):
        t0 = time.perf_counter()
        engine.set_weights(v, state, obs_specs=specs, action_dim=4)
        updates.append(time.perf_counter() - t0)
    rows = []
    rng = np.random.default_rng(0)
    params = sum(p.numel() for p in policy.parameters())
    for b in batches:
        obs = {
            "third_person": rng.integers(0, 256, (b, size, size, 3), dtype=np.uint8),
            "state": rng.standard_normal((b, 18)).astype(np.float32),
        }
        texts = ["pick up the red cube and lift it"] * b
        keys = np.arange(b, dtype=np.uint64)
        engine.act_now(obs, False, texts, keys if keyed else None)  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            engine.act_now(obs, False, texts, keys + np.uint64(n * b) if keyed else None)
            n += 1
        dt = (time.perf_counter() - t0) / n
        rows.append(
            {
                "backend": backend,
                "value": value,
                "keyed": keyed,
                "params": params,
                "batch": b,
                "actions_s": b / dt,
                "ms": dt * 1000,
                "first_update_s": first,
                "update_s": sorted(updates)[1],
            }
        )
    engine.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--vla", default="", help="actor.model.vla overrides, comma separated KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the measuring process")
    ap.add_argument("--no-value", action="store_true", help="no value head (GRPO): no transformers prefill for it")
    ap.add_argument("--no-keys", action="store_true", help="no per-row noise keys (unseeded sampling)")
    ap.add_argument("--json", action="store_true", help="print JSON rows (used when a backend runs in its env)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    vla = [kv for kv in args.vla.split(",") if kv]
    rows: list[dict] = []
    for backend in args.backends.split(","):
        from rlfleet.policies.backends import get_backend
        from rlfleet.simulators import environments

        env = get_backend(backend).environment
        python = (
            sys.executable if env is None else str(environments.ensure(env, log=lambda *a: print(*a, file=sys.stderr)))
        )
        here = env is None or os.path.samefile(os.path.dirname(os.path.dirname(python)), sys.prefix)
        if here or args.json:
            rows += measure(backend, batches, args.seconds, vla, args.threads, not args.no_value, not args.no_keys)
        else:  # in the backend's own environment
            child = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(args.threads)}
            child.pop("VIRTUAL_ENV", None)
            out = subprocess.run(
                [
                    python,
                    os.path.abspath(__file__),
                    "--backends",
                    backend,
                    "--batches",
                    args.batches,
                    "--seconds",
                    str(args.seconds),
                    "--vla",
                    args.vla,
                    "--threads",
                    str(args.threads),
                    "--json",
                    *(["--no-value"] if args.no_value else []),
                    *(["--no-keys"] if args.no_keys else []),
                ],
                env=child,
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            rows += json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"\nOpenVLA ({rows[0]['params'] / 1e6:.1f}M parameters), sampled actions, {args.threads} torch thread(s), "
        f"{'no value head' if args.no_value else 'value head'}, {'unseeded' if args.no_keys else 'per-row noise keys'}\n"
    )
    print(
        "| backend | batch | actions/s | ms per call | full weights update (s) | first update incl. engine build (s) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['batch']} | {r['actions_s']:,.1f} | {r['ms']:.1f} | {r['update_s']:.3f} | "
            f"{r['first_update_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
