"""Who makes a call: the per-call part of the run's credentials (the scheme, its keys, credentials and token files:
:mod:`rlfleet.wire.auth`). No gRPC here: the channels (:mod:`rlfleet.wire.channels`) add :func:`call_metadata` to
every call, and the servers' guard (:mod:`rlfleet.wire.servers`) runs :func:`check_caller` on every call before it
waits for a thread.

A call carries the bearer for its callee's role and the caller's role and index; the server proves the bearer
with this process's verifier (the run's public issuing key: it checks signatures and makes none). No or a wrong
credential is UNAUTHENTICATED; another role's or index's credential, a credential for another role's servers, or
a role that does not own the method (``METHOD_ROLES``) is PERMISSION_DENIED (an :class:`rlfleet.errors.AuthError`
naming the code); health checks and reflection stay open (``OPEN_PREFIXES``). ``auth.set_identity`` hands this
module the process's :class:`Identity` once, at start-up (none: nothing is sent or checked)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.errors import AuthError

TOKEN_ENV = "RLFLEET_RUN_TOKEN"  # the run secret (coordinator, coordinatorctl) or a service's issued credential
TOKEN_FILE = "run_token"  # <run>/run_token: the operator's credential (role ctl), what coordinatorctl reads
TOKEN_KEY = "authorization"  # metadata: "Bearer <bearer>"
ROLE_KEY = "x-rlfleet-role"  # metadata: the caller's role
INDEX_KEY = "x-rlfleet-index"  # metadata: the caller's index among its role (0 when absent)

ROLES = ("coordinator", "env", "inference", "learner", "ctl")  # ctl: coordinatorctl and operators' tools
MAX_INDEX = 1 << 20

# the gRPC service -> the role whose servers host it (which bearer a call carries)
SERVICE_ROLES = {
    "rlfleet.v1.CoordinatorService": "coordinator",
    "rlfleet.v1.EnvService": "env",
    "rlfleet.v1.RolloutService": "env",
    "rlfleet.v1.InferenceService": "inference",
    "rlfleet.v1.LearnerService": "learner",
}

REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
# methods anyone may call, credential or not (probes and discovery; they reveal nothing about the run)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", *REFLECTION_PREFIXES)

_SERVICES = ("env", "inference", "learner")
# calls that change a run's state, and the roles that own them; a method not listed needs any valid credential
METHOD_ROLES: dict[str, tuple[str, ...]] = {
    "/rlfleet.v1.CoordinatorService/Register": _SERVICES,
    "/rlfleet.v1.CoordinatorService/Heartbeat": _SERVICES,
    "/rlfleet.v1.CoordinatorService/Stop": ("ctl",),
    "/rlfleet.v1.CoordinatorService/Scale": ("ctl",),
    "/rlfleet.v1.InferenceService/UpdateWeights": ("learner",),
    "/rlfleet.v1.InferenceService/Act": ("env", "ctl"),
    "/rlfleet.v1.LearnerService/PushRollout": ("env",),
    "/rlfleet.v1.LearnerService/Train": ("coordinator",),
    "/rlfleet.v1.LearnerService/PublishWeights": ("coordinator",),
    "/rlfleet.v1.LearnerService/LogMetrics": ("coordinator",),
    "/rlfleet.v1.LearnerService/SaveCheckpoint": ("coordinator",),
    "/rlfleet.v1.RolloutService/Collect": ("coordinator", "ctl"),
    "/rlfleet.v1.RolloutService/Evaluate": ("coordinator", "ctl"),
}


@dataclass(frozen=True)
class Caller:
    """Who made a call, as its credential proves."""

    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass(frozen=True)
class Identity:
    """This process's side of the credentials (built once by rlfleet.wire.auth.set_identity)."""

    role: str
    index: int
    from_secret: bool  # holds the run secret (coordinator, coordinatorctl, or a service handed the secret)
    bearers: dict[str, str] = field(repr=False)  # callee role -> what this process sends it
    # checks callers' bearers (rlfleet.wire.auth.Verifier: the run's public issuing key, which signs nothing, and
    # the bearers it has checked); None: this process serves nothing
    verifier: object | None = field(repr=False, default=None)


_identity: Identity | None = None


def use_identity(identity: Identity | None) -> None:
    """What this process's calls carry and its servers check from now on (None: nothing sent or checked)."""
    global _identity
    _identity = identity


def callee_role(method: str) -> str | None:
    """The role whose servers host ``method`` ('/rlfleet.v1.LearnerService/Train' -> 'learner')."""
    return SERVICE_ROLES.get(method.lstrip("/").split("/", 1)[0])


def call_metadata(method: str) -> list[tuple[str, str]]:
    """What a call to ``method`` carries: the bearer for its callee's role, this process's role and index
    (nothing for probes, reflection and services outside the run)."""
    ident = _identity
    if ident is None:
        return []
    token = ident.bearers.get(callee_role(method) or "")
    return [] if token is None else credential_metadata(token, ident.role, ident.index)


def credential_metadata(token: str, role: str, index: int) -> list[tuple[str, str]]:
    """The metadata of a call from ``role[index]`` with bearer ``token``."""
    return [(TOKEN_KEY, f"Bearer {token}"), (ROLE_KEY, role), (INDEX_KEY, str(index))]


def _claim(md: dict) -> tuple[str, int]:
    role = md.get(ROLE_KEY, "")
    if role not in ROLES:
        raise AuthError("UNAUTHENTICATED", f"metadata '{ROLE_KEY}': {role[:40]!r} is not one of {ROLES}")
    text = md.get(INDEX_KEY, "0")
    if not (text.isascii() and text.isdigit() and len(text) <= 7 and int(text) < MAX_INDEX):
        raise AuthError(
            "UNAUTHENTICATED", f"metadata '{INDEX_KEY}': {text[:40]!r} is not an index in 0..{MAX_INDEX - 1}"
        )
    return role, int(text)


def check_caller(method: str, metadata) -> Caller | None:
    """The proven caller of ``method``; raises AuthError(code, message) unless ``metadata`` carries a bearer that
    this process's verifier (rlfleet.wire.auth.Verifier) proves for the claimed role and index toward the role that
    hosts ``method``, and that role owns the method. None when this process checks nothing (no identity) or the
    method is open. A bearer already proven costs a lookup (the verifier remembers it)."""
    ident = _identity
    if ident is None or method.startswith(OPEN_PREFIXES):
        return None
    md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    given = md.get(TOKEN_KEY, "")
    if not given.startswith("Bearer ") or ident.verifier is None:
        raise AuthError(
            "UNAUTHENTICATED",
            "missing or wrong run credential (metadata "
            f"'{TOKEN_KEY}: Bearer <credential>', '{ROLE_KEY}', '{INDEX_KEY}'; "
            f"see `python -m rlfleet.wire.auth --help`)",
        )
    role, index = _claim(md)
    callee = callee_role(method) or ident.role
    proof = ident.verifier.prove(given[7:].strip(), index, callee)
    if proof.role != role or proof.index not in (None, index):
        # a valid credential of another role or index: say so (it is a known caller overstepping)
        theirs = f"{proof.role}[{index if proof.index is None else proof.index}]"
        raise AuthError(
            "PERMISSION_DENIED",
            f"this credential is {theirs}'s, not {role}[{index}]'s: a service acts only in its own role and index",
        )
    if callee not in proof.to:
        raise AuthError(
            "PERMISSION_DENIED",
            f"{role}[{index}]'s credential calls {'/'.join(proof.to)} servers, not {callee} servers",
        )
    owners = METHOD_ROLES.get(method)
    if owners is not None and role not in owners:
        raise AuthError("PERMISSION_DENIED", f"{method} is accepted only from {'/'.join(owners)}, not from {role}")
    return Caller(role, index)


def caller_of(context) -> Caller | None:
    """The caller of the call a servicer is serving, as the server's check proved it (None: no identity here)."""
    if _identity is None:
        return None
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    try:
        role, index = _claim(md)
    except AuthError:
        return None
    return Caller(role, index)
