"""scripts/bytecode.py: bytecode written ahead for the modules an import loads, read back by a process that may not
write any (PYTHONDONTWRITEBYTECODE), and left alone once up to date."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _package(tmp_path: pathlib.Path) -> pathlib.Path:
    pkg = tmp_path / "src" / "bcpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from bcpkg import used\n")
    (pkg / "used.py").write_text("VALUE = 42\n")
    (pkg / "unused.py").write_text("VALUE = 0\n")
    (pkg / "broken_template.py").write_text("def (:\n")
    return pkg


def _run(code: str, tmp_path: pathlib.Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "src"), "PYTHONDONTWRITEBYTECODE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_modules_an_import_loads_get_bytecode_that_a_process_reads(tmp_path):
    pkg = _package(tmp_path)
    compile_code = (
        "import sys; sys.path.insert(0, 'scripts'); import bytecode\n"
        "bytecode.ENTRY_MODULES = ('bcpkg', 'bcpkg_missing')\n"
        "print(bytecode.compile_loaded(2))\n"
    )
    proc = _run(compile_code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    done, stale = eval(proc.stdout.strip().splitlines()[-1])
    assert done == stale and done >= 2  # bcpkg/__init__, bcpkg/used (and whatever else was not compiled yet)
    assert "bcpkg_missing: not imported (ModuleNotFoundError" in proc.stderr
    cached = {p: pathlib.Path(importlib.util.cache_from_source(str(pkg / p))) for p in ("__init__.py", "used.py")}
    assert all(c.is_file() for c in cached.values())
    assert not pathlib.Path(importlib.util.cache_from_source(str(pkg / "unused.py"))).exists()
    # a process that may not write bytecode loads it from the cache
    read = _run(
        "import bcpkg.used as u; print(u.__spec__.cached, u.__spec__.loader.get_code('bcpkg.used') is not None)",
        tmp_path,
    )
    assert read.returncode == 0 and read.stdout.split()[0] == str(cached["used.py"]), read.stderr
    # up to date: nothing to compile the second time
    again = _run(compile_code, tmp_path)
    assert eval(again.stdout.strip().splitlines()[-1]) == (0, 0), again.stdout


def test_a_file_that_does_not_compile_stays_source(tmp_path):
    pkg = _package(tmp_path)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bytecode
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    bad = str(pkg / "broken_template.py")
    cached = bytecode._stale(bad)
    assert cached is not None and not bytecode._compile((bad, cached)) and not os.path.exists(cached)
    good = str(pkg / "used.py")
    assert bytecode._compile((good, bytecode._stale(good))) and bytecode._stale(good) is None
