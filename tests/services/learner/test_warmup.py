"""services/learner/warmup.py: the first setup's optimizer import and the first checkpoint's, done on a thread ahead
of the setup."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

from services.learner import checkpoint, warmup

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_the_warm_up_imports_what_the_first_optimizer_imports_and_the_setup_waits_for_it():
    code = (
        "import sys, torch; from services.learner import warmup\n"
        "assert 'torch._dynamo' not in sys.modules, 'the learner imports torch._dynamo on its own now'\n"
        "warmup.start(); warmup.wait()\n"
        "assert 'torch._dynamo' in sys.modules\n"
        "before = set(sys.modules)\n"
        "torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=1e-3)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"  # the first optimizer imports nothing the warm-up left out


def test_after_the_warm_up_the_first_checkpoint_imports_nothing(tmp_path):
    """The first checkpoint (epoch runner.save_interval) used to import torch.distributed.checkpoint mid-training."""
    code = (
        "import pathlib, sys, torch; from services.learner import warmup, checkpoint\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'the learner imports the checkpoint on its own'\n"
        "warmup.start(); warmup.wait()\n"
        "model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "model(torch.ones(1, 3)).sum().backward(); opt.step()\n"
        "before = set(sys.modules)\n"
        f"checkpoint.save_sharded(pathlib.Path({str(tmp_path)!r}), model, opt)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
    assert (tmp_path / checkpoint.STATE_DIR).is_dir()  # the checkpoint was written


def test_a_failed_warm_up_import_is_a_warning_and_the_setup_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(warmup, "MODULES", ("rlfleet_no_such_module",))
    monkeypatch.setattr(warmup, "_thread", None)
    with caplog.at_level(logging.WARNING, "rlfleet.learner.warmup"):
        warmup.start()
        warmup.wait()
    assert "importing rlfleet_no_such_module failed" in caplog.text
