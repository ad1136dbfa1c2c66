"""The learner as 1 and 2 ranks on this CPU (gloo): memory per rank, time per update, rank 0's memory in a publish.

    python -m benchmarks.learner_ranks [--models mlp oft_lora pi0 oft_full] [--ranks 1 2] [--epochs 5]
                                       [--publish-model oft_big] [--bucket-mb 4]

Each row starts the learner's ranks with torchrun (as `coordinatorctl start` does), sets them up with a model, and
trains ``--epochs`` updates on fixed rollouts made by acting with the same policy (tests/services/learner/
rank_scenarios.py). Measured on each rank: the bytes of the policy's parameters and of Adam's state it holds (a
DTensor counts its local shard); on rank 0: the wall time of ``Learner.train`` (median over the epochs after the
first). Two ranks on 2 cores share them with each other (and with anything else running): the time column says what
this machine does, not what two GPUs do.

The publish rows start a real inference server (its own process) and publish a larger policy (``--publish-model``)
to it, whole and in buckets of ``--bucket-mb``: rank 0's resident memory is sampled every 2 ms during the publish,
and the table gives its peak above the level just before the publish, against the policy's size (after one
untimed publish in which the server builds its model).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {  # name -> (rank_scenarios model, extra overrides, what it is)
    "mlp": (
        "mlp",
        [
            "actor.model.hidden_dims=[128,128]",
            "actor.micro_batch_size=512",
            "actor.global_batch_size=512",
            "algorithm.update_epoch=5",
        ],
        "MLP PPO (the default run's sizes)",
    ),
    "oft_lora": ("oft_lora", [], "OpenVLA-OFT tiny, GRPO, LoRA r4"),
    "oft_full": ("oft_lora", ["actor.model.is_lora=false"], "OpenVLA-OFT tiny, GRPO, full fine-tune"),
    "pi0": ("pi0", [], "π0 tiny, PPO"),
    # publish: a larger OpenVLA-OFT (Llama 8 x 1024) so the buckets matter
    "oft_big": (
        "oft_lora",
        [
            "actor.model.is_lora=false",
            "actor.model.vla.llm_hidden_size=1024",
            "actor.model.vla.llm_layers=8",
            "actor.model.vla.llm_intermediate_size=2048",
            "actor.model.vla.llm_heads=8",
            "actor.model.vla.llm_kv_heads=8",
            "actor.model.vla.vocab_size=8192",
        ],
        "OpenVLA-OFT, Llama 8 x 1024",
    ),
}
MB = 2**20


def rss() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(out: pathlib.Path, model: str, epochs: int, publish: list[int]) -> None:
    """One rank (under torchrun): set up, train, measure; rank 0 writes out/result.json."""
    import torch

    torch.set_num_threads(1)
    from rlfleet.config import to_yaml
    from rlfleet.config.views import learner_view
    from services.learner.group import RankGroup
    from services.learner.learner import Learner
    from tests.services.learner.rank_scenarios import config, rollout

    name, extra, _ = MODELS[model]
    cfg, specs, action_dim = config(name, out, extra)
    group = RankGroup.from_environ(timeout_s=600, heartbeat_timeout_s=60)
    learner = Learner(learner_view(cfg), out / "run", group=group)
    if not group.is_leader:
        learner.follow()
        learner.close()
        return
    T, N = (16, 64) if name == "mlp" else (8, 8)
    learner.setup(specs, action_dim)
    times = []
    for epoch in range(epochs):
        learner.rollouts.receive(epoch, 0, *rollout(cfg, specs, action_dim, T, N, seed=epoch))
        t0 = time.perf_counter()
        learner.train(epoch, [0])
        times.append(time.perf_counter() - t0)
    result = {"memory": learner.memory(), "train_s": times, "samples": T * N, "world": group.world}
    if publish:
        cfg_path = out / "inference.yaml"
        cfg_path.write_text(to_yaml(cfg))
        server = subprocess.Popen(
            [sys.executable, "-m", "services.inference.server", "--config", str(cfg_path), "--address", "127.0.0.1:0"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            line = server.stdout.readline()
            address = re.search(r"serving on (\S+)", line).group(1)
            size = sum(p.numel() * p.element_size() for p in learner.model.parameters())  # DTensor: global size
            learner.publish([address], full=True)  # warm-up: the server builds its model on the first full set
            rows = []
            for bucket_mb in publish:
                cfg.actor.weights_bucket_mb = bucket_mb
                learner.publisher.synced.clear()  # a full set each time
                peak, stop = [0], threading.Event()

                def sample():
                    while not stop.is_set():
                        peak[0] = max(peak[0], rss())
                        time.sleep(0.002)

                import gc

                gc.collect()
                base = rss()
                t = threading.Thread(target=sample, daemon=True)
                t.start()
                t0 = time.perf_counter()
                sent = learner.publish([address], full=True)
                took = time.perf_counter() - t0
                stop.set()
                t.join()
                rows.append({"bucket_mb": bucket_mb, "peak_above_base": peak[0] - base, "sent": sent, "s": took})
            result["publish"] = {"model_bytes": size, "rows": rows}
        finally:
            server.kill()
    (out / "result.json").write_text(json.dumps(result))
    learner.close()


def run(world: int, model: str, epochs: int, publish: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(pathlib.Path(__file__).resolve()),
            "--worker",
            str(out),
            model,
            str(epochs),
            ",".join(map(str, publish)),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{model} on {world} rank(s) failed:\n{proc.stderr[-4000:]}")
        return json.loads((out / "result.json").read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, model, epochs, publish = sys.argv[2:6]
        worker(pathlib.Path(out), model, int(epochs), [int(b) for b in publish.split(",") if b])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp", "oft_lora", "oft_full", "pi0"], choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--epochs", type=int, default=5, help="updates per row (the first is not timed)")
    ap.add_argument("--publish-model", default="oft_big", choices=list(MODELS), help="'' to skip the publish rows")
    ap.add_argument("--bucket-mb", type=int, default=4, help="the bucketed publish's actor.weights_bucket_mb")
    args = ap.parse_args()
    print(f"learner ranks on this machine ({os.cpu_count()} cores, gloo); median over updates 2..{args.epochs}\n")
    print("| model | ranks | samples/update | params MB per rank | Adam state MB per rank | s per update |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        for world in args.ranks:
            r = run(world, model, args.epochs, [])
            per = " / ".join(f"{m['parameters'] / MB:.2f}" for m in r["memory"])
            opt = " / ".join(f"{m['optimizer'] / MB:.2f}" for m in r["memory"])
            t = statistics.median(r["train_s"][1:]) if len(r["train_s"]) > 1 else r["train_s"][0]
            print(f"| {MODELS[model][2]} | {world} | {r['samples']} | {per} | {opt} | {t:.3f} |", flush=True)
    if args.publish_model:
        print(
            f"\nrank 0's memory while publishing {MODELS[args.publish_model][2]} to a real inference server "
            f"(peak resident memory above the level before the publish)\n"
        )
        print("| ranks | policy MB | actor.weights_bucket_mb | rank 0 peak above base MB | sent MB | s |")
        print("|---|---|---|---|---|---|")
        for world in args.ranks:
            r = run(world, args.publish_model, 1, [100000, args.bucket_mb])
            p = r["publish"]
            for row in p["rows"]:
                label = "whole (one bucket)" if row["bucket_mb"] >= 100000 else str(row["bucket_mb"])
                print(
                    f"| {world} | {p['model_bytes'] / MB:.0f} | {label} | {row['peak_above_base'] / MB:.0f} | "
                    f"{row['sent'] / MB:.0f} | {row['s']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
