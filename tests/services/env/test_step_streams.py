"""EnvService's Step-stream limit over real gRPC on loopback, with the run's credentials: streams that hold a slot
while idle give it up when someone else needs it; streams that step are never taken away."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pytest

from rlfleet.v1 import env_pb2, env_pb2_grpc
from rlfleet.wire import auth, codec, servers
from services.env.server import EnvServicer, env_kwargs
from services.env.vec_env import VecEnv

SECRET = "step-stream-secret"
RECLAIM_S = 1.0


@pytest.fixture
def env_server(cfg):
    auth.set_identity("env", auth.issue(SECRET, "env", 0), 0)
    env = VecEnv(**env_kwargs(cfg, "train", 2, 0, True))
    server = servers.make_server(max_workers=8)
    env_pb2_grpc.add_EnvServiceServicer_to_server(
        EnvServicer(env, owns_env=True, step_idle_reclaim_s=RECLAIM_S), server
    )
    address = servers.bind(server, "127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(address)
    stub = env_pb2_grpc.EnvServiceStub(ch)
    stub.Reset(env_pb2.ResetRequest(), metadata=MD, timeout=30)
    yield stub
    ch.close()
    server.stop(0)
    env.close()
    auth.set_identity("env", None)


MD = auth.metadata(SECRET, "ctl", to="env")
STEP = env_pb2.StepRequest(env_ids=[0], actions=codec.encode(np.zeros((1, 4), np.float32)))


class Stream:
    """One open Step stream: ``step()`` sends a request and waits for its answer."""

    def __init__(self, stub):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.Step(iter(self.q.get, None), metadata=MD, timeout=60)

    def step(self):
        self.q.put(STEP)
        return next(self.replies)

    def close(self):
        self.q.put(None)
        self.replies.cancel()


def test_idle_streams_give_their_slot_to_a_newcomer(env_server):
    """Four authenticated streams that step once and then idle: a fifth caller is refused while they are fresh,
    served once one has idled RECLAIM_S; the idle one whose slot was taken ends with DEADLINE_EXCEEDED."""
    spec = env_server.Describe(env_pb2.DescribeEnvRequest(), metadata=MD, timeout=5)
    idle = [Stream(env_server) for _ in range(spec.max_step_streams)]
    for s in idle:
        assert s.step().rewards.shape == [1]
    newcomer = Stream(env_server)
    with pytest.raises(grpc.RpcError) as err:
        newcomer.step()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent Step streams" in err.value.details()
    time.sleep(RECLAIM_S + 0.3)
    late = Stream(env_server)
    assert late.step().rewards.shape == [1]  # served: an idle stream made room
    ended = []
    for s in idle:
        try:
            s.step()
        except grpc.RpcError as exc:
            ended.append(exc)
    assert len(ended) == 1 and ended[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "idle for 1s while another caller needed its slot" in ended[0].details()
    for s in [*idle, late, newcomer]:
        s.close()


def test_streams_that_step_are_never_reclaimed(env_server):
    """max_step_streams streams stepping without pause: a newcomer is refused however long it waits."""
    spec = env_server.Describe(env_pb2.DescribeEnvRequest(), metadata=MD, timeout=5)
    busy = [Stream(env_server) for _ in range(spec.max_step_streams)]
    for s in busy:
        s.step()
    stop, failures = threading.Event(), []

    def keep_stepping(s):
        try:
            while not stop.is_set():
                s.step()
        except grpc.RpcError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=keep_stepping, args=(s,), daemon=True) for s in busy]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            time.sleep(RECLAIM_S * 0.7)
            with pytest.raises(grpc.RpcError) as err:
                Stream(env_server).step()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not failures
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for s in busy:
            s.close()
    assert env_server.Describe(env_pb2.DescribeEnvRequest(), metadata=MD, timeout=5).num_envs == 2
