"""The learner as a rank group on torch.distributed (gloo on this CPU), run as real processes under torchrun:
N ranks compute the update one process computes (float64, 1e-6), and fail to when gradients are not synchronised;
each rank holds half the parameter and optimizer bytes; sharded checkpoints resume at another world size; a rank
killed with -9 ends the group, naming it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.learner.batch import env_blocks
from services.learner.group import GROUP_BROKEN, _pack, _unpack

pytestmark = pytest.mark.slow
SCENARIOS = str(Path(__file__).with_name("rank_scenarios.py"))
ROOT = Path(__file__).resolve().parents[3]


def run_ranks(n: int, out: Path, scenario: str = "update", **opts) -> dict:
    """``scenario`` of rank_scenarios.py on ``n`` ranks (torchrun, standalone) -> rank 0's result.json."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        SCENARIOS,
        scenario,
        str(out),
        *[f"{k}={v}" for k, v in opts.items()],
    ]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a rank that aborts prints where each of its threads was
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "state.safetensors")), load_file(str(b / "state.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


@pytest.mark.parametrize("model", ["mlp", "oft_lora", "pi0"])
def test_two_ranks_take_the_step_one_process_takes(tmp_path, model):
    """One epoch's update (several minibatches, micro batches, a masked sample; MLP: 5 envs split 3 / 2) on 2
    ranks equals the same update in 1 process, in float64."""
    one = run_ranks(1, tmp_path / "one", model=model, float64=1)
    two = run_ranks(2, tmp_path / "two", model=model, float64=1)
    assert two["world"] == 2 and one["world"] == 1
    assert max_diff(tmp_path / "one", tmp_path / "two") < 1e-6
    m1, m2 = one["metrics"][0], two["metrics"][0]
    assert m1["train/optimizer_steps"] == m2["train/optimizer_steps"] >= 1
    assert abs(m1["train/loss"] - m2["train/loss"]) < 1e-6
    assert m2["train/learner_ranks"] == 2.0


def test_export_gathers_the_sharded_policy_on_rank_0(tmp_path):
    """Learner.export on 2 ranks writes the released layout (upstream, OpenVLA's; LoRA merged) of the whole policy:
    loaded back through actor.model.model_path it acts like the trained (sharded, LoRA) policy."""
    from rlfleet.policies import build_policy
    from tests.services.learner.rank_scenarios import config, rollout

    run_ranks(2, tmp_path / "two", model="oft_lora", export=1)
    export = tmp_path / "two" / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    cfg, specs, action_dim = config("oft_lora", tmp_path, [])
    trained = build_policy(cfg.actor.model, specs, action_dim, True, cfg.algorithm.logprob_type)
    trained.load_state_dict(load_file(str(tmp_path / "two" / "state.safetensors")))
    cfg_exp, _, _ = config("oft_lora", tmp_path, [f"actor.model.model_path={export}", "actor.model.is_lora=false"])
    exported = build_policy(cfg_exp.actor.model, specs, action_dim, True, cfg.algorithm.logprob_type)
    tm, _, _ = rollout(cfg, specs, action_dim, 2, 4, seed=7)
    obs = {k[4:]: torch.as_tensor(v).flatten(0, 1) for k, v in tm.items() if k.startswith("obs.")}
    fi = {k[3:]: torch.as_tensor(v).flatten(0, 1) for k, v in tm.items() if k.startswith("fi.")}
    with torch.no_grad():
        a, b = trained.evaluate(obs, fi).log_probs, exported.evaluate(obs, fi).log_probs
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


def test_without_gradient_sync_the_equivalence_check_fails(tmp_path):
    """The check above can fail: the same update with FSDP's gradient synchronisation off differs by far more."""
    run_ranks(1, tmp_path / "one", float64=1)
    run_ranks(2, tmp_path / "unsynced", float64=1, no_sync=1)
    assert max_diff(tmp_path / "one", tmp_path / "unsynced") > 1e-4


def test_each_rank_holds_half_the_parameter_and_optimizer_bytes(tmp_path):
    """Measured from each rank's own tensors (a DTensor counts its local shard), after an update."""
    one = run_ranks(1, tmp_path / "one", model="oft_lora")["memory"][0]
    two = run_ranks(2, tmp_path / "two", model="oft_lora")["memory"]
    for kind in ("parameters", "optimizer"):
        assert one[kind] > 0
        for rank in two:  # FSDP2 pads a dimension that does not split evenly: within 2% of half
            assert abs(rank[kind] - one[kind] / 2) <= 0.02 * one[kind], (kind, rank, one)


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2), (2, 2)])
def test_sharded_checkpoint_resumes_at_another_world_size(tmp_path, saved, resumed):
    """Save after epoch 0, resume, train epoch 1: the same weights as training both epochs without saving."""
    run_ranks(2, tmp_path / "straight", float64=1, epochs=2)
    run_ranks(saved, tmp_path / "saved", "save", float64=1, epochs=1)
    shards = sorted(p.name for p in (tmp_path / "saved" / "run" / "checkpoints" / "global_step_1" / "state").iterdir())
    assert len([s for s in shards if s.endswith(".distcp")]) == saved
    result = run_ranks(resumed, tmp_path / "resumed", "resume", float64=1, epochs=2, resume=tmp_path / "saved" / "run")
    assert result["epoch"] == 1 and len(result["metrics"]) == 1  # it went on from epoch 1
    assert max_diff(tmp_path / "straight", tmp_path / "resumed") < 1e-9


def test_env_blocks_balance_samples_and_never_split_a_group():
    assert env_blocks(5, 2, 1, np.ones(5)) in ([range(0, 3), range(3, 5)], [range(0, 2), range(2, 5)])
    # groups of 4: 3 groups over 2 ranks; the heavy first group alone on rank 0
    blocks = env_blocks(12, 2, 4, np.array([8] * 4 + [1] * 8))
    assert blocks == [range(0, 4), range(4, 12)]
    assert all(b.start % 4 == 0 and b.stop % 4 == 0 for b in blocks)
    with pytest.raises(Exception, match="too few to give each of the learner's 4 ranks one"):
        env_blocks(8, 4, 4, np.ones(8))


def test_tensors_cross_ranks_as_bytes_not_pickle():
    tensors = {
        "a": torch.randn(3, 4, dtype=torch.float64),
        "m": torch.tensor([True, False]),
        "b": torch.randn(2).to(torch.bfloat16),
        "e": torch.zeros(0, 5),
        "i": torch.arange(6).reshape(2, 3),
    }
    layout, buf = _pack(tensors)
    assert buf.dtype == torch.uint8 and json.dumps(layout)  # a JSON layout and raw bytes
    back = _unpack(json.loads(json.dumps(layout)), buf)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_hand(tmp_path: Path, sleep: float) -> list[subprocess.Popen]:
    """Two ranks started with torchrun's variables set by hand (no agent to end the group for them)."""
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCENARIOS, "idle", str(tmp_path / "out"), f"sleep={sleep}", "hb=3"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _wait_joined(procs, tmp_path: Path) -> None:
    end = time.monotonic() + 60
    while not (tmp_path / "out" / "ready").exists():
        assert time.monotonic() < end and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.1)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_ends_the_group_naming_it(tmp_path, victim):
    """kill -9 of one rank: the other leaves within the heartbeat timeout (3 s here) instead of waiting forever
    in a collective, and says which rank is gone."""
    procs = _by_hand(tmp_path, sleep=120)
    try:
        _wait_joined(procs, tmp_path)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        other = procs[1 - victim]
        out, _ = other.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
        assert other.returncode == GROUP_BROKEN, out
        assert "the rank group is broken" in out
        if victim == 1:
            assert "learner rank 1 sent no heartbeat" in out
        else:
            assert "rank 0" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
