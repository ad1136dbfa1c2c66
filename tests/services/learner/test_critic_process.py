"""The critic's helper process (services/learner/critic_process.py): the same steps as one thread, bit for bit; a
helper that dies or fails hands its work back to the learner's thread without changing a number; it ends with its
learner however the learner ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from rlfleet.config.views import learner_view
from services.learner import critic_process
from services.learner.critic_process import OLD_DTYPE, unsupported
from services.learner.learner import Learner
from tests.services.learner.test_learner import SPECS, fake_rollout

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or unsupported(nn.Module()) == "no memfd_create (not Linux)",
    reason="one core or no memfd: the critic stays on the update's thread",
)


def _gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` has exited (reaped, or a zombie) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _train(cfg, run_dir, *, process: bool | None, epochs: int = 3, meddle=None):
    """A learner trained ``epochs`` epochs with the critic in its helper process (``process`` True; waited for
    before the first update), on a second thread (False) or on the update's own thread (None) -> (statistics,
    weights, the helper or None). ``meddle(helper)``: done to the helper before training."""
    cfg.cluster.learner_num_threads = 1 if process is None else None
    cfg.cluster.learner_critic_process = bool(process)
    le = Learner(learner_view(cfg), run_dir)
    le.setup(SPECS, 4)
    helper = le.algorithm.trainer.critic_process
    assert (helper is not None) == bool(process)
    if helper is not None:
        assert helper.wait_ready(60.0), helper.failed
        if meddle is not None:
            meddle(helper)
    stats = []
    try:
        for epoch in range(epochs):
            tm, pe, eps = fake_rollout(seed=epoch)
            le.rollouts.receive(epoch, 0, tm, pe, eps)
            m = le.train(epoch, [0])
            assert m["train/optimizer_steps"] > 1
            stats.append({k: v for k, v in m.items() if k.startswith("train/")})
        weights = {k: v.clone() for k, v in le.model.state_dict().items()}
    finally:
        le.close()
    return stats, weights, helper


def _same(a, b) -> None:
    (stats_a, w_a, _), (stats_b, w_b, _) = a, b
    assert stats_a == stats_b
    assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_b)


@pytest.mark.parametrize("kl_beta,micro", [(0.0, None), (0.1, None), (0.0, 32)])
def test_the_critic_in_its_helper_process_takes_the_same_steps(cfg, tmp_path, kl_beta, micro):
    """Every statistic and every weight of three updates is the same bit for bit with the critic's half in the
    helper process as on one thread, with a KL penalty too, and with two micro batches per step (the helper's
    gradients accumulate over them)."""
    cfg.algorithm.kl_beta = kl_beta
    if micro:
        cfg.actor.global_batch_size, cfg.actor.micro_batch_size = 2 * micro, micro
    helped = _train(cfg, tmp_path / "helper", process=True)
    helper = helped[2]
    assert helper.steps > 0 and helper.failed is None  # it really took the critic's halves
    _same(helped, _train(cfg, tmp_path / "one", process=None))


def test_a_helper_killed_mid_step_leaves_the_same_steps(cfg, tmp_path, caplog):
    """kill -9 of the helper in the middle of a step (after the step's first micro batch, with its second in
    flight): that step's critic gradients are done again on the learner's thread, the update and the ones after it
    run there, and every number is the one one thread gives."""
    cfg.actor.global_batch_size, cfg.actor.micro_batch_size = 64, 32

    def kill_at_the_fourth(helper):
        submit = helper.submit

        def killing(*args, **kw):
            out = submit(*args, **kw)
            if helper.steps == 4:  # the second micro batch of the second step
                os.kill(helper.pid, signal.SIGKILL)
            return out

        helper.submit = killing

    helped = _train(cfg, tmp_path / "helper", process=True, meddle=kill_at_the_fourth)
    helper = helped[2]
    assert helper.steps == 4 and helper.failed is not None, helper.failed
    assert "exited with code -9" in helper.failed
    assert any("critic's helper process" in r.getMessage() for r in caplog.records)
    _same(helped, _train(cfg, tmp_path / "one", process=None))


def test_a_micro_batch_the_helper_fails_is_done_on_the_thread(cfg, tmp_path):
    """A helper that raises on a micro batch (here: a dtype code it does not know) reports the error, which the
    learner names, and the learner's thread takes over with the same numbers."""

    def bad_code_on_the_second(helper):
        submit = helper.submit

        def sending(features, old_values, returns, weights, first):
            if helper.steps != 1:
                return submit(features, old_values, returns, weights, first)
            # the second micro batch as submit sends it, but for its old values' dtype code, out of range
            v, n = helper._views, len(features)
            v.features[:n].copy_(features)
            v.ctl[critic_process.ROWS], v.ctl[critic_process.FIRST], v.ctl[OLD_DTYPE] = n, int(first), 7
            helper._seq += 1
            v.ctl[critic_process.GO] = helper._seq
            return helper

        helper.submit = sending

    helped = _train(cfg, tmp_path / "helper", process=True, meddle=bad_code_on_the_second)
    helper = helped[2]
    assert helper.failed is not None and "failed on a micro batch: IndexError" in helper.failed, helper.failed
    _same(helped, _train(cfg, tmp_path / "one", process=None))


_ORPHAN = textwrap.dedent(
    """
    import sys, time
    from torch import nn
    from rlfleet.policies.models.activations import Tanh
    from services.learner.critic_process import CriticProcess
    helper = CriticProcess()
    helper.attach(nn.Sequential(nn.Linear(3, 4), Tanh(), nn.Linear(4, 1)), 8, value_clip=None,
                  huber_delta=None, value_loss_coef=0.5)
    assert helper.wait_ready(60.0), helper.failed
    if sys.argv[1] == "spinning":
        helper.begin()  # an update under way: the helper spins on the control block
    print(helper.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("state", ["sleeping", "spinning"])
def test_the_helper_ends_when_its_learner_is_killed(state):
    """kill -9 of the learner: a helper asleep between updates reads the end of its pipe, one spinning in an
    update sees its parent gone; either exits within seconds."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    learner = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, state],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=root),
    )
    try:
        pid = int(learner.stdout.readline())
        assert not _gone(pid, 0.3)  # alive, and (spinning) busy
        learner.send_signal(signal.SIGKILL)
        learner.wait()
        assert _gone(pid, 10.0), f"the helper {pid} outlived its learner ({state})"
    finally:
        learner.kill()


def test_the_helper_ends_with_its_learner(cfg, tmp_path):
    """Learner.close() stops the helper."""
    le = Learner(learner_view(cfg), tmp_path / "run")
    le.setup(SPECS, 4)
    helper = le.algorithm.trainer.critic_process
    assert helper is not None and helper.wait_ready(60.0)
    le.close()
    assert _gone(helper.pid, 5.0)


def test_what_stays_on_the_thread(cfg, tmp_path):
    """No helper where the critic is not apart (one thread), where the config says so, or for a critic the helper
    cannot rebuild (named)."""
    assert "Sigmoid" in unsupported(type("P", (), {"critic": nn.Sequential(nn.Linear(3, 4), nn.Sigmoid())})())
    assert "float16" in unsupported(type("P", (), {"critic": nn.Sequential(nn.Linear(3, 4).half())})())
    assert "autocast" in unsupported(type("P", (), {"autocast_dtype": torch.bfloat16, "critic": None})())
    for key, value in (("learner_num_threads", 1), ("learner_critic_process", False)):
        c = cfg.copy()
        setattr(c.cluster, key, value)
        le = Learner(learner_view(c), tmp_path / key)
        le.setup(SPECS, 4)
        assert le.algorithm.trainer.critic_process is None
        le.close()
