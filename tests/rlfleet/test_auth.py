"""rlfleet.wire.auth: credentials per role and index; rlfleet.wire.rpc: which calls pass the check (no processes,
no gRPC)."""

import pytest

from rlfleet.wire import auth, rpc

SECRET = "s3cret-of-the-run"


@pytest.fixture(autouse=True)
def no_identity():
    yield
    auth.set_identity("learner", None)


def as_server(role, *, issued=True):
    return auth.set_identity(role, auth.issue(SECRET, role, 0) if issued else SECRET, 0)


def test_no_identity_checks_nothing():
    auth.set_identity("env", None)
    assert rpc.check_caller("/rlfleet.v1.LearnerService/Train", []) is None
    assert rpc.call_metadata("/rlfleet.v1.LearnerService/Train") == []


def test_owning_role_with_its_own_credential_passes():
    as_server("learner")
    caller = rpc.check_caller("/rlfleet.v1.LearnerService/Train", auth.metadata(SECRET, "coordinator", to="learner"))
    assert (caller.role, caller.index) == ("coordinator", 0)
    # a read: any role's valid credential
    assert rpc.check_caller("/rlfleet.v1.LearnerService/Status",
                            auth.metadata(SECRET, "ctl", to="learner")).role == "ctl"
    assert rpc.check_caller("/rlfleet.v1.LearnerService/PushRollout",
                            auth.metadata(SECRET, "env", 7, to="learner")) == rpc.Caller("env", 7)


def test_missing_or_wrong_credentials_are_unauthenticated():
    as_server("learner")
    good = auth.metadata(SECRET, "coordinator", to="learner")
    for bad in ([], [(rpc.TOKEN_KEY, SECRET)], [(rpc.TOKEN_KEY, f"Bearer {SECRET}"), (rpc.ROLE_KEY, "coordinator")],
                auth.metadata("another-run", "coordinator", to="learner"),
                auth.metadata(SECRET, "coordinator", to="inference"),  # the bearer for another callee role
                [*good[:2], (rpc.INDEX_KEY, "1")],  # index 0's bearer claiming index 1
                [*good[:2], (rpc.INDEX_KEY, "-1")], [*good[:2], (rpc.INDEX_KEY, "9" * 40)],
                [good[0], (rpc.ROLE_KEY, "root"), good[2]], [(rpc.TOKEN_KEY, "Bearer \u00e9"), *good[1:]]):
        with pytest.raises(rpc.AuthError) as err:
            rpc.check_caller("/rlfleet.v1.LearnerService/Train", bad)
        assert err.value.args[0] == "UNAUTHENTICATED", bad


def test_roles_are_proven_not_declared():
    """The reported attacks: an env credential claiming learner for UpdateWeights, or Register as the learner."""
    as_server("inference")
    forged = auth.metadata(SECRET, "env", 0, to="inference")
    forged[1] = (rpc.ROLE_KEY, "learner")
    with pytest.raises(rpc.AuthError) as err:
        rpc.check_caller("/rlfleet.v1.InferenceService/UpdateWeights", forged)
    assert err.value.args == ("PERMISSION_DENIED", "this credential is env[0]'s, not learner[0]'s: a service acts "
                                                   "only in its own role")
    with pytest.raises(rpc.AuthError) as err:  # honest about being env: still not the owner
        rpc.check_caller("/rlfleet.v1.InferenceService/UpdateWeights", auth.metadata(SECRET, "env", to="inference"))
    assert err.value.args == ("PERMISSION_DENIED", "/rlfleet.v1.InferenceService/UpdateWeights is accepted only "
                                                   "from learner, not from env")
    assert rpc.check_caller("/rlfleet.v1.InferenceService/UpdateWeights",
                            auth.metadata(SECRET, "learner", to="inference")).role == "learner"


def test_a_leaked_env_credential_yields_no_other_role():
    """Everything an env credential holds (its bearers and its verify key) makes env calls and calls *to* env
    servers; none of it is a bearer any other server accepts from another role."""
    env_cred = auth.parse_credential(auth.issue(SECRET, "env"))  # role-wide, what a StatefulSet pod gets
    assert set(env_cred["to"]) == {"coordinator", "inference", "learner"}
    leaked = [env_cred["verify"], *env_cred["to"].values()]
    # every bearer derivable from the leaked material with one more HMAC step, for any role and a few indices
    derived = {auth._b64(k) for k in leaked}
    for key in leaked:
        for role in rpc.ROLES:
            derived |= {rpc.bearer(auth._pair_key(key, role), i) for i in range(4)}
            derived |= {rpc.bearer(key, i) for i in range(4)}
    for server in ("coordinator", "inference", "learner"):
        for role in ("coordinator", "inference", "learner", "ctl"):
            for i in range(4):
                real = dict(auth.metadata(SECRET, role, i, to=server))[rpc.TOKEN_KEY][7:]
                assert real not in derived, (server, role, i)
    # and what the env role itself may do is what its credential makes
    as_server("learner")
    auth.set_identity("env", auth.issue(SECRET, "env"), 3)
    md = rpc.call_metadata("/rlfleet.v1.LearnerService/PushRollout")
    as_server("learner")
    assert rpc.check_caller("/rlfleet.v1.LearnerService/PushRollout", md) == rpc.Caller("env", 3)


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
    assert rpc.call_metadata("/rlfleet.v1.InferenceService/Act") == auth.metadata(SECRET, "env", 2, to="inference")
    # a callee it has no business with: nothing sent (refused there)
    assert rpc.call_metadata("/rlfleet.v1.RolloutService/Collect") == []
    assert rpc.call_metadata("/grpc.health.v1.Health/Check") == []
    # given the secret itself (a hand-made deployment), a service derives the same credential and says it holds more
    ident = auth.set_identity("env", SECRET, 2)
    assert ident.from_secret
    assert rpc.call_metadata("/rlfleet.v1.InferenceService/Act") == auth.metadata(SECRET, "env", 2, to="inference")


def test_probes_stay_open():
    as_server("learner")
    assert rpc.check_caller("/grpc.health.v1.Health/Check", []) is None
    assert rpc.check_caller("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", []) is None


def test_every_owned_method_exists():
    """The ownership table names real methods (a renamed RPC must not silently lose its check)."""
    from rlfleet.v1 import coordinator_pb2, env_pb2, inference_pb2, learner_pb2, rollout_pb2

    real = {f"/{s.full_name}/{m.name}" for mod in (coordinator_pb2, inference_pb2, learner_pb2, rollout_pb2)
            for s in mod.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert set(rpc.METHOD_ROLES) <= real, set(rpc.METHOD_ROLES) - real
    services = {s.full_name for mod in (coordinator_pb2, env_pb2, inference_pb2, learner_pb2, rollout_pb2)
                for s in mod.DESCRIPTOR.services_by_name.values()}
    assert set(rpc.SERVICE_ROLES) == services  # every service's calls carry a bearer


def test_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    path = auth.write_token(tmp_path, "abc")
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_token(tmp_path) == "abc"
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.read_token(tmp_path) == "from-env"


def test_command_line_issues_and_prints_metadata(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    auth.write_token(tmp_path, SECRET)
    assert auth.main(["issue", "--role", "inference", "--index", "1", "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == auth.issue(SECRET, "inference", 1)
    assert auth.main(["metadata", "--to", "learner", "--run-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{k}: {v}" for k, v in auth.metadata(SECRET, "ctl", to="learner")]
