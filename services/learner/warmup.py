"""One-time work of the learner's first setup, done ahead on a thread while the other services start.

The learner builds its policy and optimizer inside the coordinator's first ``PublishWeights``, while every other
service waits for the weights (the coordinator's start-up line: "first weights set"). torch.optim's first
optimizer imports ``torch._dynamo`` (``Optimizer.__init__`` is wrapped in ``torch._disable_dynamo``): about a second
of this machine's CPU, most of the default run's first weights set. The first checkpoint (epoch
``runner.save_interval``) imports ``torch.distributed.checkpoint``: ~0.2 s in the middle of training, every run.
``start()`` runs these imports on a thread once the learner serves (the env servers are then still building their
simulators); ``wait()``, first thing in the learner's setup, joins it, so the thread never imports beside another
import of this process's setup.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger("rlfleet.learner.warmup")

# modules the first setup and the first checkpoint import that the learner's start does not: torch.optim's first
# optimizer's import, then the distributed checkpoint's (services/learner/checkpoint.py)
MODULES = (
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint._fsspec_filesystem",  # what dcp.save imports for a path given as a string
    "torch.utils.serialization",
)

_thread: threading.Thread | None = None


def _import_all() -> None:
    t0 = time.perf_counter()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the setup imports it again and reports what fails there
            log.warning("warm-up: importing %s failed (%s); the setup or the first checkpoint imports it", name, exc)
    log.debug("warm-up: %s imported in %.2f s", ", ".join(MODULES), time.perf_counter() - t0)


def start() -> None:
    """Import :data:`MODULES` on a daemon thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_import_all, name="learner-warm-up", daemon=True)
        _thread.start()


def wait() -> None:
    """Until the warm-up (if started) is done."""
    if _thread is not None:
        _thread.join()
