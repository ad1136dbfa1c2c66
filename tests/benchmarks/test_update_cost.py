"""benchmarks/update_cost.py: the learner's update alone, its pieces, and the floor its matrix products set."""

from __future__ import annotations

import pathlib
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import update_cost  # noqa: E402


def test_the_matrix_products_are_counted_layer_by_layer():
    _, model, *_ = update_cost.setup(["actor.model.hidden_dims=[8,8]"])
    obs = model.actor_mean[0].in_features  # PandaPickCube-v0's state
    action = model.actor_mean[-1].out_features

    def net(out):  # forward 2 x rows x in x out per layer; backward twice that, once for the first layer
        return 2 * (obs * 8 * 2 + 8 * 8 * 3 + 8 * out * 3)

    assert update_cost.matmul_flops(model, 1) == net(action) + net(1)
    assert update_cost.matmul_flops(model, 10) == 10 * update_cost.matmul_flops(model, 1)


def test_the_table_times_the_default_update_and_its_pieces(capsys):
    torch.set_num_threads(1)
    assert update_cost.main(["--updates", "3", "--repeat", "8"]) == 0
    out = capsys.readouterr().out
    assert "1,024 rows, 5 passes of 2 minibatches of 512 = 10 optimizer steps" in out, out
    for part in ("whole update", "per optimizer step", "the actor's forward and backward", "Adam step"):
        row = [line for line in out.splitlines() if line.startswith(f"| {part}")]
        assert row, out
        assert all(float(x) > 0 for x in re.findall(r"([\d.]+) (?:ms|us)", row[0])), row
    assert re.search(r"matrix products: \d+ GFLOP/s on one core", out), out
    skipped = [line for line in out.splitlines() if line.startswith("| whole update, the critic's half skipped")]
    assert len(skipped) == (1 if "critic apart from the actor: yes" in out else 0), out
    helper_rows = [line for line in out.splitlines() if "critic's half on a second thread instead" in line]
    assert len(helper_rows) == (1 if "yes, in a helper process" in out else 0), out


def test_overrides_reach_the_update(capsys):
    assert update_cost.main(["--updates", "2", "--repeat", "4", "algorithm.update_epoch=3"]) == 0
    assert "3 passes of 2 minibatches of 512 = 6 optimizer steps" in capsys.readouterr().out
