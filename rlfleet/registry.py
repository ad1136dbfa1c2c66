"""Layer 0 of rlfleet: the lookup every registry uses (simulators, policies, inference backends, env backends, gym
ids, config keys). It imports nothing of rlfleet, so every layer may use it.

A registry is a plain ``{name: value}`` table owned by the layer that defines the names; :func:`lookup` finds a name
in one and, for a name that is not there, raises :class:`UnknownName` with the closest known name ("did you mean")
and the list of known names. Values that name code ("package.module:Name") are loaded with :func:`load_object`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


class UnknownName(KeyError):
    """A name that is not in a registry; ``str()`` is the whole message (not KeyError's quoted repr)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name closest to ``name`` (difflib's ratio >= ``cutoff``), or None."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.6, close: str | None = None) -> str:
    """ "; did you mean 'x'?" for the closest known name (or ``close``, found by the caller), "" when none is."""
    close = close if close is not None else closest(name, known, cutoff)
    return f"; did you mean '{close}'?" if close else ""


def unknown_message(kind: str, name: str, known: Iterable[str]) -> str:
    """ "unknown KIND 'name'; did you mean 'x'? (known: a, b, c)"."""
    known = list(known)
    return f"unknown {kind} '{name}'{did_you_mean(name, known)} (known: {', '.join(known)})"


def lookup(table: Mapping[str, T], name: str, kind: str) -> T:
    """``table[name]``, or :class:`UnknownName` saying what ``kind`` of name was not found."""
    try:
        return table[name]
    except KeyError:
        raise UnknownName(unknown_message(kind, name, table)) from None


def load_object(ref: str):
    """'package.module:Name' -> the object."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
