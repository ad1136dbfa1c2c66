"""The env contract's versions, and how rlfleet reads what a server of any of them sends (docs/env-contract.md).

proto3 does not send a field at its zero value, so a server written before a field existed cannot be told from
one that sets it to zero. Every field added after the first published contract therefore reads its zero value as
its documented default, and what changed meaning between versions is read by the version a server declares:

    EnvSpec.contract_version ''  -> version "0", the first published contract
    EnvSpec.max_action_chunk 0   -> 1 (no chunks)
    EnvSpec.max_step_streams 0   -> not stated: one stream (what rlfleet opens); no refusal is promised
    EnvSpec.num_reset_states 0   -> no fixed initial states
    EnvSpec.simulator ''         -> "external"
    version 0: StepResponse.final_observations has a row for every stepped env, the ended rows are those whose
               terminated or truncated is set (version 1 lists them in final_rows and sends only those rows);
               EpisodeStats.reset_state_id (absent then) reads as -1.

The env side's bridge to external servers, `coordinatorctl start`'s check of external servers and the conformance kit
(rlfleet.simulators.conformance) all read specs through this module, so they agree on every version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rlfleet.wire import codec

DOC = "docs/env-contract.md"
CURRENT = "1"
KNOWN_VERSIONS = ("0", "1")
DEFAULT_MAX_STEP_STREAMS = 1  # max_step_streams 0 (not stated): the one stream a bridge keeps open
#: gRPC metadata that asks a server to fail that Step stream's first request as a simulator crash would
#: (INTERNAL); optional for servers, used by `check-env`'s simulator_crash check (docs/env-contract.md#errors)
FAULT_METADATA = ("rlfleet-fault", "simulator-crash")

_ANCHORS = {  # section titles of docs/env-contract.md -> their anchors
    "versions": "versions",
    "tensors": "tensors",
    "describe": "describe",
    "reset": "reset",
    "step": "step",
    "chunks": "action-chunks",
    "final": "episode-end-and-final-observations",
    "instructions": "instructions",
    "close": "close",
    "streams": "streams-and-concurrency",
    "errors": "errors",
    "rlfleet": "what-rlfleet-does-with-your-server",
}


def section(name: str) -> str:
    """``docs/env-contract.md#anchor`` of a section (names above)."""
    return f"{DOC}#{_ANCHORS[name]}"


def version_of(spec) -> str:
    """The contract version a server declares ('' = "0", the first published contract)."""
    return spec.contract_version or "0"


@dataclass(frozen=True)
class View:
    """An EnvSpec as rlfleet reads it: zero values replaced by their documented defaults."""

    version: str
    num_envs: int
    max_episode_steps: int
    max_action_chunk: int
    max_step_streams: int
    streams_stated: bool        # max_step_streams was set (a refusal of one more stream is promised)
    num_reset_states: int
    simulator: str
    auto_reset: bool

    @property
    def lists_final_rows(self) -> bool:
        """Version >= 1: final_rows names the ended rows and final_observations holds only those."""
        return self.version != "0"

    @property
    def has_instructions(self) -> bool:
        """Version >= 1: ResetResponse/StepResponse may carry instructions; EpisodeStats its reset_state_id."""
        return self.version != "0"


def read(spec) -> View:
    return View(version=version_of(spec), num_envs=int(spec.num_envs), max_episode_steps=int(spec.max_episode_steps),
                max_action_chunk=int(spec.max_action_chunk) or 1,
                max_step_streams=int(spec.max_step_streams) or DEFAULT_MAX_STEP_STREAMS,
                streams_stated=spec.max_step_streams > 0, num_reset_states=max(0, int(spec.num_reset_states)),
                simulator=spec.simulator or "external", auto_reset=bool(spec.auto_reset))


def spec_problems(spec) -> list[str]:
    """What in an EnvSpec no version of the contract allows; one line each, naming the field and the section."""
    from rlfleet.wire.spaces import TensorSpace, spaces_from_proto

    out = []
    if version_of(spec) not in KNOWN_VERSIONS:
        out.append(f"EnvSpec.contract_version is {spec.contract_version!r}; rlfleet knows versions "
                   f"{', '.join(repr(v) for v in KNOWN_VERSIONS)} ('' reads as '0') ({section('versions')})")
    if spec.num_envs < 1:
        out.append(f"EnvSpec.num_envs is {spec.num_envs}; a server hosts at least one env ({section('describe')})")
    if spec.max_episode_steps < 1:
        out.append(f"EnvSpec.max_episode_steps is {spec.max_episode_steps}; must be >= 1: rlfleet takes the episode "
                   f"limit of an external server from Describe ({section('describe')})")
    for name in ("max_action_chunk", "max_step_streams", "num_reset_states"):
        if getattr(spec, name) < 0:
            out.append(f"EnvSpec.{name} is {getattr(spec, name)}; must be >= 0 (0 reads as its default) "
                       f"({section('describe')})")
    if len(spec.task_descriptions) not in (0, spec.num_envs):
        out.append(f"EnvSpec.task_descriptions: {len(spec.task_descriptions)} strings for {spec.num_envs} envs "
                   f"(one per env, or none) ({section('describe')})")
    if not spec.observation_space:
        out.append(f"EnvSpec.observation_space is empty ({section('describe')})")
    try:
        spaces_from_proto(spec.observation_space)
    except (ValueError, KeyError) as exc:
        out.append(f"EnvSpec.observation_space: {exc} ({section('tensors')})")
    try:
        action = TensorSpace.from_proto(spec.action_space)
    except (ValueError, KeyError) as exc:
        out.append(f"EnvSpec.action_space: {exc} ({section('tensors')})")
    else:
        if action.dtype != np.float32 or not action.shape:
            out.append(f"EnvSpec.action_space is {action.dtype} {list(action.shape)}; rlfleet sends FLOAT32 actions "
                       f"of at least one dimension ({section('describe')})")
        elif not (action.low <= action.high).all():
            out.append(f"EnvSpec.action_space: low > high somewhere ({section('tensors')})")
    return out


def run_problems(spec, *, policy_chunk: int = 1) -> list[str]:
    """Why a run cannot use this server (empty: it can): spec_problems, and a policy chunk the server does not
    accept. Checked when the run starts, never in the middle of it."""
    out = spec_problems(spec)
    k = read(spec).max_action_chunk
    if policy_chunk > k:
        out.append(f"EnvSpec.max_action_chunk is {spec.max_action_chunk}"
                   + (" (0 reads as 1)" if not spec.max_action_chunk else "")
                   + f"; the policy acts in chunks of {policy_chunk} (actor.model.num_action_chunks) "
                     f"({section('chunks')})")
    return out


def ended_rows(final_rows: Sequence[int], terminated: np.ndarray, truncated: np.ndarray, view: View) -> np.ndarray:
    """Positions of the rows whose episode ended in a step: ``final_rows`` (version >= 1), or the rows with a
    terminated or truncated cell (version 0, which had no final_rows)."""
    if view.lists_final_rows:
        return np.asarray([int(r) for r in final_rows], np.int64)
    n = terminated.shape[0]
    return np.flatnonzero((np.asarray(terminated) | np.asarray(truncated)).reshape(n, -1).any(1)).astype(np.int64)


def decode_final_observations(msg, rows: np.ndarray, n: int, specs: Mapping, name: str = "final_observations",
                              *, every_row_ok: bool = True, writable: bool = False) -> dict[str, np.ndarray]:
    """The final observations of the ended ``rows`` (positions among the ``n`` stepped rows).

    Accepted: one row per ended row, in ``rows`` order; with ``every_row_ok`` also one row per stepped row
    (version 0's form, whose ended rows are then picked); and, when no row ended, an empty map (absent entries
    read as [0, ...] tensors). Raises codec.CodecError naming the entry otherwise."""
    k = len(rows)
    if k == 0 and not msg.tensors:
        return {key: np.zeros((0, *s.shape), codec.numpy_dtype(s.dtype)) for key, s in specs.items()}
    if every_row_ok and k != n and msg.tensors and all(t.shape[:1] == [n] for t in msg.tensors.values()):
        every = codec.decode_map(msg, name, specs=specs, batch=n, writable=writable)
        return {key: v[rows] for key, v in every.items()}
    return codec.decode_map(msg, name, specs=specs, batch=k, writable=writable)
