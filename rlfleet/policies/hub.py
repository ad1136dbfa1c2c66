"""``actor.model.model_path`` as users write it: a local folder, or a model id on the Hugging Face hub.

    model_path: /data/openvla-7b               # a folder: used as it is
    model_path: openvla/openvla-7b             # a hub id (org/name): its snapshot in the local hub cache
    model_path: openvla/openvla-7b@<revision>  # a branch, tag or commit of it

A hub id resolves through ``huggingface_hub``'s cache and download API (``snapshot_download``): the snapshot
folder in the hub cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub). With
``HF_HUB_OFFLINE=1`` only the cache is read; otherwise a model missing from the cache is downloaded into it. A
model that cannot be resolved is a FileNotFoundError naming the id, the cache folder and the command that
downloads it. A revision must be a git ref (:func:`check_revision`: git check-ref-format's rules, so no ``..``
and nothing that names a path of its own) and the snapshot folder it resolves to must lie inside the hub cache
(a ``refs/<branch>`` file of the cache names the commit folder, so that is checked too).
:func:`resolve_model_path` is the one place every reader of ``model_path`` goes through (the VLA and
π0 loaders, the footprint estimate, the coordinator's preflight), and, with ``repo_type="dataset"``, of
``sft.dataset_path`` (a LeRobot dataset id such as ``lerobot/pusht``: ``datasets--org--name`` in the same cache).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlfleet.untrusted import BadFile, OutsideRoot, inside

KEY = "actor.model.model_path"
# org/name[@revision], as the hub spells ids (letters, digits, '-', '_', '.'; no leading '.' or '-'); the revision
# is whatever follows the '@', checked by check_revision
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>.*))?$", re.S)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")  # control characters, space, ~ ^ : ? * [ \\
MAX_REVISION = 255


def check_revision(revision: str, *, key: str = KEY, hub_id: str | None = None) -> str:
    """``revision`` when it is a git ref name (a branch, a tag, ``refs/pr/N``) or a 40-hex commit, by git
    check-ref-format's rules: no ``..``, no ``@{``, not ``@``, no control character, space, ``~^:?*[\\``; no
    leading or trailing ``/``, no ``//``, no component that starts with ``.`` or ends with ``.lock``, no trailing
    ``.``. Otherwise a :class:`BadFile` (a ValueError) naming ``key`` and what was wrong."""
    where = f"{key}: {hub_id}" if hub_id else key

    def bad(why: str):
        return BadFile(
            where, "revision", f"a git ref (branch, tag, refs/pr/N) or a 40-hex commit, {why}", repr(revision)[:80]
        )

    if not isinstance(revision, str) or not revision:
        raise bad("not empty")
    if _COMMIT.match(revision):
        return revision
    if len(revision) > MAX_REVISION:
        raise bad(f"at most {MAX_REVISION} characters")
    if _REF_FORBIDDEN.search(revision):
        raise bad("without control characters, space or any of ~^:?*[\\")
    if ".." in revision:
        raise bad("without '..'")
    if "@{" in revision or revision == "@":
        raise bad("without '@{' and not '@'")
    if revision.startswith("/") or revision.endswith("/") or "//" in revision:
        raise bad("without a leading or trailing '/' or '//'")
    if revision.endswith("."):
        raise bad("not ending in '.'")
    for part in revision.split("/"):
        if part.startswith(".") or part.endswith(".lock"):
            raise bad("without a component that starts with '.' or ends with '.lock'")
    return revision


def parse_hub_id(model_path: str, *, key: str = KEY) -> tuple[str, str | None] | None:
    """(repo id, revision or None) where ``model_path`` is written as a hub id, else None. A hub id whose revision
    is not a git ref (``org/name@../../etc``) is a ValueError naming ``key`` (check_revision)."""
    text = str(model_path)
    m = _HUB_ID.match(text)
    if m is None or text.startswith(("./", "../")) or ".." in m.group("repo").split("/"):
        return None
    revision = m.group("revision")
    if revision is not None:
        check_revision(revision, key=key, hub_id=m.group("repo"))
    return m.group("repo"), revision


def hub_cache_dir() -> str:
    """The hub cache folder huggingface_hub reads now (HF_HUB_CACHE / HF_HOME, read at call time)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_path(
    model_path: str | os.PathLike | None, *, download: bool | None = None, key: str = KEY, repo_type: str = "model"
) -> str | None:
    """The local folder ``model_path`` names: itself when it is a folder, a hub id's snapshot folder in the hub
    cache (downloaded first when it is not cached, ``download`` is not False and HF_HUB_OFFLINE is not set), None
    for None / "". Anything else: FileNotFoundError (or ValueError) saying which, naming ``key``. ``repo_type``:
    "model", or "dataset" for a dataset id (``sft.dataset_path``)."""
    if model_path is None or str(model_path) == "":
        return None
    text = str(model_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    hub = parse_hub_id(text, key=key)
    if hub is None or path.exists() or text.startswith(("/", "~")):
        what = "not a folder" if path.exists() else "no such folder"
        raise FileNotFoundError(f"{key}: {text}: {what} (give a {repo_type} folder, or a hub id org/name[@revision])")
    repo_id, revision = hub
    cache = hub_cache_dir()
    local_only = _offline() or download is False
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    try:
        snapshot = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=local_only, repo_type=repo_type
        )
    except HFValidationError as exc:
        raise ValueError(f"{key}: {text}: not a valid hub id ({exc})") from None
    except LocalEntryNotFoundError:
        where = f" at revision {revision}" if revision else ""
        why = "HF_HUB_OFFLINE is set, so only the cache is read" if _offline() else "not downloaded here"
        raise FileNotFoundError(
            f"{key}: hub {repo_type} '{repo_id}'{where} is not in the hub cache {cache} ({why}; no folder {text} "
            f"here either); download it where the "
            f"network allows: hf download {repo_id}{kind}"
            + (f" --revision {revision}" if revision else "")
            + f" --cache-dir {cache} (or give a local {repo_type} folder)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - unknown repo, gated repo, no network: say which id and why
        raise FileNotFoundError(
            f"{key}: hub {repo_type} '{repo_id}'"
            + (f"@{revision}" if revision else "")
            + f" could not be resolved ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            f"hub cache {cache}; download it where the network allows: hf download {repo_id}{kind} "
            f"--cache-dir {cache} (or give a local {repo_type} folder)"
        ) from None
    return _inside_cache(snapshot, cache, repo_id, repo_type, key)


def _inside_cache(snapshot: str, cache: str, repo_id: str, repo_type: str, key: str) -> str:
    """``snapshot`` when it is a folder inside the repo's own ``snapshots/`` of the hub cache (symbolic links
    followed): a cache's ``refs/<branch>`` file names the commit folder, and it may name ``../..``."""
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type=repo_type) / "snapshots"
    what = f"{key}: the snapshot of '{repo_id}' (refs/ of the hub cache name it)"
    rel = os.path.relpath(os.path.abspath(snapshot), os.path.abspath(snapshots))
    resolved = inside(snapshots, rel, what=what, source=snapshots)  # '..', or a link out of the cache: refused
    if rel in (".", "") or not resolved.is_dir():
        raise OutsideRoot(snapshots, what, f"a commit folder inside {snapshots}", snapshot)
    return snapshot
