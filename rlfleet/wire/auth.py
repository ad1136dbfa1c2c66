"""The run's credentials: one secret per run and a credential per service derived from it, made and read here;
what every call carries, and the check of it on every call served, are rlfleet.wire.rpc's.

The coordinator makes the run secret (or takes ``RLFLEET_RUN_TOKEN`` when the deployment supplies one). Only the
coordinator, ``coordinatorctl`` and the operator hold it; a service gets its own **credential**, issued from the
secret for its role (and index), in the same variable ``RLFLEET_RUN_TOKEN``: the local launcher issues one per
process, ``coordinatorctl deploy`` one per compose service and one per Kubernetes role (pods of a StatefulSet share
a template). A service given the secret itself (a hand-made deployment) derives its credential from it, and says
that it holds more than it needs.

What a credential holds is never enough to make another role's. With H = HMAC-SHA256 and S the run secret::

    V_b      = H(S, "rlfleet/v1/verify/" + b)      a server of role b checks its callers with this
    K_a->b   = H(V_b, "from/" + a)                 role a's key toward servers of role b
    B_a[i]->b = H(K_a->b, "index/" + i)            what service a[i] sends to a server of role b (the bearer,
                                                   rlfleet.wire.rpc.bearer: the server recomputes it per call)

A credential of role a carries V_a (to check the calls it serves) and, for each role b it calls, B_a[i]->b (bound
to its index) or K_a->b (role-wide: it derives B with its own index). Every call carries the bearer for the
callee's role, the caller's role and index (metadata); the server recomputes B from its V and refuses a mismatch.
So the role of a call is proven, not declared: an env server's credential yields env bearers and V_env, from
which only calls *to env servers* can be made; never a learner's, inference server's, coordinator's or operator's.
A bearer is seen by the server it is sent to, which is why it is per callee role: what a server sees it could
make itself already.

This module makes and reads credentials: the key derivation, :func:`issue`, :func:`parse_credential`, the token
file, :func:`metadata` for tools and tests, and the command line. Each process declares its identity once
(:func:`set_identity`), which builds what it sends and checks against (``rpc.Identity``); what happens per call is
:mod:`rlfleet.wire.rpc`'s: it adds the bearer, role and index to every call the process makes
(``rpc.call_metadata``) and checks them on every call it serves (``rpc.check_caller``, with the methods each role
owns, ``rpc.METHOD_ROLES``; ``rpc.caller_of`` in a servicer). Health checks and reflection stay open so that
Kubernetes probes and ``grpcurl list`` work without a credential. A process with no credential (in-process tests,
the examples) neither sends nor checks one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import pathlib
import secrets

from rlfleet.wire import rpc
from rlfleet.wire.rpc import MAX_INDEX, ROLES, TOKEN_ENV, TOKEN_FILE, bearer, credential_metadata

CREDENTIAL_PREFIX = "rlfleet-cred1."
SERVING_ROLES = ("coordinator", "env", "inference", "learner")  # roles whose processes serve calls

# which roles each role calls: its credential holds bearers toward these only
CALLS: dict[str, tuple[str, ...]] = {
    "coordinator": SERVING_ROLES,
    "ctl": SERVING_ROLES,
    "env": ("coordinator", "inference", "learner"),
    "inference": ("coordinator",),
    "learner": ("coordinator", "inference"),
}


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
        to[callee] = _b64(pair) if index is None else bearer(pair, index)
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


def set_identity(role: str, token: str | None, index: int = 0) -> rpc.Identity | None:
    """Declare who this process is: what its calls carry and its servers check (rlfleet.wire.rpc). ``token``: the
    run secret (every credential is derived from it) or a credential issued for this role (and index); None: no
    credential, nothing sent or checked."""
    _check_role_index(role, index)
    if not token:
        rpc.use_identity(None)
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
        bearers = {callee: _b64(raw) if bound else bearer(raw, index) for callee, raw in cred["to"].items()}
        verify = cred["verify"]
        from_secret = False
    else:
        bearers = {callee: bearer(_pair_key(_verify_key(token, callee), role), index) for callee in CALLS[role]}
        verify = _verify_key(token, role) if role in SERVING_ROLES else None
        from_secret = True
    verifiers = {caller: _pair_key(verify, caller) for caller in ROLES} if verify is not None else {}
    identity = rpc.Identity(role, index, from_secret, bearers, verifiers)
    rpc.use_identity(identity)
    return identity


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


def metadata(secret: str, role: str, index: int = 0, *, to: str) -> list[tuple[str, str]]:
    """Call metadata of ``role[index]`` toward a server of role ``to``, made from the run secret (tools, tests)."""
    _check_role_index(role, index)
    if to not in SERVING_ROLES:
        raise CredentialError(f"to: {to!r} is not one of {SERVING_ROLES}")
    return credential_metadata(bearer(_pair_key(_verify_key(secret, to), role), index), role, index)


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
