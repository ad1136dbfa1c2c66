"""Leaked credentials against a live run (issue 33): every credential the run hands out (env, inference, learner,
the coordinator's calls, and the operator's run_token), taken from the processes and the run folder themselves,
tries every method it does not own on every service, claims every other role and index, and tries to make another
role's bearer from everything it holds. Each is refused (PERMISSION_DENIED or UNAUTHENTICATED, never served), a
rollout pushed for another worker is refused naming both indices, the learner's own identity cannot plant an
absurd weights version, and the run finishes untouched.

The servers are the real run's (coordinatorctl start, every service its own process, gRPC on loopback); the calls
go through tests/services/coordinator/test_security.py's raw_call (any method, any metadata, an empty message)."""

from __future__ import annotations

import hashlib
import hmac
import json
import pathlib
import subprocess
import threading

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from rlfleet.data.metrics import read_metrics
from rlfleet.v1 import coordinator_pb2, inference_pb2, inference_pb2_grpc, learner_pb2, learner_pb2_grpc
from rlfleet.wire import auth, callers
from tests.services.coordinator.test_end_to_end import CTL, start, wait_epoch
from tests.services.coordinator.test_security import SERVICES, raw_call

pytestmark = pytest.mark.slow

SECRET = "the-secret-of-the-hostile-credentials-run"
ROLE_NAMES = {coordinator_pb2.ENV: "env", coordinator_pb2.INFERENCE: "inference", coordinator_pb2.LEARNER: "learner"}
SERVICE_DESCRIPTORS = {  # the role whose servers host them -> their services
    "coordinator": [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]],
    **{ROLE_NAMES[r]: svcs for r, svcs in SERVICES.items()},
}
REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def method_path(svc, method) -> str:
    return f"/{svc.full_name}/{method.name}"


def served_by(role: str, path: str) -> bool:
    """Whether a call from ``role`` (its own credential, honestly) to ``path`` passes the credential check."""
    callee = callers.callee_role(path)
    owners = callers.METHOD_ROLES.get(path)
    return callee in auth.CALLS[role] and (owners is None or role in owners)


def process_credential(pid: int) -> str:
    """What a service process was handed: RLFLEET_RUN_TOKEN in its environment (what a leak of it exposes)."""
    env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in env if v.startswith(auth.TOKEN_ENV.encode() + b"="))


def materials(token: str) -> list[bytes]:
    """Every value a credential holds, raw and as text, and the credential itself."""
    body = json.loads(auth._unb64(token[len(auth.CREDENTIAL_PREFIX) :]))
    out = [token.encode(), token[len(auth.CREDENTIAL_PREFIX) :].encode()]
    for value in body.values():
        if isinstance(value, str) and value not in auth.ROLES:
            out += [value.encode(), auth._unb64(value)]
    return out


def forgeries(token: str, target: str, index: int, callee: str) -> dict[str, list[tuple[str, str]]]:
    """Bearers for ``target[index]`` toward ``callee`` servers made from everything ``token`` holds: its own
    bearer relabelled, its key signing as the target (with its cert, and as an issuer of a cert of its own), keys
    seeded from each value it holds (raw, hashed, and with the scheme's own derivation labels), the values taken
    as the run secret, and the old HMAC scheme's recipe (a verify key -> the caller's bearer)."""
    cred = auth.parse_credential(token)
    own = cred.index if cred.index is not None else index
    out = {
        "its own bearer, relabelled": callers.credential_metadata(cred.bearer(own, callee), target, index),
        "its key under its cert": callers.credential_metadata(
            auth.Credential(target, index, (callee,), cred.key, cred.cert, None).bearer(index, callee), target, index
        ),
    }
    seeds = {"its key": cred.key.private_bytes_raw()}
    for i, m in enumerate(materials(token)):
        seeds[f"value {i}, hashed"] = hashlib.sha256(m).digest()
        if len(m) == 32:
            seeds[f"value {i}"] = m
        for label in ("rlfleet/v2/root", f"rlfleet/v2/key/{target}/{index}", f"rlfleet/v2/key/{target}/*"):
            seeds[f"value {i} as the secret's HMAC key, {label}"] = hmac.new(m, label.encode(), "sha256").digest()
        # the reported attack on the old scheme: a verify key V_b -> K = H(V_b, from/a) -> B = H(K, index/i)
        pair = hmac.new(m, f"from/{target}".encode(), "sha256").digest()
        old = auth._b64(hmac.new(pair, f"index/{index}".encode(), "sha256").digest())
        out[f"value {i}, the old scheme's recipe"] = callers.credential_metadata(old, target, index)
        text = m.decode("ascii", "replace")
        if auth.is_secret(text) and text.strip():
            out[f"value {i} as the run secret"] = auth.metadata(text, target, index, to=callee)
    for name, seed in seeds.items():  # each seed as an issuing key: a cert for itself as the target
        issuer = Ed25519PrivateKey.from_private_bytes(seed)
        cert = issuer.sign(auth._cert_text(target, index, (callee,), auth._public(issuer)).encode())
        out[f"{name}, issuing itself"] = callers.credential_metadata(
            auth.Credential(target, index, (callee,), issuer, cert, None).bearer(index, callee), target, index
        )
    return out


# what each role may not do, and must not be able to make itself able to: a method owned by another role per server
STOLEN = {
    "learner": [("inference", "/rlfleet.v1.InferenceService/UpdateWeights")],
    "coordinator": [
        ("learner", "/rlfleet.v1.LearnerService/Train"),
        ("learner", "/rlfleet.v1.LearnerService/LogMetrics"),
        ("env", "/rlfleet.v1.RolloutService/Collect"),
    ],
    "env": [
        ("learner", "/rlfleet.v1.LearnerService/PushRollout"),
        ("coordinator", "/rlfleet.v1.CoordinatorService/Register"),
    ],
    "inference": [("coordinator", "/rlfleet.v1.CoordinatorService/Heartbeat")],
    "ctl": [
        ("coordinator", "/rlfleet.v1.CoordinatorService/Stop"),
        ("coordinator", "/rlfleet.v1.CoordinatorService/Scale"),
    ],
}


def call(channels, path: str, metadata) -> tuple[grpc.StatusCode, str]:
    """``path`` called on the server of its role (channels: role -> a channel to it) -> (status code, details)."""
    callee = callers.callee_role(path)
    svc_name, method_name = path.strip("/").split("/")
    svc = next(s for s in SERVICE_DESCRIPTORS[callee] if s.full_name == svc_name)
    return raw_call(channels[callee], svc, svc.methods_by_name[method_name], metadata)


class Output:
    """The coordinator's output, read as it comes (a run of hundreds of epochs would fill the pipe)."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self.thread.start()

    def text(self) -> str:
        self.thread.join(30)
        return "".join(self.lines)


def test_no_leaked_credential_acts_as_another_role_or_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, SECRET)  # the coordinator's secret, known here: it alone issues
    proc = start(tmp_path, "runner.max_epochs=1000", "runner.val_check_interval=0", name="creds")
    monkeypatch.delenv(auth.TOKEN_ENV)
    output = Output(proc)
    run = tmp_path / "creds"
    try:
        st = wait_epoch(run, 2, proc)
        addresses = {ROLE_NAMES[s.role]: s.address for s in st.services}
        addresses["coordinator"] = json.loads((run / "coordinator.json").read_text())["address"]
        channels = {role: grpc.insecure_channel(address) for role, address in addresses.items()}
        # what each holds: the services' own credentials, as handed to their processes; the coordinator's calls'
        # credential (it holds the secret: the issuer); the operator's, the run folder's run_token
        held = {ROLE_NAMES[s.role]: process_credential(s.pid) for s in st.services}
        held["coordinator"] = auth.issue(SECRET, "coordinator", 0)
        held["ctl"] = (run / "run_token").read_text()
        assert oct((run / "run_token").stat().st_mode & 0o777) == "0o600"
        for role, token in held.items():
            cred = auth.parse_credential(token)
            assert cred.role == role and auth.is_credential(token), role
            with pytest.raises(auth.CredentialError, match="needs the run secret"):
                auth.issue(token, "learner", 0)  # no credential issues, the operator's included
        assert not (run / auth.SECRET_FILE).exists()  # a local run keeps its secret in the coordinator's memory

        # 1. each credential, honestly as itself, on every method of every service: what its role does not own
        # (or a server its role does not call) is refused; what it owns passes (reads: tried below)
        tried = 0
        for role, token in held.items():
            index = 0
            for callee, services in SERVICE_DESCRIPTORS.items():
                md = auth.metadata(token, role, index, to=callee)
                for svc in services:
                    for method in svc.methods:
                        path = method_path(svc, method)
                        if served_by(role, path):
                            continue
                        code, details = call(channels, path, md)
                        assert code == grpc.StatusCode.PERMISSION_DENIED, (role, path, code, details)
                        tried += 1
                        # and claiming any other role with it
                        for other in callers.ROLES:
                            if other != role:
                                forged = [*md[:1], (callers.ROLE_KEY, other), md[2]]
                                code, details = call(channels, path, forged)
                                assert code == grpc.StatusCode.PERMISSION_DENIED, (role, other, path, code)
                                assert f"this credential is {role}[0]'s, not {other}[0]'s" in details
        assert tried > 50, tried
        # an index-bound credential signing as another index of its role
        env_cred = auth.parse_credential(held["env"])
        md = callers.credential_metadata(env_cred.bearer(1, "learner"), "env", 1)
        code, details = call(channels, "/rlfleet.v1.LearnerService/PushRollout", md)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "env[0]'s, not env[1]'s" in details, details

        # 2. everything each credential holds, made into another role's bearer for what that role owns: refused
        for role, token in held.items():
            for target, calls in STOLEN.items():
                if target == role:
                    continue
                for callee, path in calls:
                    for how, md in forgeries(token, target, 0, callee).items():
                        code, details = call(channels, path, md)
                        assert code in REFUSED, (role, target, path, how, code, details)

        # 3. the inference server's credential (the reported leak) cannot send UpdateWeights, in any way
        inf = auth.parse_credential(held["inference"])
        with grpc.insecure_channel(addresses["inference"]) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            for md, words in (
                (
                    auth.metadata(held["inference"], "inference", 0, to="inference"),
                    "inference[0]'s credential calls coordinator servers, not inference servers",
                ),
                (
                    callers.credential_metadata(inf.bearer(0, "inference"), "learner", 0),
                    "this credential is inference[0]'s, not learner[0]'s",
                ),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    stub.UpdateWeights(iter([inference_pb2.WeightsChunk(version=2**62)]), timeout=5, metadata=md)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and words in err.value.details()
            # 4. the learner's own identity: a made-up version is refused before anything is read
            learner_md = auth.metadata(SECRET, "learner", 0, to="inference")
            for version in (2**62, -1, 2**31):
                with pytest.raises(grpc.RpcError) as err:
                    stub.UpdateWeights(
                        iter([inference_pb2.WeightsChunk(version=version)]), timeout=5, metadata=learner_md
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert f"version: {version} is no weights version" in err.value.details()

        # 5. a rollout is its own env server's: env[1] (index-bound, or a role-wide credential claiming 1) pushing
        # worker 0's, env[0] pushing worker 1's
        st = wait_epoch(run, 3, proc)
        with grpc.insecure_channel(addresses["learner"]) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            for token, index, worker in (
                (auth.issue(SECRET, "env", 1), 1, 0),
                (auth.issue(SECRET, "env"), 1, 0),
                (held["env"], 0, 1),
            ):
                chunk = learner_pb2.RolloutChunk(epoch=st.epoch + 1, worker_index=worker, num_steps=1, last=True)
                with pytest.raises(grpc.RpcError) as err:
                    stub.PushRollout(
                        iter([chunk]), timeout=5, metadata=auth.metadata(token, "env", index, to="learner")
                    )
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
                assert f"env[{index}] pushed the rollout of worker {worker}" in err.value.details()

        # the legitimate path: each credential's own reads are served
        for role, token in held.items():
            code, details = call(
                channels, "/rlfleet.v1.CoordinatorService/Status", auth.metadata(token, role, 0, to="coordinator")
            )
            assert code == grpc.StatusCode.OK, (role, code, details)
        code, details = call(
            channels, "/rlfleet.v1.LearnerService/Status", auth.metadata(held["env"], "env", 0, to="learner")
        )
        assert code == grpc.StatusCode.OK, details
        before = wait_epoch(run, st.epoch + 3, proc).epoch  # the run goes on
        # the operator stops it with the run folder's run_token (coordinatorctl stop)
        out = subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        code = proc.wait(240)
        for ch in channels.values():
            ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    out = output.text()
    assert code == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] > before and not summary["restarts"], summary
    weights = [r["train/weights_version"] for r in read_metrics(run) if "train/weights_version" in r]
    assert weights == sorted(weights) and max(weights) <= summary["epochs"]  # no forged version got in
