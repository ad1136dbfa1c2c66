"""The run report's console line (services/coordinator/report.py): the update's columns follow the algorithm."""

from __future__ import annotations

from rlfleet.config import load_config
from rlfleet.config.views import coordinator_view
from services.coordinator.report import RunReport


def test_progress_line_shows_the_algorithms_own_metrics(tmp_path):
    ppo = RunReport(coordinator_view(load_config("pandapickcube_ppo")), tmp_path / "ppo", quiet=True)
    m = {"train/actor/policy_loss": -0.0123, "train/critic/value_loss": 0.5, "train/actor/approx_kl": 0.002}
    line = ppo.progress_line(0, m, 1024, 3.0, 0)
    assert "policy_loss -0.012" in line and "value_loss 0.500" in line and "kl 0.0020" in line

    sac = RunReport(coordinator_view(load_config("pandapickcube_sac")), tmp_path / "sac", quiet=True)
    m = {"train/critic/loss": 0.25, "train/critic/q_mean": 3.5, "train/alpha": 0.05, "replay/size": 2048.0}
    line = sac.progress_line(0, m, 2048, 3.0, 0)
    assert "critic_loss 0.250" in line and "q +3.50" in line and "alpha 0.050" in line and "replay 2048" in line
    assert "policy_loss" not in line and "kl" not in line
    # an epoch before learning_starts has no update metrics yet: dashes, not a crash
    assert "critic_loss -" in sac.progress_line(0, {"replay/size": 256.0}, 256, 1.0, 0)
