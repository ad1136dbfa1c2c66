"""The run's credentials: one secret per run, kept by the coordinator, and a credential per service issued from it,
made and read here; what every call carries, and the check of it on every call served, are rlfleet.wire.callers'.

The coordinator makes the run secret (or takes ``RLFLEET_RUN_TOKEN`` when the deployment supplies one); only it
(and a deployment that supplied the secret) holds it, and only it issues. A service gets its own **credential**,
issued from the secret for its role (and index), in the same variable ``RLFLEET_RUN_TOKEN``: the local launcher
issues one per process, ``coordinatorctl deploy`` one per compose service and one per Kubernetes role (pods of a
StatefulSet share a template); the operator's (role ``ctl``, what ``coordinatorctl status|stop|scale`` send) is the
run folder's ``run_token``. In attach mode with a secret the coordinator made, the secret is the run folder's
``run_secret``, for ``issue``. A service given the secret itself (a hand-made deployment) issues its own credential
from it, and says that it holds more than it needs.

Signing and checking are different keys (Ed25519, RFC 8032), so what a server checks with never signs. From the
secret S (H = HMAC-SHA256, every key's 32-byte seed derived so that issuing is deterministic)::

    R = Ed25519(H(S, "rlfleet/v2/root"))          the run's issuing key: only the holder of S has it; every
                                                   credential of a serving role carries its public half, R.pub
    K = Ed25519(H(S, "rlfleet/v2/key/" + a + "/" + i))   service a[i]'s own signing key (i = "*": any index of the
                                                   role, for replicas that share one credential)
    cert  = "rlfleet/v2 cert <a> <i> <callees> <K.pub>", signed by R: who K speaks for, and which roles' servers
            it calls (``CALLS``)
    bearer toward a server of role b = cert, R's signature of it, K's signature of "rlfleet/v2 call <a> <i> <b>"

A credential holds its role, index, K, the cert and R's signature (plus R.pub for roles that serve). A server checks
a bearer with R.pub alone: the cert is R's, the call signature is K's for the claimed role, index and the callee's
role, the claimed role and index are the cert's, and the callee's role is one the cert names; a bearer checked once
is remembered (rlfleet.wire.callers), so the per-call cost is a lookup. Nothing in a credential signs for another role,
another index (for an index-bound one) or toward a role its cert does not name, and R.pub verifies only: making a
cert needs R, which only the secret yields. A bearer is seen by the servers it is sent to (of role b); it is good
only toward servers of role b, as the caller it names.

This module makes and reads credentials: the key derivation, :func:`issue`, :func:`parse_credential`,
:class:`Verifier` (the check of a bearer), the token file, :func:`metadata` for tools and tests, and the command
line. Each process declares its identity once (:func:`set_identity`), which builds what it sends and checks against
(``callers.Identity``); what happens per call is :mod:`rlfleet.wire.callers`': it adds the bearer, role and index to every
call the process makes (``callers.call_metadata``) and checks them on every call it serves (``callers.check_caller``, with
the methods each role owns, ``callers.METHOD_ROLES``; ``callers.caller_of`` in a servicer). Health checks and reflection
stay open so that Kubernetes probes and ``grpcurl list`` work without a credential. A process with no credential
(in-process tests, the examples) neither sends nor checks one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from rlfleet.errors import AuthError
from rlfleet.wire import callers
from rlfleet.wire.callers import MAX_INDEX, ROLES, TOKEN_ENV, TOKEN_FILE, credential_metadata

CREDENTIAL_PREFIX = "rlfleet-cred2."
SECRET_FILE = "run_secret"  # <run>/run_secret: attach mode's secret when the coordinator made it (for `issue`)
OLD_PREFIXES = ("rlfleet-cred1.",)  # credentials of the HMAC scheme (its verify keys made callers' bearers)
BEARER_VERSION = "2"
SERVING_ROLES = ("coordinator", "env", "inference", "learner")  # roles whose processes serve calls

# which roles' servers each role calls: its cert names these, and servers of other roles refuse it
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


def _public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _root_key(secret: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_mac(secret.encode(), "rlfleet/v2/root"))


def _own_seed(secret: str, role: str, index: int | None) -> bytes:
    return _mac(secret.encode(), f"rlfleet/v2/key/{role}/{'*' if index is None else index}")


def _cert_text(role: str, index: int | None, callees, public: bytes) -> str:
    return f"rlfleet/v2 cert {role} {'*' if index is None else index} {','.join(callees)} {_b64(public)}"


def _call_text(role: str, index: int, callee: str) -> str:
    return f"rlfleet/v2 call {role} {index} {callee}"


def _check_role_index(role: str, index: int | None) -> None:
    if role not in ROLES:
        raise CredentialError(f"role: {role!r} is not one of {ROLES}")
    if index is not None and not (isinstance(index, int) and 0 <= index < MAX_INDEX):
        raise CredentialError(f"index: {index} is not in 0..{MAX_INDEX - 1}")


def is_secret(token: str | None) -> bool:
    """A run secret (not an issued credential of any version)."""
    return bool(token) and not token.startswith((CREDENTIAL_PREFIX, *OLD_PREFIXES))


def is_credential(token: str | None) -> bool:
    return bool(token) and token.startswith((CREDENTIAL_PREFIX, *OLD_PREFIXES))


def issue(secret: str, role: str, index: int | None = None) -> str:
    """The credential of service ``role[index]`` (``index`` None: any index of the role, for replicas that share
    one credential, e.g. a Kubernetes StatefulSet), made from the run secret. It signs only as itself and only
    toward the roles it calls; it verifies (serving roles) but cannot issue."""
    _check_role_index(role, index)
    if not is_secret(secret):
        raise CredentialError("issue: needs the run secret, not a service credential")
    seed = _own_seed(secret, role, index)
    public = _public(Ed25519PrivateKey.from_private_bytes(seed))
    root = _root_key(secret)
    callees = CALLS[role]
    body = {
        "role": role,
        "index": index,
        "to": list(callees),
        "key": _b64(seed),
        "cert": _b64(root.sign(_cert_text(role, index, callees, public).encode())),
    }
    if role in SERVING_ROLES:
        body["root"] = _b64(_public(root))
    return CREDENTIAL_PREFIX + _b64(json.dumps(body, separators=(",", ":")).encode())


@dataclass(frozen=True)
class Credential:
    """An issued credential, read: who it is, what it signs with and the cert that says so, what it checks with."""

    role: str
    index: int | None  # None: any index of the role
    to: tuple[str, ...]  # the roles whose servers it calls
    key: Ed25519PrivateKey
    cert: bytes  # R's signature of its cert text
    root: bytes | None  # R.pub (serving roles): checks every caller's bearer

    def bearer(self, index: int, callee: str) -> str:
        """What this credential sends, as ``role[index]``, to a server of role ``callee``."""
        text = _cert_text(self.role, self.index, self.to, _public(self.key))
        return ".".join(
            (
                BEARER_VERSION,
                _b64(text.encode()),
                _b64(self.cert),
                _b64(self.key.sign(_call_text(self.role, index, callee).encode())),
            )
        )


def parse_credential(token: str) -> Credential:
    """An issued credential's contents; CredentialError when it is not one this version reads."""
    if token.startswith(OLD_PREFIXES):
        raise CredentialError(
            f"{TOKEN_ENV}: a credential of an older rlfleet (HMAC scheme, whose verify keys could "
            f"make callers' bearers); issue it again from the run secret (`python -m "
            f"rlfleet.wire.auth issue`, `coordinatorctl deploy`)"
        )
    try:
        body = json.loads(_unb64(token[len(CREDENTIAL_PREFIX) :]))
        role, index, to = body["role"], body["index"], body["to"]
        if (
            not (isinstance(to, list) and all(t in SERVING_ROLES for t in to))
            or isinstance(index, bool)
            or not (index is None or isinstance(index, int))
        ):
            raise TypeError("bad field types")
        _check_role_index(role, index)
        seed, cert = _unb64(body["key"]), _unb64(body["cert"])
        root = _unb64(body["root"]) if body.get("root") else None
        if len(seed) != 32 or len(cert) != 64 or (root is not None and len(root) != 32):
            raise ValueError("bad key sizes")
        cred = Credential(role, index, tuple(to), Ed25519PrivateKey.from_private_bytes(seed), cert, root)
        if root is not None:  # a serving role checks its own cert now: a mangled one fails here, not per call
            Ed25519PublicKey.from_public_bytes(root).verify(
                cert, _cert_text(role, index, cred.to, _public(cred.key)).encode()
            )
        return cred
    except CredentialError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything wrong with it is one error
        raise CredentialError(f"{TOKEN_ENV}: not a valid rlfleet credential ({type(exc).__name__})") from None


@dataclass(frozen=True)
class Proof:
    """What a bearer proves: its caller's role, index (None: the cert is good for any index of the role; the call
    signature then names the index) and the roles whose servers it calls."""

    role: str
    index: int | None
    to: tuple[str, ...]


class Verifier:
    """Checks bearers with the run's public issuing key R.pub (which signs nothing). A bearer checked once, for a
    claimed index and callee role, is remembered, and so is each cert R's signature proved (at most
    ``MAX_REMEMBERED`` of each; then that memory starts over)."""

    MAX_REMEMBERED = 4096

    def __init__(self, root_public: bytes):
        self._root = Ed25519PublicKey.from_public_bytes(root_public)
        self._seen: dict[tuple[str, int, str], Proof] = {}  # (bearer, claimed index, callee role) -> its proof
        self._certs: dict[tuple[str, str], tuple[Proof, Ed25519PublicKey]] = {}  # certs R's signature proved
        self._lock = threading.Lock()

    def forget(self) -> None:
        with self._lock:
            self._seen.clear()
            self._certs.clear()

    def prove(self, token: str, index: int, callee: str) -> Proof:
        """The caller ``token`` proves, as a caller claiming ``index`` toward a server of role ``callee``; raises
        AuthError('UNAUTHENTICATED', ...) for anything that is not such a bearer of this run."""
        key = (token, index, callee)
        proof = self._seen.get(key)
        if proof is not None:
            return proof
        proof = self._check(token, index, callee)
        with self._lock:
            if len(self._seen) >= self.MAX_REMEMBERED:
                self._seen.clear()
            self._seen[key] = proof
        return proof

    def _check(self, token: str, index: int, callee: str) -> Proof:
        def wrong(why: str):
            return AuthError(
                "UNAUTHENTICATED",
                f"missing or wrong run credential ({why}; the metadata "
                f"'{callers.TOKEN_KEY}: Bearer <bearer>' comes from this run's "
                f"credential, `python -m rlfleet.wire.auth --help`)",
            )

        parts = token.split(".")
        if len(parts) != 4 or parts[0] != BEARER_VERSION or len(token) > 1024:
            raise wrong("not an rlfleet v2 bearer")
        cert = self._certs.get((parts[1], parts[2]))
        if cert is None:  # a cert not seen yet: R's signature of it (then remembered: a service's calls share one)
            try:
                text, signature = _unb64(parts[1]).decode("ascii"), _unb64(parts[2])
            except (binascii.Error, ValueError):
                raise wrong("not an rlfleet v2 bearer") from None
            fields = text.split(" ")
            if len(fields) != 6 or fields[:2] != ["rlfleet/v2", "cert"]:
                raise wrong("not an rlfleet v2 cert")
            try:
                self._root.verify(signature, text.encode())
            except InvalidSignature:
                raise wrong("a cert this run did not issue") from None
            role, cert_index, to, public = fields[2:]  # R signed them: what the issuer wrote
            cert = (
                Proof(role, None if cert_index == "*" else int(cert_index), tuple(to.split(","))),
                Ed25519PublicKey.from_public_bytes(_unb64(public)),
            )
            with self._lock:
                if len(self._certs) >= self.MAX_REMEMBERED:
                    self._certs.clear()
                self._certs[(parts[1], parts[2])] = cert
        proof, own = cert
        try:
            own.verify(_unb64(parts[3]), _call_text(proof.role, index, callee).encode())
        except (InvalidSignature, binascii.Error, ValueError):
            name = f"{proof.role}[{'*' if proof.index is None else proof.index}]"
            raise wrong(f"not signed by {name} as index {index} toward {callee} servers") from None
        return proof


def _identity_from(cred: Credential, role: str, index: int, from_secret: bool) -> callers.Identity:
    bearers = {callee: cred.bearer(index, callee) for callee in cred.to}
    verifier = Verifier(cred.root) if cred.root is not None else None
    return callers.Identity(role, index, from_secret, bearers, verifier)


def set_identity(role: str, token: str | None, index: int = 0) -> callers.Identity | None:
    """Declare who this process is: what its calls carry and its servers check (rlfleet.wire.callers). ``token``: the
    run secret (this process then issues its own credential from it) or a credential issued for this role (and
    index); None: no credential, nothing sent or checked."""
    _check_role_index(role, index)
    if not token:
        callers.use_identity(None)
        return None
    if is_credential(token):
        cred = parse_credential(token)
        if cred.role != role:
            raise CredentialError(f"{TOKEN_ENV}: this is the {cred.role} role's credential; this process is {role}")
        if cred.index is not None and cred.index != index:
            raise CredentialError(
                f"{TOKEN_ENV}: this is {role}[{cred.index}]'s credential; this process is {role}[{index}]"
            )
        identity = _identity_from(cred, role, index, False)
    else:
        identity = _identity_from(parse_credential(issue(token, role, index)), role, index, True)
    callers.use_identity(identity)
    return identity


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_from_env() -> str | None:
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def write_token(run_dir: pathlib.Path, token: str, name: str = TOKEN_FILE) -> pathlib.Path:
    """``<run_dir>/<name>``, mode 0600: the operator's credential (``run_token``, what coordinatorctl reads) or, in
    attach mode with a secret the coordinator made, the secret (``run_secret``, for ``issue``)."""
    path = pathlib.Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)
    return path


def read_token(run_dir: pathlib.Path | str | None, name: str = TOKEN_FILE) -> str | None:
    """The token for a run: RLFLEET_RUN_TOKEN, else ``<run_dir>/<name>`` (``run_token``: the operator's
    credential); None when neither exists."""
    token = token_from_env()
    if token or run_dir is None:
        return token
    path = pathlib.Path(run_dir) / name
    return path.read_text().strip() if path.exists() else None


def metadata(token: str, role: str, index: int = 0, *, to: str) -> list[tuple[str, str]]:
    """Call metadata of ``role[index]`` toward a server of role ``to`` (tools, tests), from the run secret or from
    ``role``'s own credential."""
    _check_role_index(role, index)
    if to not in SERVING_ROLES:
        raise CredentialError(f"to: {to!r} is not one of {SERVING_ROLES}")
    cred = parse_credential(token if is_credential(token) else issue(token, role, index))
    if cred.role != role or cred.index not in (None, index):
        raise CredentialError(
            f"metadata: this is {cred.role}[{'*' if cred.index is None else cred.index}]'s "
            f"credential, not {role}[{index}]'s"
        )
    return credential_metadata(cred.bearer(index, to), role, index)


def main(argv=None) -> int:
    """python -m rlfleet.wire.auth: issue a service credential (from the run secret), or print call metadata (from
    the secret or the role's own credential)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rlfleet.wire.auth", description=main.__doc__)
    p.add_argument(
        "what",
        choices=["issue", "metadata"],
        help="issue: a credential for ROLE (its RLFLEET_RUN_TOKEN); metadata: grpcurl -H lines",
    )
    p.add_argument("--role", default="ctl", choices=ROLES)
    p.add_argument("--index", type=int, default=None, help="issue: bind to this index (default: any)")
    p.add_argument("--to", choices=SERVING_ROLES, help="metadata: the role of the server called")
    p.add_argument(
        "--run-dir",
        default=None,
        help=f"{TOKEN_ENV} unset: read RUN_DIR/{SECRET_FILE} (issue) or "
        f"RUN_DIR/{TOKEN_FILE} (metadata, as the operator)",
    )
    args = p.parse_args(argv)
    token = read_token(args.run_dir, SECRET_FILE if args.what == "issue" else TOKEN_FILE)
    if not token:
        p.error(
            f"needs the run secret (issue: {TOKEN_ENV}, or --run-dir's {SECRET_FILE} in attach mode) or the "
            f"role's credential (metadata: {TOKEN_ENV}, or --run-dir's {TOKEN_FILE}, the operator's)"
        )
    try:
        if args.what == "issue":
            if not is_secret(token):
                p.error("issue needs the run secret: a credential issues nothing")
            print(issue(token, args.role, args.index))
        else:
            if not args.to:
                p.error("metadata needs --to")
            for key, value in metadata(token, args.role, args.index or 0, to=args.to):
                print(f"{key}: {value}")
    except CredentialError as exc:
        p.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
