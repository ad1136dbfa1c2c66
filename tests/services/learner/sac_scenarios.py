"""The SAC update on N learner ranks (real processes under torchrun, a real gloo group), for the equivalence test:

    python -m torch.distributed.run --standalone --nproc-per-node N tests/services/learner/sac_scenarios.py OUT_DIR

Every rank builds the same agent (float64, seed 0) and the same fixed global batch of 24 transitions (a state vector
and a 16x16 camera, with the actor's noise per row); rank r takes the rows i % N == r and runs STEPS updates. Rank 0
writes the agent's state (``state.safetensors``) and each step's metrics (``result.json``) to OUT_DIR.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
torch.set_num_threads(1)

from rlfleet.wire.service import exit_after  # noqa: E402
from rlfleet.wire.spaces import TensorSpace  # noqa: E402
from services.learner.group import RankGroup  # noqa: E402
from services.learner.sac import SacAgent, SacConfig, SacUpdate  # noqa: E402

SPECS = {"state": TensorSpace((6,), "float32"), "cam": TensorSpace((16, 16, 3), "uint8")}
ROWS, STEPS, ACTION = 24, 3, 3


def batch(step: int) -> dict[str, torch.Tensor]:
    g = np.random.default_rng(step)
    return {
        "obs.state": torch.from_numpy(g.standard_normal((ROWS, 6))),
        "obs.cam": torch.from_numpy(g.integers(0, 256, (ROWS, 16, 16, 3), dtype=np.uint8)),
        "next_obs.state": torch.from_numpy(g.standard_normal((ROWS, 6))),
        "next_obs.cam": torch.from_numpy(g.integers(0, 256, (ROWS, 16, 16, 3), dtype=np.uint8)),
        "action": torch.from_numpy(g.uniform(-1, 1, (ROWS, ACTION))),
        "reward": torch.from_numpy(g.standard_normal(ROWS)),
        "terminated": torch.from_numpy(g.random(ROWS) < 0.2),
        "noise": torch.from_numpy(g.standard_normal((ROWS, ACTION))),
        "next_noise": torch.from_numpy(g.standard_normal((ROWS, ACTION))),
    }


def main(out: pathlib.Path) -> None:
    group = RankGroup.from_environ()
    torch.manual_seed(0)
    agent = SacAgent(SPECS, ACTION, SacConfig(hidden_dims=(32, 32), layer_norm=True, tau=0.1)).double()
    update = SacUpdate(agent, all_reduce=group.all_reduce)
    rows = torch.arange(ROWS) % group.world == group.rank
    metrics = []
    for step in range(STEPS):
        mine = {k: v[rows] for k, v in batch(step).items()}
        metrics.append(update.step(mine, ROWS, update_actor=step != 1))  # step 1: the critics alone
    if group.is_leader:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in agent.state_dict().items()}, str(out / "state.safetensors"))
        (out / "result.json").write_text(json.dumps({"metrics": metrics, "world": group.world}))
    group.close()


if __name__ == "__main__":
    exit_after(lambda: main(pathlib.Path(sys.argv[1])) or 0)  # as the learner's ranks end (rank_scenarios.py: why)
