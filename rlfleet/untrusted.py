"""Layer 0 of rlfleet: reading what a user brings from elsewhere (run folders, checkpoints, model folders, datasets,
configs, hub caches) as hostile until checked. It imports nothing of rlfleet, so every layer may use it.

The rules every reader of user-supplied files follows, in one place:

- **Paths stay inside their root.** :func:`inside` joins a root and a path a file supplied (a dataset's
  ``video_path`` template, a checkpoint's shard name, an index's shard file), resolves symbolic links, and refuses
  anything that ends up outside the root (``..``, an absolute path, a link out of the folder). :func:`regular_file`
  is the same for a file a caller names directly (``config.yaml`` of a run folder).
- **Sizes are checked before anything is allocated.** :func:`read_bytes`, :func:`read_json` and
  :func:`read_yaml` refuse files larger than their limit before reading them; :func:`safetensors_header` reads
  only a safetensors file's header, bounded, and checks every tensor's offsets against the file's real size;
  :func:`check_count` bounds a number a file or a peer claims (elements, envs, rows).
- **Nothing is unpickled, nothing is constructed from a tag.** JSON is JSON; YAML is read by a safe loader that
  also refuses anchors and aliases (no alias bombs: rlfleet never writes them) and ``!!python`` tags.
- **One line per bad file.** Every refusal is a :class:`BadFile`: the file, the field, what was expected and,
  where it helps, what was found ("runs/x/config.yaml: line 3: expected YAML, found ..."). It is a ValueError, so
  a service maps it to INVALID_ARGUMENT and a CLI prints it as one line.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
MAX_JSON_BYTES = 64 * MiB  # learner_state.json, info.json, stats.json, config.json, an index's weight map
MAX_YAML_BYTES = 4 * MiB  # a run's config.yaml (a resolved config is a few KB)
MAX_SAFETENSORS_HEADER = 100 * MiB  # what the safetensors library itself accepts
MAX_JSON_DEPTH = 64

# bytes per element of the dtypes a safetensors header may name (the format's own list)
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "F6_E2M3": 1,
    "F6_E3M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


class BadFile(ValueError):
    """A file (or a part of one) that is not what it must be. ``str()`` is one line: the file, the field, what was
    expected and what was found. ``path``, ``field``, ``expected`` and ``found`` keep the parts."""

    def __init__(self, path: str | os.PathLike, field: str, expected: str, found: str | None = None):
        self.path, self.field, self.expected, self.found = str(path), field, expected, found
        super().__init__(f"{self.path}: {field}: expected {expected}" + (f", found {found}" if found else ""))

    def __reduce__(self):  # picklable with its parts (torch.distributed gathers a rank's exception to the others)
        return type(self), (self.path, self.field, self.expected, self.found)


class OutsideRoot(BadFile):
    """A path a file or a user supplied that leaves the folder it must stay in (``..``, absolute, a symlink out)."""


class TooLarge(BadFile):
    """A size a file or a peer claims beyond what rlfleet accepts (checked before anything is allocated)."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def inside(
    root: str | os.PathLike, relative: str | os.PathLike, *, what: str = "path", source: str | os.PathLike | None = None
) -> pathlib.Path:
    """``root / relative`` resolved (symbolic links followed), refused with :class:`OutsideRoot` unless it stays
    inside ``root`` (itself resolved). ``what`` names the field that supplied ``relative`` and ``source`` the file
    it came from (default: ``root``), for the message. The file need not exist yet."""
    base = pathlib.Path(root).resolve()
    text = os.fspath(relative)
    if "\x00" in text:
        raise OutsideRoot(source or root, what, "a path without NUL bytes", _short(text))
    if os.path.isabs(text):
        raise OutsideRoot(source or root, what, f"a path relative to {base}", f"the absolute path {_short(text)}")
    target = (base / text).resolve()
    if target != base and not target.is_relative_to(base):
        link = " (through a symbolic link)" if ".." not in pathlib.PurePath(text).parts else ""
        raise OutsideRoot(source or root, what, f"a path inside {base}", f"{_short(text)} -> {target}{link}")
    return target


def regular_file(
    path: str | os.PathLike, *, root: str | os.PathLike | None = None, what: str = "file", max_bytes: int | None = None
) -> pathlib.Path:
    """``path`` checked to be a regular file (not a folder, fifo or device), inside ``root`` when given (a
    symbolic link that leaves it is refused), no larger than ``max_bytes`` when given. Returns it resolved.
    A missing file is FileNotFoundError naming it."""
    p = pathlib.Path(path)
    if root is not None:
        resolved = inside(root, os.path.relpath(os.path.abspath(p), os.path.abspath(root)), what=what, source=p)
    else:
        resolved = p.resolve()
    if not resolved.exists():
        raise FileNotFoundError(f"{p}: {what}: no such file")
    if not resolved.is_file():
        raise BadFile(p, what, "a regular file", "a folder" if resolved.is_dir() else "a special file")
    if max_bytes is not None:
        size = resolved.stat().st_size
        if size > max_bytes:
            raise TooLarge(p, what, f"at most {max_bytes:,} bytes", f"{size:,} bytes")
    return resolved


def read_bytes(
    path: str | os.PathLike, max_bytes: int, *, root: str | os.PathLike | None = None, what: str = "file"
) -> bytes:
    """A file's bytes, refused (before reading) when it is larger than ``max_bytes`` or leaves ``root``."""
    resolved = regular_file(path, root=root, what=what, max_bytes=max_bytes)
    with open(resolved, "rb") as f:
        # read(n) allocates n bytes up front: ask for what the file holds, not for the limit
        data = f.read(min(max_bytes, os.fstat(f.fileno()).st_size) + 1)
        while len(data) <= max_bytes:  # it grew while we read: go on, bounded
            more = f.read(min(max_bytes + 1 - len(data), 1 << 16))
            if not more:
                break
            data += more
    if len(data) > max_bytes:  # it grew while we looked
        raise TooLarge(path, what, f"at most {max_bytes:,} bytes", "more")
    return data


def _depth(value: Any, limit: int, depth: int = 0) -> int:
    if depth > limit:
        return depth
    if isinstance(value, dict):
        return max([_depth(v, limit, depth + 1) for v in value.values()], default=depth)
    if isinstance(value, list):
        return max([_depth(v, limit, depth + 1) for v in value], default=depth)
    return depth


def parse_json(
    data: bytes | str,
    path: str | os.PathLike,
    *,
    what: str = "JSON",
    expect: type | tuple[type, ...] | None = dict,
    allow_infinity: bool = False,
) -> Any:
    """JSON text from ``path`` parsed, or :class:`BadFile` naming the file, the position and what was wrong.
    NaN and Infinity are refused (not JSON; ``allow_infinity``: Python's ``Infinity``/``-Infinity`` are taken, for
    files rlfleet writes with unbounded spaces' bounds); nesting deeper than MAX_JSON_DEPTH is refused; the top
    level must be ``expect`` (a JSON object by default)."""

    def no_constant(name):
        if allow_infinity and name in ("Infinity", "-Infinity"):
            return float(name.replace("Infinity", "inf"))
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(data, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise BadFile(path, f"line {exc.lineno} column {exc.colno}", what, exc.msg) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadFile(path, what, "valid UTF-8 JSON", str(exc)[:120] or type(exc).__name__) from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadFile(path, what, f"JSON nested at most {MAX_JSON_DEPTH} deep", "deeper")
    if expect is not None and not isinstance(value, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        names = names.replace("dict", "a JSON object").replace("list", "a JSON array")
        raise BadFile(path, "top level", names, type(value).__name__)
    return value


def read_json(
    path: str | os.PathLike,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    root: str | os.PathLike | None = None,
    what: str = "JSON",
    expect: type | tuple[type, ...] | None = dict,
    allow_infinity: bool = False,
) -> Any:
    """A JSON file read through :func:`read_bytes` (bounded, inside ``root``) and :func:`parse_json`."""
    return parse_json(
        read_bytes(path, max_bytes, root=root, what=what), path, what=what, expect=expect, allow_infinity=allow_infinity
    )


_LOADER = None


def _plain_loader():
    """PyYAML's SafeLoader read the way OmegaConf reads configs: ``1e-5`` is a float (YAML 1.2; PyYAML alone
    reads it as a string), dates stay strings."""
    global _LOADER
    if _LOADER is None:
        import re

        import yaml

        class PlainLoader(yaml.SafeLoader):
            pass

        PlainLoader.yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        PlainLoader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
            list("-+0123456789."),
        )
        _LOADER = PlainLoader
    return _LOADER


def parse_yaml(text: str, path: str | os.PathLike, *, what: str = "YAML") -> Any:
    """YAML text parsed by PyYAML's safe loader, refusing anchors/aliases (an alias bomb expands exponentially;
    rlfleet never writes them) and any tag outside the plain YAML types (``!!python/object`` and friends).
    Errors are :class:`BadFile` naming the file and the line."""
    import yaml

    where = lambda mark: f"line {mark.line + 1} column {mark.column + 1}" if mark else what  # noqa: E731
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, (yaml.AnchorToken, yaml.AliasToken)):
                raise BadFile(
                    path,
                    where(token.start_mark),
                    "YAML without anchors or aliases ('&name', '*name')",
                    f"{'an anchor' if isinstance(token, yaml.AnchorToken) else 'an alias'} '{token.value}'",
                )
            if isinstance(token, yaml.TagToken):
                handle, suffix = token.value
                tag = (handle or "") + (suffix or "")
                if not (handle == "!!" and suffix in {"str", "int", "float", "bool", "null", "map", "seq"}):
                    raise BadFile(path, where(token.start_mark), "plain YAML values (no tags)", f"the tag '{tag}'")
        return yaml.load(text, Loader=_plain_loader())  # noqa: S506 - a SafeLoader, tags refused above
    except BadFile:
        raise
    except yaml.MarkedYAMLError as exc:
        raise BadFile(path, where(exc.problem_mark), f"valid YAML ({exc.problem or exc.context})") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise BadFile(path, what, "YAML", f"{type(exc).__name__}: {str(exc)[:120]}") from None


def read_yaml(
    path: str | os.PathLike,
    *,
    max_bytes: int = MAX_YAML_BYTES,
    root: str | os.PathLike | None = None,
    what: str = "YAML",
) -> Any:
    """A YAML file read through :func:`read_bytes` (bounded, inside ``root``) and :func:`parse_yaml`."""
    data = read_bytes(path, max_bytes, root=root, what=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadFile(path, what, "UTF-8 text", f"byte {exc.start} is not") from None
    return parse_yaml(text, path, what=what)


def check_count(what: str, value: Any, limit: int, *, source: str | os.PathLike | None = None, minimum: int = 0) -> int:
    """``value`` as an int in ``[minimum, limit]``, else :class:`TooLarge` (above) or :class:`BadFile` (not an
    int, below). ``what`` names the field and ``source`` the file or peer that claimed it."""
    src = source if source is not None else "input"
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numbers

            if not isinstance(value, numbers.Integral):
                raise TypeError
            value = int(value)
        except TypeError:
            raise BadFile(src, what, "an integer", _short(value)) from None
    if value > limit:
        raise TooLarge(src, what, f"at most {limit:,}", f"{value:,}")
    if value < minimum:
        raise BadFile(src, what, f"at least {minimum:,}", f"{value:,}")
    return value


def safetensors_header(
    path: str | os.PathLike, *, root: str | os.PathLike | None = None, max_header: int = MAX_SAFETENSORS_HEADER
) -> dict[str, dict]:
    """A safetensors file's header, checked before any tensor is read: the header length fits the file and
    ``max_header``; it is a JSON object of ``name -> {dtype, shape, data_offsets}`` (plus ``__metadata__``, a map
    of strings); each dtype is known, each shape a list of non-negative ints, each tensor's byte range matches its
    dtype and shape and lies inside the file. Returns the tensor entries (``__metadata__`` left out); any problem
    is :class:`BadFile` naming the file and the tensor."""
    resolved = regular_file(path, root=root, what="safetensors file")
    size = resolved.stat().st_size
    with open(resolved, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadFile(path, "header length", "8 bytes (a safetensors file)", f"a {size}-byte file")
        (n,) = struct.unpack("<Q", head)
        if n > max_header or n > size - 8:
            raise TooLarge(
                path,
                "header length",
                f"at most {min(max_header, max(size - 8, 0)):,} bytes (the file has {size:,})",
                f"{n:,}",
            )
        raw = f.read(n)
    header = parse_json(raw, path, what="header")
    data_size = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise BadFile(path, "__metadata__", "a map of strings to strings", _short(entry))
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise BadFile(path, f"tensor '{_short(name, 60)}'", "{dtype, shape, data_offsets}", _short(entry))
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise BadFile(path, f"tensor '{name}' dtype", f"one of {sorted(SAFETENSORS_DTYPES)}", _short(dtype))
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise BadFile(path, f"tensor '{name}' shape", "a list of non-negative integers", _short(shape))
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise BadFile(path, f"tensor '{name}' data_offsets", "[begin, end] with 0 <= begin <= end", _short(offsets))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * SAFETENSORS_DTYPES[dtype]
        if dtype in ("F4",):
            nbytes = (numel + 1) // 2
        elif dtype in ("F6_E2M3", "F6_E3M2"):
            nbytes = (numel * 6 + 7) // 8
        if offsets[1] > data_size:
            raise TooLarge(
                path,
                f"tensor '{name}' data_offsets",
                f"inside the file's {data_size:,} data bytes",
                f"{offsets} (the file is truncated or the header lies)",
            )
        if offsets[1] - offsets[0] != nbytes:
            raise BadFile(
                path,
                f"tensor '{name}' data_offsets",
                f"{nbytes:,} bytes for {dtype} {shape}",
                f"{offsets[1] - offsets[0]:,}",
            )
        tensors[name] = entry
    return tensors


def folder_root(folder: str | os.PathLike) -> pathlib.Path:
    """The root a model or dataset folder's files must stay inside: the folder itself, or, for a snapshot of a
    Hugging Face hub cache (``<cache>/models--org--name/snapshots/<commit>``, ``datasets--`` alike), the repo's
    folder, whose ``blobs/`` the snapshot's files are symbolic links to. Not resolved (``inside`` resolves)."""
    p = pathlib.Path(os.path.abspath(folder))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return p.parent.parent
    return p


def in_folder(
    folder: str | os.PathLike,
    relative: str | os.PathLike,
    *,
    what: str = "path",
    source: str | os.PathLike | None = None,
) -> pathlib.Path:
    """``folder / relative`` for a file that ``folder``'s own metadata names (a template, an index's shard): by its
    own parts ``relative`` stays inside ``folder`` (not absolute, no ``..`` climbing out), and, its symbolic links
    followed, inside :func:`folder_root` (:class:`OutsideRoot` otherwise). Returns the resolved path."""
    text = os.fspath(relative)
    src = source or folder
    if "\x00" in text:
        raise OutsideRoot(src, what, "a path without NUL bytes", _short(text))
    if os.path.isabs(text) or os.path.normpath(text).split(os.sep)[0] == "..":
        raise OutsideRoot(src, what, f"a path inside {folder}", _short(text))
    root = folder_root(folder)
    return inside(root, os.path.relpath(os.path.join(os.path.abspath(folder), text), root), what=what, source=src)


def json_lines(path: str | os.PathLike, *, max_line: int = MiB):
    """The JSON objects of a JSON-lines file (``metrics.jsonl``, a trace export), read line by line so memory
    stays bounded whatever the file's size: a line that is not a JSON object (cut short by a kill, say) or longer
    than ``max_line`` bytes is skipped."""
    with open(path, "rb") as f:
        while True:
            line = f.readline(max_line + 1)
            if not line:
                return
            if len(line) > max_line and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of an overlong line
                    line = f.readline(max_line + 1)
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
