"""rlfleet.auth: which calls pass the credential check (no processes, no gRPC)."""

import pytest

from rlfleet import auth


@pytest.fixture
def as_learner():
    auth.set_identity("learner", "s3cret")
    yield
    auth.set_identity("learner", None)


def md(token="s3cret", role="coordinator"):
    return [(auth.TOKEN_KEY, f"Bearer {token}"), (auth.ROLE_KEY, role)]


def test_no_identity_checks_nothing():
    auth.set_identity("env", None)
    auth.check("/rlfleet.v1.LearnerService/Train", [])
    assert auth.call_metadata() == []


def test_token_and_owning_role_required(as_learner):
    auth.check("/rlfleet.v1.LearnerService/Train", md())
    auth.check("/rlfleet.v1.LearnerService/Status", md(role="ctl"))  # a read: any holder of the token
    for bad in ([], md(token="wrong"), [(auth.TOKEN_KEY, "s3cret")]):
        with pytest.raises(auth.AuthError) as err:
            auth.check("/rlfleet.v1.LearnerService/Train", bad)
        assert err.value.args[0] == "UNAUTHENTICATED"
    with pytest.raises(auth.AuthError) as err:
        auth.check("/rlfleet.v1.LearnerService/Train", md(role="env"))
    assert err.value.args == ("PERMISSION_DENIED", "/rlfleet.v1.LearnerService/Train is accepted only from "
                                                   "coordinator, not from env")


def test_probes_stay_open(as_learner):
    auth.check("/grpc.health.v1.Health/Check", [])
    auth.check("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", [])


def test_every_owned_method_exists():
    """The ownership table names real methods (a renamed RPC must not silently lose its check)."""
    from rlfleet.v1 import coordinator_pb2, inference_pb2, learner_pb2, rollout_pb2

    real = {f"/{s.full_name}/{m.name}" for mod in (coordinator_pb2, inference_pb2, learner_pb2, rollout_pb2)
            for s in mod.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert set(auth.METHOD_ROLES) <= real, set(auth.METHOD_ROLES) - real


def test_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    path = auth.write_token(tmp_path, "abc")
    assert path.stat().st_mode & 0o777 == 0o600
    assert auth.read_token(tmp_path) == "abc"
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.read_token(tmp_path) == "from-env"
