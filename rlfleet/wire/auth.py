"""The run's credentials: one secret per run, a credential per service derived from it, and which role may call
which method.

The coordinator makes the run secret (or takes ``RLFLEET_RUN_TOKEN`` when the deployment supplies one). Only the
coordinator, ``coordinatorctl`` and the operator hold it; a service gets its own **credential**, issued from the
secret for its role (and index), in the same variable ``RLFLEET_RUN_TOKEN``: the local launcher issues one per
process, ``coordinatorctl deploy`` one per compose service and one per Kubernetes role (pods of a StatefulSet share
a template). A service given the secret itself (a hand-made deployment) derives its credential from it, and says
that it holds more than it needs.

What a credential holds is never enough to make another role's. With H = HMAC-SHA256 and S the run secret::

    V_b      = H(S, "rlfleet/v1/verify/" + b)      a server of role b checks its callers with this
    K_a->b   = H(V_b, "from/" + a)                 role a's key toward servers of role b
    B_a[i]->b = H(K_a->b, "index/" + i)            what service a[i] sends to a server of role b (the bearer)

A credential of role a carries V_a (to check the calls it serves) and, for each role b it calls, B_a[i]->b (bound
to its index) or K_a->b (role-wide: it derives B with its own index). Every call carries the bearer for the
callee's role, the caller's role and index (metadata); the server recomputes B from its V and refuses a mismatch.
So the role of a call is proven, not declared: an env server's credential yields env bearers and V_env, from
which only calls *to env servers* can be made; never a learner's, inference server's, coordinator's or operator's.
A bearer is seen by the server it is sent to, which is why it is per callee role: what a server sees it could
make itself already.

Each process declares its identity once (:func:`set_identity`); :mod:`rlfleet.wire.rpc` then adds the bearer, role and
index to every call it makes and checks them on every call it serves. Health checks and reflection stay open so
that Kubernetes probes and ``grpcurl list`` work without a credential. A process with no credential (in-process
tests, the examples) neither sends nor checks one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import pathlib
import secrets
from dataclasses import dataclass, field

TOKEN_ENV = "RLFLEET_RUN_TOKEN"  # the run secret (coordinator, coordinatorctl) or a service's issued credential
TOKEN_FILE = "run_token"
TOKEN_KEY = "authorization"  # metadata: "Bearer <bearer>"
ROLE_KEY = "x-rlfleet-role"  # metadata: the caller's role
INDEX_KEY = "x-rlfleet-index"  # metadata: the caller's index among its role (0 when absent)
CREDENTIAL_PREFIX = "rlfleet-cred1."

ROLES = ("coordinator", "env", "inference", "learner", "ctl")  # ctl: coordinatorctl and operators' tools
SERVING_ROLES = ("coordinator", "env", "inference", "learner")  # roles whose processes serve calls
MAX_INDEX = 1 << 20

# which roles each role calls: its credential holds bearers toward these only
CALLS: dict[str, tuple[str, ...]] = {
    "coordinator": SERVING_ROLES,
    "ctl": SERVING_ROLES,
    "env": ("coordinator", "inference", "learner"),
    "inference": ("coordinator",),
    "learner": ("coordinator", "inference"),
}

# the gRPC service -> the role whose servers host it (which bearer a call carries)
SERVICE_ROLES = {
    "rlfleet.v1.CoordinatorService": "coordinator",
    "rlfleet.v1.EnvService": "env",
    "rlfleet.v1.RolloutService": "env",
    "rlfleet.v1.InferenceService": "inference",
    "rlfleet.v1.LearnerService": "learner",
}

# methods anyone may call, credential or not (probes and discovery; they reveal nothing about the run)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")

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


class AuthError(RuntimeError):
    """A call without a valid credential (args: 'UNAUTHENTICATED', message), or from a role that does not own
    the method or with another role's credential ('PERMISSION_DENIED', message)."""


class CredentialError(ValueError):
    """A credential that cannot serve this process (malformed, another role's or another index's)."""


def _mac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _verify_key(secret: str, callee: str) -> bytes:
    return _mac(secret.encode(), f"rlfleet/v1/verify/{callee}")


def _pair_key(verify_key: bytes, caller: str) -> bytes:
    return _mac(verify_key, f"from/{caller}")


def _bearer(pair_key: bytes, index: int) -> str:
    return _b64(_mac(pair_key, f"index/{index}"))


def _check_role_index(role: str, index: int | None) -> None:
    if role not in ROLES:
        raise CredentialError(f"role: {role!r} is not one of {ROLES}")
    if index is not None and not 0 <= index < MAX_INDEX:
        raise CredentialError(f"index: {index} is not in 0..{MAX_INDEX - 1}")


def issue(secret: str, role: str, index: int | None = None) -> str:
    """The credential of service ``role[index]`` (``index`` None: any index of the role, for replicas that share
    one secret, e.g. a Kubernetes StatefulSet), made from the run secret. Holds nothing that makes another
    role's credential."""
    _check_role_index(role, index)
    if not secret or secret.startswith(CREDENTIAL_PREFIX):
        raise CredentialError("issue: needs the run secret, not a service credential")
    to = {}
    for callee in CALLS[role]:
        pair = _pair_key(_verify_key(secret, callee), role)
        to[callee] = _b64(pair) if index is None else _bearer(pair, index)
    body = {"role": role, "index": index, "to": to}
    if role in SERVING_ROLES:
        body["verify"] = _b64(_verify_key(secret, role))
    return CREDENTIAL_PREFIX + _b64(json.dumps(body, separators=(",", ":")).encode())


def is_credential(token: str | None) -> bool:
    return bool(token) and token.startswith(CREDENTIAL_PREFIX)


def parse_credential(token: str) -> dict:
    """An issued credential's contents: {'role', 'index' (int or None), 'to': {callee: key}, 'verify'?}."""
    try:
        body = json.loads(_unb64(token[len(CREDENTIAL_PREFIX):]))
        role, index, to = body["role"], body["index"], body["to"]
        if not isinstance(to, dict) or not (index is None or isinstance(index, int)):
            raise TypeError("bad field types")
        _check_role_index(role, index)
        return {"role": role, "index": index, "to": {k: _unb64(v) for k, v in to.items()},
                "verify": _unb64(body["verify"]) if body.get("verify") else None}
    except CredentialError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything wrong with it is one error
        raise CredentialError(f"{TOKEN_ENV}: not a valid rlfleet credential ({type(exc).__name__})") from None


@dataclass(frozen=True)
class Caller:
    """Who made a call, as its credential proves."""
    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role}[{self.index}]"


@dataclass(frozen=True)
class Identity:
    role: str
    index: int
    from_secret: bool  # holds the run secret (coordinator, coordinatorctl, or a service handed the secret)
    bearers: dict[str, str] = field(repr=False)  # callee role -> what this process sends it
    verifiers: dict[str, bytes] = field(repr=False)  # caller role -> K_caller->self (empty: serves nothing)

    def expected(self, caller: str, index: int) -> bytes | None:
        key = self.verifiers.get(caller)
        return None if key is None else _bearer(key, index).encode()


_identity: Identity | None = None


def set_identity(role: str, token: str | None, index: int = 0) -> Identity | None:
    """Declare who this process is. ``token``: the run secret (every credential is derived from it) or a
    credential issued for this role (and index); None: no credential, nothing sent or checked."""
    global _identity
    _check_role_index(role, index)
    if not token:
        _identity = None
        return None
    if is_credential(token):
        cred = parse_credential(token)
        if cred["role"] != role:
            raise CredentialError(f"{TOKEN_ENV}: this is the {cred['role']} role's credential; this process is "
                                  f"{role}")
        if cred["index"] is not None and cred["index"] != index:
            raise CredentialError(f"{TOKEN_ENV}: this is {role}[{cred['index']}]'s credential; this process is "
                                  f"{role}[{index}]")
        # index-bound: the bearers themselves; role-wide: keys toward each callee, made into this index's bearers
        bound = cred["index"] is not None
        bearers = {callee: _b64(raw) if bound else _bearer(raw, index) for callee, raw in cred["to"].items()}
        verify = cred["verify"]
        from_secret = False
    else:
        bearers = {callee: _bearer(_pair_key(_verify_key(token, callee), role), index) for callee in CALLS[role]}
        verify = _verify_key(token, role) if role in SERVING_ROLES else None
        from_secret = True
    verifiers = {caller: _pair_key(verify, caller) for caller in ROLES} if verify is not None else {}
    _identity = Identity(role, index, from_secret, bearers, verifiers)
    return _identity


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


def callee_role(method: str) -> str | None:
    """The role whose servers host ``method`` ('/rlfleet.v1.LearnerService/Train' -> 'learner')."""
    return SERVICE_ROLES.get(method.lstrip("/").split("/", 1)[0])


def call_metadata(method: str) -> list[tuple[str, str]]:
    """What a call to ``method`` carries: the bearer for its callee's role, this process's role and index
    (nothing for probes, reflection and services outside the run)."""
    ident = _identity
    if ident is None:
        return []
    bearer = ident.bearers.get(callee_role(method) or "")
    if bearer is None:
        return []
    return [(TOKEN_KEY, f"Bearer {bearer}"), (ROLE_KEY, ident.role), (INDEX_KEY, str(ident.index))]


def metadata(secret: str, role: str, index: int = 0, *, to: str) -> list[tuple[str, str]]:
    """Call metadata of ``role[index]`` toward a server of role ``to``, made from the run secret (tools, tests)."""
    _check_role_index(role, index)
    if to not in SERVING_ROLES:
        raise CredentialError(f"to: {to!r} is not one of {SERVING_ROLES}")
    bearer = _bearer(_pair_key(_verify_key(secret, to), role), index)
    return [(TOKEN_KEY, f"Bearer {bearer}"), (ROLE_KEY, role), (INDEX_KEY, str(index))]


def _claim(md: dict) -> tuple[str, int]:
    role = md.get(ROLE_KEY, "")
    if role not in ROLES:
        raise AuthError("UNAUTHENTICATED", f"metadata '{ROLE_KEY}': {role[:40]!r} is not one of {ROLES}")
    text = md.get(INDEX_KEY, "0")
    if not (text.isascii() and text.isdigit() and len(text) <= 7 and int(text) < MAX_INDEX):
        raise AuthError("UNAUTHENTICATED", f"metadata '{INDEX_KEY}': {text[:40]!r} is not an index in "
                                           f"0..{MAX_INDEX - 1}")
    return role, int(text)


def check(method: str, metadata) -> Caller | None:
    """The proven caller of ``method``; raises AuthError(code, message) unless ``metadata`` carries a bearer
    that this process's verify key makes for the claimed role and index, and that role owns the method.
    None when this process checks nothing (no identity) or the method is open."""
    ident = _identity
    if ident is None or method.startswith(OPEN_PREFIXES):
        return None
    md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    given = md.get(TOKEN_KEY, "")
    if not given.startswith("Bearer ") or not ident.verifiers:
        raise AuthError("UNAUTHENTICATED", "missing or wrong run credential (metadata "
                                           f"'{TOKEN_KEY}: Bearer <credential>', '{ROLE_KEY}', '{INDEX_KEY}'; "
                                           f"see `python -m rlfleet.wire.auth --help`)")
    role, index = _claim(md)
    bearer = given[7:].strip().encode("utf-8", "replace")
    if not hmac.compare_digest(bearer, ident.expected(role, index)):
        for other in ROLES:  # a valid credential of another role: say so (it is a known caller overstepping)
            if other != role and hmac.compare_digest(bearer, ident.expected(other, index)):
                raise AuthError("PERMISSION_DENIED", f"this credential is {other}[{index}]'s, not {role}[{index}]'s: "
                                                     f"a service acts only in its own role")
        raise AuthError("UNAUTHENTICATED", f"missing or wrong run credential for {role}[{index}] (metadata "
                                           f"'{TOKEN_KEY}: Bearer <credential>'; the run secret is in "
                                           f"<run>/{TOKEN_FILE} or {TOKEN_ENV})")
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


def main(argv=None) -> int:
    """python -m rlfleet.wire.auth: issue a service credential, or print call metadata, from the run secret."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rlfleet.wire.auth", description=main.__doc__)
    p.add_argument("what", choices=["issue", "metadata"],
                   help="issue: a credential for ROLE (its RLFLEET_RUN_TOKEN); metadata: grpcurl -H lines")
    p.add_argument("--role", default="ctl", choices=ROLES)
    p.add_argument("--index", type=int, default=None, help="issue: bind to this index (default: any)")
    p.add_argument("--to", choices=SERVING_ROLES, help="metadata: the role of the server called")
    p.add_argument("--run-dir", default=None, help=f"read the secret from RUN_DIR/{TOKEN_FILE} (else {TOKEN_ENV})")
    args = p.parse_args(argv)
    secret = read_token(args.run_dir)
    if not secret or is_credential(secret):
        p.error(f"needs the run secret ({TOKEN_ENV} or --run-dir)")
    if args.what == "issue":
        print(issue(secret, args.role, args.index))
    else:
        if not args.to:
            p.error("metadata needs --to")
        for key, value in metadata(secret, args.role, args.index or 0, to=args.to):
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
