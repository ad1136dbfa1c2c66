"""The sizes rlfleet accepts from a peer (issue 33), in one place: what an env server's Describe, Reset and Step
replies may claim, checked where the claim enters the process and before anything is allocated for it
(docs/env-contract.md#limits lists them for simulator authors).

A peer's claim is a number in a message: ``EnvSpec.num_envs``, a space's shape, a tensor's shape, a count of
strings or episodes. Building what it describes (a list per env, an array per space, a batch of actions) is
where a lying or broken peer costs gigabytes, so every consumer (the run's bridge to an external simulator,
``coordinatorctl start``'s check of external servers, ``coordinatorctl check-env``, the tensor codec) checks the
claim first, and a claim past a limit is refused in one line naming the peer, the field, the limit and the
claimed value (:func:`check`: an ``rlfleet.untrusted.TooLarge``; the codec's own refusals are ``CodecError``).

The outer bound of everything is gRPC's message limit (:data:`MAX_MESSAGE_BYTES`, the channels' own): a reply
larger than it is refused by gRPC before rlfleet sees it, and one below it is parsed whole by protobuf before any
check can run, so a reply near the limit costs a few times its size for the moment it takes to refuse it.

Overrides, for the limits a real simulator could legitimately exceed (they are marked so below): set the
environment variable ``RLFLEET_<NAME>`` (e.g. ``RLFLEET_MAX_ENVS=131072``) for ``coordinatorctl start``,
``check-env`` and the services (children inherit it), or assign the module constant
(``rlfleet.wire.limits.MAX_ENVS = ...``) in a process of your own: every check reads it when it runs. The other
limits are not overridable: nothing real comes near them.

numpy-free and import-light (the codec, which runs in simulator environments, imports it).
"""

from __future__ import annotations

import os
import sys

from rlfleet.untrusted import BadFile, TooLarge, check_count

MiB = 1 << 20

#: the gRPC message limit of rlfleet's channels and servers (rlfleet.wire.channels, rlfleet.wire.servers): a Reset of
#: every env answers them all in one message, and a Step request carries one action row per stepped env
MAX_MESSAGE_BYTES = 256 * MiB


def _env_int(name: str, default: int) -> int:
    """``RLFLEET_<name>`` when set (an override), else ``default``."""
    raw = os.environ.get(f"RLFLEET_{name}")
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        raise ValueError(
            f"RLFLEET_{name}={raw!r}: expected a positive integer (an override of rlfleet.wire.limits.{name})"
        ) from None
    if value < 1:
        raise ValueError(f"RLFLEET_{name}={raw!r}: expected a positive integer")
    return value


# --- overridable: a real simulator could legitimately exceed these ------------------------------------------------
#: envs one env server hosts (EnvSpec.num_envs): a GPU simulator runs thousands; rlfleet keeps a few objects per env
MAX_ENVS = _env_int("MAX_ENVS", 65_536)
#: elements of one observation entry of one env (a space's shape): 2**24, a 2048 x 2048 x 4 image
MAX_SPACE_ELEMENTS = _env_int("MAX_SPACE_ELEMENTS", 1 << 24)
#: elements of one env's action of one control step (robots have tens; a musculoskeletal model hundreds)
MAX_ACTION_ELEMENTS = _env_int("MAX_ACTION_ELEMENTS", 1 << 16)
#: bytes of one env's observation (all entries together), and of one env's longest action chunk
MAX_ENV_STEP_BYTES = _env_int("MAX_ENV_STEP_BYTES", 64 * MiB)
#: control steps of one episode (EnvSpec.max_episode_steps): evaluation steps an episode up to it, and films it
MAX_EPISODE_STEPS = _env_int("MAX_EPISODE_STEPS", 1_000_000)

# --- fixed ----------------------------------------------------------------------------------------------------------
#: sub-steps of one action chunk (EnvSpec.max_action_chunk): policies act in chunks of 1 to ~50
MAX_ACTION_CHUNK = 1024
#: fixed initial states (EnvSpec.num_reset_states): a state id stays an int32 index
MAX_RESET_STATES = (1 << 31) - 1
#: observation entries (EnvSpec.observation_space keys; the entries of a Reset or Step reply's maps)
MAX_OBS_ENTRIES = 256
#: entries of any TensorMap the codec decodes (rollouts, forward inputs, observations)
MAX_TENSOR_MAP_ENTRIES = 4096
#: dimensions of a space or a tensor (numpy's own limit is 64)
MAX_DIMS = 32
#: elements of one received tensor (a batch); its bytes are bounded by MAX_MESSAGE_BYTES as well
MAX_TENSOR_ELEMENTS = 1 << 31
#: characters of a name: env_id, simulator, incarnation, contract_version, an observation entry's key
MAX_NAME_CHARS = 256
#: characters of one instruction (task_descriptions, Reset/Step instructions, EpisodeStats.instruction)
MAX_INSTRUCTION_CHARS = 16_384

OVERRIDABLE = ("MAX_ENVS", "MAX_SPACE_ELEMENTS", "MAX_ACTION_ELEMENTS", "MAX_ENV_STEP_BYTES", "MAX_EPISODE_STEPS")
DOC = "docs/env-contract.md#limits"


def limit(name: str) -> int:
    """The limit ``name`` as it is now (a module constant may have been reassigned)."""
    return getattr(sys.modules[__name__], name)


def named(name: str) -> str:
    """How a refusal names the limit ``name``: its value's constant and, where there is one, its override."""
    where = f"rlfleet.wire.limits.{name}"
    return f"{where}, override with RLFLEET_{name}" if name in OVERRIDABLE else where


def check(
    source: str, what: str, value, name: str = "", *, cap: int | None = None, per: str = "", minimum: int = 0
) -> int:
    """``value`` (a count a peer claims) as an int in ``[minimum, limit]``, else
    :class:`~rlfleet.untrusted.TooLarge` (above) or :class:`~rlfleet.untrusted.BadFile` (not an int, below): one
    line naming ``source`` (the peer and its message), the field ``what``, the limit and the claimed value. The
    limit is the constant ``name``, or ``cap`` (a bound the request itself sets, e.g. the rows it asked for);
    ``per`` says what it counts ("per env", "for 4 stepped rows")."""
    bound = limit(name) if cap is None else cap
    try:
        return check_count(what, value, bound, source=source, minimum=minimum)
    except TooLarge:
        expected = f"at most {bound:,}" + (f" {per}" if per else "") + (f" ({named(name)})" if name else "")
        raise TooLarge(source, what, expected, f"{int(value):,}") from None


def check_chars(source: str, what: str, text: str, name: str = "MAX_NAME_CHARS") -> str:
    """A string a peer sent, refused past ``name`` characters (the message shows its length, not the string)."""
    if len(text) > limit(name):
        raise TooLarge(
            source, what, f"a string of at most {limit(name):,} characters ({named(name)})", f"{len(text):,} characters"
        )
    return text


# --- a reply's counts, read from its bytes before protobuf builds anything -----------------------------------------
#: wire records (fields, packed elements) one reply may hold: protobuf builds an object or an 8-byte slot for each,
#: so a message of tiny records costs up to ~50x its size once parsed; a legit reply has a few per env
MAX_WIRE_RECORDS = 1 << 20


class Rule:
    """How :func:`scan` counts one field of a message (``name``; ``unit`` says what its records are): at most
    ``limit`` records (the constant of that name) or ``cap`` records (a bound the request sets; ``per`` says
    which), its content scanned by the nested ``rules`` when it is a message, or its elements counted when it is
    ``packed`` (repeated varints). ``keyed``: a map's entries, named in messages by their key."""

    def __init__(
        self,
        name: str,
        limit: str = "",
        *,
        unit: str = "",
        cap: int | None = None,
        per: str = "",
        rules: dict | None = None,
        packed: bool = False,
        keyed: bool = False,
    ):
        self.name, self.limit, self.unit, self.cap, self.per = name, limit, unit, cap, per
        self.rules, self.packed, self.keyed = rules, packed, keyed


def _join(path: str, name: str) -> str:
    return name if not path else path if not name else f"{path}.{name}"


def _key(buf, start: int, end: int) -> str:
    """A map entry's key (its field 1, a string), shortened, for messages."""
    try:
        key, pos = _varint(buf, start, end)
        if key != 0x0A:
            return "?"
        size, pos = _varint(buf, pos, end)
        return bytes(buf[pos : min(pos + size, pos + 40, end)]).decode("utf-8", "replace")
    except ValueError:
        return "?"


_LOW = bytes(range(128))


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("a truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def scan(data: bytes, rules: dict[int, Rule], source: str, what: str = "") -> None:
    """Count the records of a serialized protobuf message's fields named in ``rules`` (field number -> Rule)
    without parsing it, and refuse (TooLarge: ``source``, the field, the limit, the count) a field with more
    records than its rule allows, or a message with more than MAX_WIRE_RECORDS records in all. What is not
    counted here is left to protobuf and the checks after it (a malformed message is left to the parser too)."""
    budget = [limit("MAX_WIRE_RECORDS")]
    try:
        _scan(memoryview(data), 0, len(data), rules, source, what, budget)
    except ValueError as exc:
        if isinstance(exc, BadFile):
            raise
        return  # not a valid message: the parser says so in its own words


def _bound(rule: Rule) -> int | None:
    return rule.cap if rule.cap is not None else (limit(rule.limit) if rule.limit else None)


def _scan(buf, pos: int, end: int, rules: dict, source: str, path: str, budget: list) -> None:
    counts: dict[int, int] = {}
    over = None  # the first field past its bound: counted to the end of this message (the claim), then refused
    while pos < end:
        if budget[0] <= 0:
            if over is not None:
                break
            raise TooLarge(
                source,
                path or "message",
                f"at most {limit('MAX_WIRE_RECORDS'):,} wire records ({named('MAX_WIRE_RECORDS')})",
                "more",
            )
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        budget[0] -= 1
        if wire == 0:
            _, pos = _varint(buf, pos, end)
            continue
        if wire in (1, 5):
            pos += 8 if wire == 1 else 4
            continue
        if wire != 2:
            raise ValueError("a group or an unknown wire type")
        size, pos = _varint(buf, pos, end)
        start, pos = pos, pos + size
        if pos > end:
            raise ValueError("a field longer than its message")
        rule = rules.get(number)
        if rule is None:
            continue
        n = 1
        if rule.packed:
            chunk = bytes(buf[start:pos])
            n = len(chunk) - len(chunk.translate(None, _LOW))  # each varint ends in a byte below 0x80
            budget[0] -= n
        counts[number] = counts.get(number, 0) + n
        bound = _bound(rule)
        if over is None and bound is not None and counts[number] > bound:
            over = number
        if over is None and rule.rules:
            inner = _join(path, rule.name)
            if rule.keyed:
                inner = f"{inner}['{_key(buf, start, pos)}']"
            _scan(buf, start, pos, rule.rules, source, inner, budget)
    if over is not None:
        rule = rules[over]
        ref = f" ({named(rule.limit)})" if rule.cap is None and rule.limit else ""
        what = _join(path, rule.name) + (f" ({rule.unit})" if rule.unit else "")
        raise TooLarge(
            source,
            what,
            f"at most {_bound(rule):,}" + (f" {rule.per}" if rule.per else "") + ref,
            f"{counts[over]:,}" + (" or more" if budget[0] <= 0 else ""),
        )


__all__ = [
    "BadFile",
    "TooLarge",
    "check",
    "check_chars",
    "limit",
    "named",
    "MAX_MESSAGE_BYTES",
    "MAX_ENVS",
    "MAX_SPACE_ELEMENTS",
    "MAX_ACTION_ELEMENTS",
    "MAX_ENV_STEP_BYTES",
    "MAX_EPISODE_STEPS",
    "MAX_ACTION_CHUNK",
    "MAX_RESET_STATES",
    "MAX_OBS_ENTRIES",
    "MAX_TENSOR_MAP_ENTRIES",
    "MAX_DIMS",
    "MAX_TENSOR_ELEMENTS",
    "MAX_NAME_CHARS",
    "MAX_INSTRUCTION_CHARS",
    "MAX_WIRE_RECORDS",
    "Rule",
    "scan",
]
