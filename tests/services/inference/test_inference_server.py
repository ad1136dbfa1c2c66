"""InferenceService over real gRPC: batching across streams, hot weight swap, bad input."""

import os
import queue
import threading

import grpc
import numpy as np
import pytest
import torch

from rlfleet.policies.models.actor_critic import ActorCritic
from rlfleet.v1 import inference_pb2, inference_pb2_grpc
from rlfleet.wire import channels, codec, weights
from rlfleet.wire.clients import GrpcPolicyClient, PolicyError
from rlfleet.wire.spaces import TensorSpace

SPECS = {"state": TensorSpace((13,), "float32")}


def publish(addr, version, seed=0, log_std=-0.5):
    torch.manual_seed(seed)
    m = ActorCritic(SPECS, 4, hidden_dims=[64, 64], init_log_std=log_std)
    stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
    return m, stub.UpdateWeights(weights.iter_chunks(m.state_dict(), version, obs_specs=SPECS, action_dim=4))


@pytest.fixture
def inference(cfg):
    from services.inference import server

    srv, addr, engine, _ = server.serve(cfg, "127.0.0.1:0")
    yield addr, engine
    srv.stop(0)
    engine.stop()


def test_act_before_weights_is_failed_precondition(inference):
    addr, _ = inference
    client = GrpcPolicyClient([addr], 1)
    client.submit(0, {"state": np.zeros((2, 13), np.float32)})
    with pytest.raises(PolicyError, match="no policy weights loaded yet"):
        client.result(0)
    client.close()


def test_actions_match_local_policy(inference):
    addr, _ = inference
    model, resp = publish(addr, 1)
    assert resp.version == 1
    obs = np.random.default_rng(0).normal(size=(5, 13)).astype(np.float32)
    client = GrpcPolicyClient([addr], 1, action_dim=4)
    client.submit(0, {"state": obs}, deterministic=True)
    res = client.result(0)
    out = model.act({"state": torch.from_numpy(obs)}, deterministic=True)
    a, v = out.actions, out.values
    assert res.weights_version == 1
    assert np.allclose(res.actions, a.numpy(), atol=1e-5) and np.allclose(res.values, v.numpy(), atol=1e-5)
    client.close()


@pytest.fixture
def cfg_wait(cfg):
    cfg.rollout.max_wait_ms = 50.0
    return cfg


def test_dynamic_batching_across_streams(cfg_wait):
    from services.inference import server

    srv, addr, engine, _ = server.serve(cfg_wait, "127.0.0.1:0")
    publish(addr, 1)
    n_streams, n_requests = 6, 20
    client = GrpcPolicyClient([addr], n_streams, action_dim=4)
    barrier = threading.Barrier(n_streams)
    errors = []

    def run(s):
        try:
            for _ in range(n_requests):
                barrier.wait()
                client.submit(s, {"state": np.zeros((4, 13), np.float32)})
                client.result(s)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(n_streams)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert engine.requests_served == n_streams * n_requests
    # every round's 6 requests run as one batch (allowing a few rounds split by scheduling)
    assert engine.batches_run <= 1.5 * n_requests, (engine.batches_run, engine.requests_served)
    client.close()
    srv.stop(0)
    engine.stop()


def test_hot_swap_keeps_in_flight_requests(inference):
    addr, engine = inference
    publish(addr, 1)
    client = GrpcPolicyClient([addr], 1, action_dim=4)
    versions = []
    for i in range(30):
        client.submit(0, {"state": np.zeros((3, 13), np.float32)})
        if i == 10:
            publish(addr, 2, seed=1)
        versions.append(client.result(0).weights_version)
    assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions)
    client.close()


def _act_error(addr, obs):
    stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
    q = queue.SimpleQueue()
    q.put(inference_pb2.ActRequest(request_id=0, observations=codec.encode_map(obs)))
    q.put(None)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Act(iter(q.get, None)))
    return err.value


def test_bad_observations_are_invalid_argument(inference):
    addr, _ = inference
    publish(addr, 1)
    e = _act_error(addr, {"state": np.zeros((2, 12), np.float32)})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "observations['state']: shape [2, 12]" in e.details()
    e = _act_error(addr, {"state": np.full((2, 13), np.nan, np.float32)})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in e.details()
    e = _act_error(addr, {"pixels": np.zeros((2, 13), np.float32)})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys ['pixels']" in e.details()
    # stale weights are refused, the server keeps serving
    stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
    publish(addr, 5)
    with pytest.raises(grpc.RpcError) as err:
        publish(addr, 3)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale weights version 3" in err.value.details()
    assert stub.Describe(inference_pb2.DescribeInferenceRequest()).weights_version == 5
    # a weights set with a wrong tensor shape names the tensor
    m = ActorCritic(SPECS, 4, hidden_dims=[64, 64])
    state = m.state_dict()
    state["log_std"] = torch.zeros(5)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeights(weights.iter_chunks(state, 6))
    assert "weights['log_std']: shape [5] where [4] was expected" in err.value.details()


def test_oversized_request_refused_before_it_blocks_others(inference):
    addr, _ = inference
    publish(addr, 1)
    e = _act_error(addr, {"state": np.zeros((5000, 13), np.float32)})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5000 rows in one request; at most 4096 (rollout.max_rows_per_request)" in e.details()


def test_many_concurrent_streams_are_all_served(cfg):
    """256 Act streams open at once: every one gets its answers (a 64-thread pool used to starve 192 of them)."""
    import time

    from services.inference import server

    srv, addr, engine, _ = server.serve(cfg, "127.0.0.1:0")
    try:
        publish(addr, 1)
        n = 256
        clients = [GrpcPolicyClient([addr], 1, 4, timeout=60) for _ in range(n)]
        latencies = []
        for _ in range(2):
            t0 = time.perf_counter()
            for c in clients:
                c.submit(0, {"state": np.zeros((1, 13), np.float32)})
            for c in clients:
                assert c.result(0).actions.shape == (1, 1, 4)
                latencies.append(time.perf_counter() - t0)
        assert max(latencies) < 30, max(latencies)
        for c in clients:
            c.close()
    finally:
        srv.stop(0)
        engine.stop()


# --- issue 25: a weights set whose declared spaces would not fit ------------------------------------------------
def _update_with_spaces(addr, specs, version=1):
    """UpdateWeights declaring ``specs`` with a small (mismatched) state: what an outside user sent."""
    m = ActorCritic(SPECS, 4, hidden_dims=[64, 64])
    stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
    return stub.UpdateWeights(weights.iter_chunks(m.state_dict(), version, obs_specs=specs, action_dim=4), timeout=30)


def test_declared_spaces_are_checked_before_anything_is_built(inference):
    """An observation space of 2**31 elements (the codec's limit, so it passes the shape check) used to be built
    first: the server's memory rose to ~23 GB before the kernel killed it."""
    import resource
    import time

    addr, engine = inference
    publish(addr, 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    for shape in ([2**31], [2**16, 2**15], [2**26 + 1]):
        with pytest.raises(grpc.RpcError) as err:
            _update_with_spaces(addr, {"state": TensorSpace(tuple(shape), "float32")}, version=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "observation_space: one observation row declares" in err.value.details()
        assert "at most 256 MiB, what one request can carry" in err.value.details()
    assert time.monotonic() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # KiB: nothing was built
    # still serving the earlier weights
    stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
    assert stub.Describe(inference_pb2.DescribeInferenceRequest()).weights_version == 1
    client = GrpcPolicyClient([addr], 1, action_dim=4)
    client.submit(0, {"state": np.zeros((2, 13), np.float32)})
    assert client.result(0).weights_version == 1
    client.close()


def test_a_policy_that_would_not_fit_the_memory_budget_is_resource_exhausted(inference, monkeypatch):
    from services.inference import engine as engine_module

    built = []
    real_build = engine_module.build_policy
    monkeypatch.setattr(engine_module, "build_policy", lambda *a, **kw: built.append(a) or real_build(*a, **kw))
    addr, engine = inference
    engine.memory_budget_bytes = 8 * 2**20  # two copies of an MLP for 100k-float observations: ~50 MB
    with pytest.raises(grpc.RpcError) as err:
        _update_with_spaces(addr, {"state": TensorSpace((100_000,), "float32")})
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "observation_space: a mlp policy for spaces state[100000]" in err.value.details()
    assert "GiB are available" in err.value.details()
    assert engine.model is None
    # a state that does not match the declared spaces is refused before the build, naming the tensor
    with pytest.raises(grpc.RpcError) as err:
        _update_with_spaces(addr, {"state": TensorSpace((20,), "float32")})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weights['obs_rms.mean']: shape [13] where [20] was expected" in err.value.details()
    assert not built  # neither set got as far as building a policy
    _, resp = publish(addr, 3)  # a policy that fits is served
    assert resp.version == 3 and engine.version == 3 and len(built) == 1


# --- issue 34: observations and weights by shared-memory handle from a caller on this host ------------------------------
def _act(addr, obs, keys, shared_memory):
    client = GrpcPolicyClient([addr], 1, action_dim=4, shared_memory=shared_memory)
    try:
        if client.streams[0].arena is not None:
            client.streams[0].arena.min_bytes = 0  # every observation by handle, however small
        out = []
        for _ in range(3):  # the stream's ring of two segments, then the first again
            client.submit(0, obs, deterministic=False, noise_keys=keys)
            out.append(client.result(0))
        return out, client.wire_stats(), client.streams[0].arena is not None
    finally:
        client.close()


def test_act_through_shared_memory_gives_the_grpc_path_bits(inference):
    from rlfleet.wire import shm

    addr, _ = inference
    before = set(shm.segments_of())  # (other tests' servers in this process may still hold theirs)
    publish(addr, 1)
    obs = {"state": np.random.default_rng(0).normal(size=(6, 13)).astype(np.float32)}
    keys = np.arange(6, dtype=np.uint64) * 7919
    shared, shared_wire, used = _act(addr, obs, keys, True)
    inline, inline_wire, unused = _act(addr, obs, keys, False)
    assert used and not unused
    assert shared_wire.shm_bytes == 3 * obs["state"].nbytes and inline_wire.shm_bytes == 0
    assert inline_wire.bytes > shared_wire.bytes + 3 * obs["state"].nbytes - 200  # the handle replaced the bytes
    for a, b in zip(shared, inline):
        assert a.actions.tobytes() == b.actions.tobytes() and a.log_probs.tobytes() == b.log_probs.tobytes()
        assert a.values.tobytes() == b.values.tobytes() and a.weights_version == b.weights_version == 1
    # the clients closed: none of their segments is open or mapped in this process (the server's streams included)
    assert set(shm.segments_of()) <= before


def test_weights_through_shared_memory_are_the_grpc_path_bits(inference, monkeypatch):
    from rlfleet.wire import shm
    from services.learner.publisher import WeightPublisher

    addr, engine = inference
    before = set(shm.segments_of())
    monkeypatch.setattr(shm, "MIN_BYTES", 0)  # every tensor by handle
    torch.manual_seed(3)
    model = ActorCritic(SPECS, 4, hidden_dims=[64, 64], init_log_std=-0.5)
    state = model.state_dict()
    names = list(state)

    def gather(wanted):  # two buckets: the ring's two segments
        yield {n: state[n] for n in wanted[:3]}
        yield {n: state[n] for n in wanted[3:]}

    for version, shared_memory in ((1, True), (2, False)):
        pub = WeightPublisher(shared_memory=shared_memory)
        pub.publish([addr], version, gather, names, names, SPECS, 4)
        assert (pub.last_wire.shm_bytes > 0) == shared_memory
        assert pub.last_wire.shm_bytes == (
            sum(t.numel() * t.element_size() for t in state.values()) if shared_memory else 0
        )
        served = engine.model.state_dict()
        assert engine.version == version
        for n in names:
            assert served[n].dtype == state[n].dtype and served[n].numpy().tobytes() == state[n].numpy().tobytes(), n
    assert set(shm.segments_of()) <= before  # the publisher closed its ring, the server dropped its mappings


def test_forged_observation_handles_are_invalid_argument_naming_the_field(inference, tmp_path):
    from rlfleet.wire import shm

    addr, _ = inference
    publish(addr, 1)
    arena = shm.Arena("forger", slots=1, min_bytes=0)
    good = codec.encode_map({"state": np.zeros((2, 13), np.float32)}, arena=arena).tensors["state"]
    held = tmp_path / "held.bin"
    held.write_bytes(bytes(4096))

    def act_with(**fields) -> grpc.RpcError:
        t = codec.Tensor()
        t.CopyFrom(good)
        for k, v in fields.items():
            setattr(t.shared, k, v)
        req = inference_pb2.ActRequest(request_id=0)
        req.observations.tensors["state"].CopyFrom(t)
        stub = inference_pb2_grpc.InferenceServiceStub(channels.channel(addr))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Act(iter([req])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        return err.value.details()

    try:
        assert "observations['state'].shared.key: does not match" in act_with(key=bytes(16))
        with open(held, "rb") as f:  # a file the server's process has open (the server runs in this process)
            assert (
                f"observations['state'].shared.fd: fd {f.fileno()} of process {os.getpid()} is not an rlfleet "
                f"shared-memory segment"
            ) in act_with(fd=f.fileno())
        assert "observations['state'].shared.offset: bytes [" in act_with(offset=1 << 30)
        assert "observations['state'].shared.generation: 7, the segment is at generation 1 (a stale handle" in act_with(
            generation=7
        )
        other = os.memfd_create("not-ours")
        try:
            assert "is not an rlfleet shared-memory segment" in act_with(fd=other)
        finally:
            os.close(other)
    finally:
        arena.close()


def test_a_server_with_shared_memory_off_takes_inline_bytes_only(cfg):
    from rlfleet.wire import shm
    from services.inference import server

    cfg.cluster.shared_memory = "inline"
    srv, addr, engine, _ = server.serve(cfg, "127.0.0.1:0")
    try:
        publish(addr, 1)
        client = GrpcPolicyClient([addr], 1, action_dim=4)  # offers; the server declines
        assert client.streams[0].arena is None
        assert client.streams[0].shared_memory_why == "cluster.shared_memory: inline"
        client.submit(0, {"state": np.zeros((2, 13), np.float32)})
        assert client.result(0).actions.shape == (2, 1, 4)
        client.close()
        arena = shm.Arena("unasked", slots=1, min_bytes=0)
        req = inference_pb2.ActRequest(
            request_id=0, observations=codec.encode_map({"state": np.zeros((2, 13), np.float32)}, arena=arena)
        )
        with pytest.raises(grpc.RpcError) as err:
            list(inference_pb2_grpc.InferenceServiceStub(channels.channel(addr)).Act(iter([req])))
        arena.close()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "observations['state'].shared: a shared-memory handle where inline bytes (data) are expected"
            in err.value.details()
        )
    finally:
        srv.stop(0)
        engine.stop()
