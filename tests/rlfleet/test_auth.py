"""rlfleet.wire.auth: credentials per role and index; rlfleet.wire.callers: which calls pass the check (no processes,
no gRPC)."""

import pytest

from rlfleet.errors import AuthError
from rlfleet.wire import auth, callers

SECRET = "s3cret-of-the-run"


@pytest.fixture(autouse=True)
def no_identity():
    yield
    auth.set_identity("learner", None)


def as_server(role, *, issued=True):
    return auth.set_identity(role, auth.issue(SECRET, role, 0) if issued else SECRET, 0)


def test_no_identity_checks_nothing():
    auth.set_identity("env", None)
    assert callers.check_caller("/rlfleet.v1.LearnerService/Train", []) is None
    assert callers.call_metadata("/rlfleet.v1.LearnerService/Train") == []


def test_owning_role_with_its_own_credential_passes():
    as_server("learner")
    caller = callers.check_caller(
        "/rlfleet.v1.LearnerService/Train", auth.metadata(SECRET, "coordinator", to="learner")
    )
    assert (caller.role, caller.index) == ("coordinator", 0)
    # a read: any role's valid credential
    assert (
        callers.check_caller("/rlfleet.v1.LearnerService/Status", auth.metadata(SECRET, "ctl", to="learner")).role
        == "ctl"
    )
    assert callers.check_caller(
        "/rlfleet.v1.LearnerService/PushRollout", auth.metadata(SECRET, "env", 7, to="learner")
    ) == callers.Caller("env", 7)


def test_missing_or_wrong_credentials_are_unauthenticated():
    as_server("learner")
    good = auth.metadata(SECRET, "coordinator", to="learner")
    for bad in (
        [],
        [(callers.TOKEN_KEY, SECRET)],
        [(callers.TOKEN_KEY, f"Bearer {SECRET}"), (callers.ROLE_KEY, "coordinator")],
        auth.metadata("another-run", "coordinator", to="learner"),
        auth.metadata(SECRET, "coordinator", to="inference"),  # the bearer for another callee role
        [*good[:2], (callers.INDEX_KEY, "1")],  # index 0's bearer claiming index 1
        [*good[:2], (callers.INDEX_KEY, "-1")],
        [*good[:2], (callers.INDEX_KEY, "9" * 40)],
        [good[0], (callers.ROLE_KEY, "root"), good[2]],
        [(callers.TOKEN_KEY, "Bearer \u00e9"), *good[1:]],
    ):
        with pytest.raises(AuthError) as err:
            callers.check_caller("/rlfleet.v1.LearnerService/Train", bad)
        assert err.value.args[0] == "UNAUTHENTICATED", bad


def test_roles_are_proven_not_declared():
    """The reported attacks: an env credential claiming learner for UpdateWeights, or Register as the learner."""
    as_server("inference")
    forged = auth.metadata(SECRET, "env", 0, to="inference")
    forged[1] = (callers.ROLE_KEY, "learner")
    with pytest.raises(AuthError) as err:
        callers.check_caller("/rlfleet.v1.InferenceService/UpdateWeights", forged)
    assert err.value.args == (
        "PERMISSION_DENIED",
        "this credential is env[0]'s, not learner[0]'s: a service acts only in its own role and index",
    )
    with pytest.raises(AuthError) as err:  # honest about being env: still not the owner
        callers.check_caller("/rlfleet.v1.InferenceService/UpdateWeights", auth.metadata(SECRET, "env", to="inference"))
    assert err.value.args == (
        "PERMISSION_DENIED",
        "/rlfleet.v1.InferenceService/UpdateWeights is accepted only from learner, not from env",
    )
    assert (
        callers.check_caller(
            "/rlfleet.v1.InferenceService/UpdateWeights", auth.metadata(SECRET, "learner", to="inference")
        ).role
        == "learner"
    )


def test_a_leaked_credential_signs_only_as_itself():
    """What a credential holds: its own signing key, the run's cert for it and (serving roles) the run's public
    issuing key. The key signs as itself only; signing another role's or index's call with it, or toward servers
    its cert does not name, is refused; the public key checks and never signs. (Against real servers, with every
    derivation from every role's file: tests/hostile/test_credentials.py.)"""
    env = auth.parse_credential(auth.issue(SECRET, "env", 1))
    assert (env.role, env.index, env.to) == ("env", 1, ("coordinator", "inference", "learner"))
    as_server("inference")

    def md(bearer, role, index):
        return callers.credential_metadata(bearer, role, index)

    update = "/rlfleet.v1.InferenceService/UpdateWeights"
    for role, index, words in (("learner", 1, "env[1]'s, not learner[1]'s"), ("env", 0, "env[1]'s, not env[0]'s")):
        with pytest.raises(AuthError) as err:  # its key, signing the other's call
            callers.check_caller(update, md(env.bearer(index, "inference"), role, index))
        assert err.value.args[0] == "PERMISSION_DENIED" and words in err.value.args[1], err.value.args
    # toward a role its cert does not name (env servers): refused there
    as_server("env")
    with pytest.raises(AuthError) as err:
        callers.check_caller("/rlfleet.v1.RolloutService/Collect", md(env.bearer(1, "env"), "env", 1))
    assert err.value.args == (
        "PERMISSION_DENIED",
        "env[1]'s credential calls coordinator/inference/learner servers, not env servers",
    )
    # an inference server's credential: nothing in it signs as the learner (the tester's UpdateWeights of 2**62)
    inf = auth.parse_credential(auth.issue(SECRET, "inference", 0))
    assert inf.to == ("coordinator",) and inf.root is not None
    as_server("inference")
    for bearer in (
        inf.bearer(0, "inference"),
        auth.Credential("learner", 0, ("inference",), inf.key, inf.cert, None).bearer(0, "inference"),
    ):
        with pytest.raises(AuthError) as err:
            callers.check_caller(update, md(bearer, "learner", 0))
        assert err.value.args[0] in ("PERMISSION_DENIED", "UNAUTHENTICATED"), err.value.args
    # the issuing key is the secret's alone: a cert signed with any key a credential holds is not the run's
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for seed in (inf.root, auth._mac(inf.root, "rlfleet/v2/root")):
        forged = auth.Credential(
            "learner",
            0,
            ("inference",),
            inf.key,
            Ed25519PrivateKey.from_private_bytes(seed).sign(
                auth._cert_text("learner", 0, ("inference",), auth._public(inf.key)).encode()
            ),
            None,
        )
        with pytest.raises(AuthError) as err:
            callers.check_caller(update, md(forged.bearer(0, "inference"), "learner", 0))
        assert err.value.args[0] == "UNAUTHENTICATED" and "a cert this run did not issue" in err.value.args[1]
    # and what the env role itself may do is what its credential makes
    auth.set_identity("env", auth.issue(SECRET, "env"), 3)  # role-wide: any index
    pushed = callers.call_metadata("/rlfleet.v1.LearnerService/PushRollout")
    as_server("learner")
    assert callers.check_caller("/rlfleet.v1.LearnerService/PushRollout", pushed) == callers.Caller("env", 3)


def test_a_proven_bearer_is_remembered_per_index_and_callee():
    as_server("learner")
    verifier = callers._identity.verifier
    good = auth.metadata(SECRET, "env", 2, to="learner")
    assert callers.check_caller("/rlfleet.v1.LearnerService/PushRollout", good) == callers.Caller("env", 2)
    assert len(verifier._seen) == 1 and len(verifier._certs) == 1
    assert callers.check_caller("/rlfleet.v1.LearnerService/PushRollout", good) == callers.Caller("env", 2)
    assert len(verifier._seen) == 1  # the second call: a lookup
    with pytest.raises(AuthError) as err:  # the same bearer claiming another index is checked, not looked up
        callers.check_caller("/rlfleet.v1.LearnerService/PushRollout", [*good[:2], (callers.INDEX_KEY, "3")])
    assert err.value.args[0] == "UNAUTHENTICATED"
    with pytest.raises(AuthError):  # a good cert with a made-up call signature
        bad = good[0][1].rsplit(".", 1)[0] + "." + auth._b64(bytes(64))
        callers.check_caller("/rlfleet.v1.LearnerService/PushRollout", [(callers.TOKEN_KEY, bad), *good[1:]])


def test_credentials_of_the_old_scheme_are_refused_by_name():
    old = "rlfleet-cred1." + auth._b64(b'{"role":"env","index":0,"to":{},"verify":"AAAA"}')
    assert auth.is_credential(old) and not auth.is_secret(old)
    with pytest.raises(auth.CredentialError, match="older rlfleet .*issue it again"):
        auth.set_identity("env", old, 0)
    with pytest.raises(auth.CredentialError):
        auth.issue(old, "env", 0)


def test_issued_credentials_are_bound_to_role_and_index():
    bound = auth.issue(SECRET, "env", 2)
    with pytest.raises(auth.CredentialError, match="env\\[2\\]'s credential; this process is env\\[1\\]"):
        auth.set_identity("env", bound, 1)
    with pytest.raises(auth.CredentialError, match="this is the env role.s credential; this process is learner"):
        auth.set_identity("learner", bound, 2)
    with pytest.raises(auth.CredentialError, match="not a valid rlfleet credential"):
        auth.set_identity("env", auth.CREDENTIAL_PREFIX + "garbage", 0)
    with pytest.raises(auth.CredentialError):
        auth.issue(bound, "env", 0)  # a credential cannot issue others
    ident = auth.set_identity("env", bound, 2)
    assert not ident.from_secret
    assert callers.call_metadata("/rlfleet.v1.InferenceService/Act") == auth.metadata(SECRET, "env", 2, to="inference")
    # a callee it has no business with: nothing sent (refused there)
    assert callers.call_metadata("/rlfleet.v1.RolloutService/Collect") == []
    assert callers.call_metadata("/grpc.health.v1.Health/Check") == []
    # given the secret itself (a hand-made deployment), a service derives the same credential and says it holds more
    ident = auth.set_identity("env", SECRET, 2)
    assert ident.from_secret
    assert callers.call_metadata("/rlfleet.v1.InferenceService/Act") == auth.metadata(SECRET, "env", 2, to="inference")


def test_probes_stay_open():
    as_server("learner")
    assert callers.check_caller("/grpc.health.v1.Health/Check", []) is None
    assert callers.check_caller("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", []) is None


def test_every_owned_method_exists():
    """The ownership table names real methods (a renamed RPC must not silently lose its check)."""
    from rlfleet.v1 import coordinator_pb2, env_pb2, inference_pb2, learner_pb2, rollout_pb2

    real = {
        f"/{s.full_name}/{m.name}"
        for mod in (coordinator_pb2, inference_pb2, learner_pb2, rollout_pb2)
        for s in mod.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }
    assert set(callers.METHOD_ROLES) <= real, set(callers.METHOD_ROLES) - real
    services = {
        s.full_name
        for mod in (coordinator_pb2, env_pb2, inference_pb2, learner_pb2, rollout_pb2)
        for s in mod.DESCRIPTOR.services_by_name.values()
    }
    assert set(callers.SERVICE_ROLES) == services  # every service's calls carry a bearer


def test_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    path = auth.write_token(tmp_path, "abc")
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_token(tmp_path) == "abc"
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.read_token(tmp_path) == "from-env"


def test_command_line_issues_and_prints_metadata(tmp_path, monkeypatch, capsys):
    """issue reads the secret (attach mode's run_secret); metadata the operator's credential (run_token), which
    issues nothing."""
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    auth.write_token(tmp_path, SECRET, auth.SECRET_FILE)
    operator = auth.issue(SECRET, "ctl")
    auth.write_token(tmp_path, operator)
    assert auth.main(["issue", "--role", "inference", "--index", "1", "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == auth.issue(SECRET, "inference", 1)
    assert auth.main(["metadata", "--to", "learner", "--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{k}: {v}" for k, v in auth.metadata(operator, "ctl", to="learner")]
    (tmp_path / auth.SECRET_FILE).unlink()
    for argv in (["issue", "--role", "learner"], ["metadata", "--role", "learner", "--to", "inference"]):
        with pytest.raises(SystemExit):  # the operator's credential makes no other role's
            auth.main([*argv, "--run-dir", str(tmp_path)])
    monkeypatch.setenv(auth.TOKEN_ENV, operator)
    with pytest.raises(SystemExit):
        auth.main(["issue", "--role", "learner"])
    assert "issue needs the run secret: a credential issues nothing" in capsys.readouterr().err
