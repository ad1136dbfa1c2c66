"""One-time work of the learner's first setup, done ahead on a thread while the other services start.

The learner builds its policy and optimizer inside the coordinator's first ``PublishWeights``, while every other
service waits for the weights (the coordinator's start-up line: "first weights set"). torch.optim's first
optimizer imports ``torch._dynamo`` (``Optimizer.__init__`` is wrapped in ``torch._disable_dynamo``): about a second
of this machine's CPU, most of the default run's first weights set. ``start()`` runs that import on a thread once
the learner serves (the env servers are then still building their simulators); ``wait()``, first thing in the
learner's setup, joins it, so the thread never imports beside another import of this process's setup.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger("rlfleet.learner.warmup")

# modules the first setup imports that the learner's start does not: torch.optim's first optimizer's import
MODULES = ("torch._dynamo",)

_thread: threading.Thread | None = None


def _import_all() -> None:
    t0 = time.perf_counter()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the setup imports it again and reports what fails there
            log.warning("warm-up: importing %s failed (%s); the first setup imports it", name, exc)
            return
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
