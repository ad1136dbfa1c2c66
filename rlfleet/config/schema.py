"""The schema's own words: every key of the embedded default (``rlfleet/configs/pandapickcube_ppo.yaml``, and the
policy families' size groups, each in its YAML: ``rlfleet.config.schema_sources``) with its default and its one-line
comment, read from the YAML text itself.

The typed views (``views.py``) take each field's doc from here and the configuration page's reference
(``docs.py``) is generated from it, so the comment in the YAML is the one place a key is described.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlfleet.config import FREE_FORM, default_schema, schema_sources

_LINE = re.compile(r"^(?P<indent> *)(?P<key>[^\s#:][^:#]*):(?P<rest>.*)$")


@dataclass(frozen=True)
class SchemaKey:
    """One key of the schema: its dotted path, its default as the YAML gives it, its comment, and whether it is a
    group (a mapping of further keys) rather than a value."""

    path: str
    default: object
    comment: str
    group: bool = False


def _split_comment(rest: str) -> tuple[str, str]:
    """' value   # comment' -> ('value', 'comment'): the comment starts at the first '#' after whitespace."""
    m = re.search(r"(^|\s)#\s?", rest)
    if not m:
        return rest.strip(), ""
    return rest[: m.start()].strip(), rest[m.end() :].strip()


@functools.lru_cache(maxsize=None)
def schema_keys() -> tuple[SchemaKey, ...]:
    """Every group and key of the schema in file order (a free-form map is one key; what the default puts inside it
    is its default)."""
    tree = default_schema()
    out: list[SchemaKey] = []
    for prefix, source in schema_sources():  # the default, then each policy family's size group (its own YAML)
        text = source.read_text()
        stack: list[tuple[int, str]] = [(-1, prefix)] if prefix else []  # (indent, path) of the open groups
        part: list[SchemaKey] = []
        if prefix:  # the group itself, described by its file's first comment line
            head = text.splitlines()[0] if text.startswith("#") else ""
            part.append(SchemaKey(prefix, None, head.lstrip("#").strip(), True))
        for line in text.splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            indent, key = len(m.group("indent")), m.group("key").strip()
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            if any(parent == f or parent.startswith(f + ".") for f in FREE_FORM):
                continue  # the default's items inside a free-form map
            path = f"{parent}.{key}" if parent else key
            _, comment = _split_comment(m.group("rest"))
            node = OmegaConf.select(tree, path)
            group = isinstance(node, DictConfig) and path not in FREE_FORM
            default = OmegaConf.to_container(node) if isinstance(node, (DictConfig, ListConfig)) else node
            part.append(SchemaKey(path, None if group else default, comment, group))
            stack.append((indent, path))
        parent = prefix.rsplit(".", 1)[0] if prefix else ""
        at = max((i + 1 for i, k in enumerate(out) if k.path.startswith(parent + ".")), default=len(out))
        out[at:at] = part  # a size group in its parent group's place (actor.model), after its keys
    return tuple(out)


@functools.lru_cache(maxsize=None)
def comments() -> dict[str, str]:
    """Dotted path -> the schema's comment on it (groups included)."""
    return {k.path: k.comment for k in schema_keys()}


def comment(path: str) -> str:
    """The schema's comment on ``path``; KeyError for a key the schema does not have."""
    return comments()[path]
