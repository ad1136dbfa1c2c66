"""Bytecode ahead of time for what rlfleet's processes import (scripts/install.sh, scripts/test.sh).

    .venv/bin/python scripts/bytecode.py        # the modules a run's services import (~10 s on 2 cores, once per install)
    .venv/bin/python scripts/bytecode.py --all  # every module of .venv and of this checkout (~30 s; the test suite's)

Where ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines set it) Python never writes a ``.pyc``, and an
installer that does not compile (uv, by default) leaves none: every process then compiles what it imports from
source, ~4 s for ``import torch`` here against ~1.7 s from bytecode, in every service of every run (the default
run's services came up in 10.8 s without bytecode, 4.7 s with it). The flag only stops the writing; Python reads the
bytecode written here. Files already compiled (bytecode newer than the source) are left alone.
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import importlib.util
import os
import pathlib
import py_compile
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's packages (the services are not installed modules)
# what a run's processes import: the services' entry points, the learner's warm-up (services/learner/warmup.py),
# the policy families and the default simulator (MuJoCo through gymnasium)
ENTRY_MODULES = (
    "services.coordinator.cli",
    "services.learner.server",
    "services.env.server",
    "services.inference.server",
    "services.env.backends.gym_backend",
    "services.env.envs.panda_pick_cube",
    "torch._dynamo",
    "rlfleet.policies.models.actor_critic",
    "rlfleet.policies.models.sac",
    "rlfleet.policies.models.openvla",
    "rlfleet.policies.models.openpi",
)


def _stale(source: str) -> str | None:
    """``source``'s bytecode path when that is missing or older than the source, else None."""
    try:
        cached = importlib.util.cache_from_source(source)
    except (NotImplementedError, ValueError):
        return None
    try:
        if os.stat(cached).st_mtime >= os.stat(source).st_mtime:
            return None
    except OSError:
        pass
    return cached


def _compile(job: tuple[str, str]) -> bool:
    source, cached = job
    try:
        py_compile.compile(source, cfile=cached, doraise=True)
        return True
    except (py_compile.PyCompileError, OSError):
        return False  # a file Python cannot compile or a folder it cannot write: imported from source as before


def loaded_sources(modules=None) -> list[str]:
    """The source files of every module that importing ``modules`` (None: :data:`ENTRY_MODULES`) loads (one that
    fails to import is named on stderr and left out)."""
    for name in ENTRY_MODULES if modules is None else modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional dependency missing: what it would load is skipped
            print(f"[bytecode] {name}: not imported ({type(exc).__name__}: {exc})", file=sys.stderr)
    files = set()
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if isinstance(path, str) and path.endswith(".py") and os.path.isfile(path):
            files.add(os.path.realpath(path))
    return sorted(files)


def compile_loaded(workers: int) -> tuple[int, int]:
    jobs = [(s, c) for s in loaded_sources() if (c := _stale(s)) is not None]
    with ProcessPoolExecutor(workers) as pool:
        done = sum(pool.map(_compile, jobs, chunksize=64))
    return done, len(jobs)


def compile_all(workers: int) -> None:
    """Every module under this environment's site-packages and this checkout's packages (a file that does not
    compile, e.g. a template, stays source: Python reports it only if something imports it)."""
    folders = [sysconfig.get_paths()["purelib"], *(str(ROOT / p) for p in ("rlfleet", "services", "tests"))]
    for folder in dict.fromkeys(folders):
        if os.path.isdir(folder):
            compileall.compile_dir(folder, quiet=2, workers=workers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every module of the environment and the checkout")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    workers = max(1, len(os.sched_getaffinity(0)))
    if args.all:
        compile_all(workers)
        print(f"[bytecode] every module compiled in {time.perf_counter() - t0:.0f} s")
    else:
        done, stale = compile_loaded(workers)
        print(f"[bytecode] {done} of {stale} modules compiled in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
