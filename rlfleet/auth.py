"""The run's credential: one token per run, required on every RPC, and which role may call which method.

The coordinator makes the token (or takes ``RLFLEET_RUN_TOKEN`` when the deployment supplies one), writes it to
``<run>/run_token`` (mode 0600, for ``coordinatorctl status/stop``) and hands it to the services it starts through
the environment. Attach-mode services (compose, Kubernetes, other hosts) get it the same way: ``RLFLEET_RUN_TOKEN``.

Each process declares its identity once (:func:`set_identity`); :mod:`rlfleet.rpc` then adds the token and the
caller's role to every call it makes and checks both on every call it serves. Health checks and reflection stay
open so that Kubernetes probes and ``grpcurl list`` work without the secret. A process with no token (in-process
tests, the examples) neither sends nor checks one.
"""

from __future__ import annotations

import hmac
import os
import pathlib
import secrets
from dataclasses import dataclass

TOKEN_ENV = "RLFLEET_RUN_TOKEN"
TOKEN_FILE = "run_token"
TOKEN_KEY = "authorization"  # metadata: "Bearer <token>"
ROLE_KEY = "x-rlfleet-role"  # metadata: the caller's role

ROLES = ("coordinator", "env", "inference", "learner", "ctl")  # ctl: coordinatorctl and operators' tools

# methods anyone may call, token or not (probes and discovery; they reveal nothing about the run)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")

_SERVICES = ("env", "inference", "learner")
# calls that change a run's state, and the roles that own them; a method not listed only needs the token
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


class AuthError(RuntimeError):
    """A call without the run's credential, or from a role that does not own the method."""


@dataclass(frozen=True)
class Identity:
    role: str
    token: str


_identity: Identity | None = None


def set_identity(role: str, token: str | None) -> None:
    """Declare who this process is; with a token, every call it serves must carry the same one."""
    global _identity
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {ROLES}")
    _identity = Identity(role, token) if token else None


def identity() -> Identity | None:
    return _identity


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_from_env() -> str | None:
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def write_token(run_dir: pathlib.Path, token: str) -> pathlib.Path:
    path = pathlib.Path(run_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)
    return path


def read_token(run_dir: pathlib.Path | str | None) -> str | None:
    """The token for a run: RLFLEET_RUN_TOKEN, else ``<run_dir>/run_token``; None when neither exists."""
    token = token_from_env()
    if token or run_dir is None:
        return token
    path = pathlib.Path(run_dir) / TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def call_metadata() -> list[tuple[str, str]]:
    ident = _identity
    if ident is None:
        return []
    return [(TOKEN_KEY, f"Bearer {ident.token}"), (ROLE_KEY, ident.role)]


def check(method: str, metadata) -> None:
    """Raise AuthError(code, message) unless ``metadata`` carries this process's token and an owning role."""
    ident = _identity
    if ident is None or method.startswith(OPEN_PREFIXES):
        return
    md = {k: v for k, v in (metadata or ())}
    given = md.get(TOKEN_KEY, "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), ident.token.encode()):
        raise AuthError("UNAUTHENTICATED", "missing or wrong run credential (metadata "
                                           f"'{TOKEN_KEY}: Bearer <token>'; the token is in <run>/{TOKEN_FILE} "
                                           f"or {TOKEN_ENV})")
    owners = METHOD_ROLES.get(method)
    role = md.get(ROLE_KEY, "")
    if owners is not None and role not in owners:
        raise AuthError("PERMISSION_DENIED", f"{method} is accepted only from {'/'.join(owners)}, "
                                             f"not from {role or 'a caller without a role'}")
