"""Peers that lie about sizes (issue 33): an env server whose Describe, Reset or Step claims absurd sizes, against
`coordinatorctl check-env` as a user runs it and against the run's bridge to an external simulator
(services/env/remote.py). Each claim must end in a named, one-line error within seconds, with the client's peak
memory bounded: every client runs in a process of its own, which reports its peak resident memory (VmHWM) as it
exits, under an address-space cap, so that a regression ends in a MemoryError there instead of the machine's OOM
killer. (Not ``os.wait4``'s ru_maxrss: Linux carries the forking parent's resident size over into the child's.) The liar is a real EnvService on loopback: the conformance tests' example server
(examples/point_reach_env_server.py) with one lie each.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from rlfleet.v1 import env_pb2, inference_pb2, inference_pb2_grpc, rollout_pb2, tensor_pb2
from rlfleet.wire import channels, codec, env_contract, limits
from tests.rlfleet.test_conformance import ROOT, _serve, example

F32, U8 = tensor_pb2.FLOAT32, tensor_pb2.UINT8
NUM_ENVS = 2
SECONDS = 10.0  # to the named error, process start included
GROWTH_MB = 200  # peak memory over an honest run of the same client
ADDRESS_SPACE = 3 << 30  # the clients' cap: gigabytes allocated for a claim fail there, not on the machine


def _tensor(a) -> tensor_pb2.Tensor:
    return example.tensor(np.asarray(a))


def _many_entries(n: int) -> bytes:
    """``n`` entries of EnvSpec.observation_space (field 3, a map of string -> TensorSpec) as wire bytes: built
    directly, 19 bytes each, since a million map insertions from Python would take the test a while."""
    spec = tensor_pb2.TensorSpec(dtype=F32, shape=[1]).SerializeToString()
    value = b"\x12" + bytes([len(spec)]) + spec
    out = []
    for i in range(n):
        key = b"o%07d" % i
        entry = b"\x0a" + bytes([len(key)]) + key + value
        out.append(b"\x1a" + bytes([len(entry)]) + entry)
    return b"".join(out)


class Liar(example.PointReach):
    """The example server, telling one ``lie`` in its Describe, Reset or Step replies (None: honest)."""

    def __init__(self, lie: str | None):
        super().__init__(NUM_ENVS, 10)
        self.lie = lie
        self.stopped = threading.Event()
        # the big parts of a lie, built once (the kit asks many times)
        self._entries = _many_entries(10**6) if lie == "keys_1e6" else b""
        self._tensors = tensor_pb2.TensorMap()
        self._replies: dict[int, env_pb2.ResetResponse] = {}
        if lie == "reset_tensors_1e5":
            one = _tensor(np.zeros((NUM_ENVS, 4), np.float32))
            for i in range(100_000):
                self._tensors.tensors[f"t{i}"].CopyFrom(one)
        self._episodes = env_pb2.StepResponse()
        if lie == "step_episodes_1e5":
            self._episodes.episodes.extend([tensor_pb2.EpisodeStats(env_id=0, length=1)] * 100_000)

    def Describe(self, request, context):
        spec = super().Describe(request, context)
        lie = self.lie
        if lie == "action_2e30":
            spec.action_space.shape[:] = [1 << 30]
        elif lie == "envs_2e31":
            spec.num_envs = 2**31 - 1
            del spec.task_descriptions[:]
        elif lie == "obs_2e30":
            spec.observation_space["state"].CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[1 << 30], low=-3, high=3))
        elif lie == "reset_of_every_env_too_big":  # 4096 envs of a 256 x 256 x 3 camera: 805 MB per Reset
            spec.num_envs = 4096
            del spec.task_descriptions[:]
            spec.observation_space["pixels"].CopyFrom(tensor_pb2.TensorSpec(dtype=U8, shape=[256, 256, 3]))
        elif lie == "keys_1e6":
            spec.MergeFromString(self._entries)
        elif lie == "deep_space":
            spec.observation_space["state"].CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[1] * 64))
        elif lie == "dtype_77":
            spec.action_space.dtype = 77
        elif lie == "episode_steps_2e31":
            spec.max_episode_steps = 2**31 - 1
        elif lie == "chunk_2e31":
            spec.max_action_chunk = 2**31 - 1
        elif lie == "env_id_1mib":
            spec.env_id = "x" * (1 << 20)
        elif lie == "description_1mib":
            spec.task_descriptions[0] = "x" * (1 << 20)
        return spec

    def Reset(self, request, context):
        resp = super().Reset(request, context)
        n = len(request.env_ids) or self.n
        lie = self.lie
        state = resp.observations.tensors["state"]
        if lie == "reset_tensor_2e40":  # 2**40 elements claimed, 16 bytes sent
            state.CopyFrom(tensor_pb2.Tensor(dtype=F32, shape=[1 << 20, 1 << 20], data=bytes(16)))
        elif lie == "reset_shape_bytes_mismatch":  # 2**29 elements (under the codec's count limit), 16 bytes
            state.CopyFrom(tensor_pb2.Tensor(dtype=F32, shape=[n, 1 << 28], data=bytes(16)))
        elif lie == "reset_more_rows":
            state.CopyFrom(_tensor(np.zeros((n + 1, 4), np.float32)))
        elif lie == "reset_instructions_1e5":
            resp.instructions[:] = ["go"] * 100_000
        elif lie == "reset_instruction_1mib":
            resp.instructions[0] = "x" * (1 << 20)
        elif lie == "reset_tensors_1e5":  # one lying reply per row count, kept (merging 10**5 entries takes a while)
            if n not in self._replies:
                self._replies[n] = env_pb2.ResetResponse(observations=resp.observations)
                self._replies[n].observations.MergeFrom(self._tensors)
            return self._replies[n]
        return resp

    def Step(self, request_iterator, context):
        lie = self.lie
        if lie == "step_silent":  # reads requests, never answers
            for _ in request_iterator:
                while context.is_active() and not self.stopped.wait(0.05):
                    pass
                return
        for resp in super().Step(request_iterator, context):
            n = resp.rewards.shape[0]
            if lie == "step_tensor_2e40":
                resp.rewards.CopyFrom(tensor_pb2.Tensor(dtype=F32, shape=[1 << 40], data=bytes(16)))
            elif lie == "step_more_rows":
                resp.observations.tensors["state"].CopyFrom(_tensor(np.zeros((n + 1, 4), np.float32)))
            elif lie == "step_episodes_1e5":
                resp.MergeFrom(self._episodes)
            yield resp
            while lie == "step_never_ends" and context.is_active():  # answers no request asked for, without end
                yield resp


# lie -> what the refusal must say (both clients)
DESCRIBE_LIES = {
    "action_2e30": "action_space.shape (elements): expected at most 65,536 per env (rlfleet.wire.limits."
    "MAX_ACTION_ELEMENTS, override with RLFLEET_MAX_ACTION_ELEMENTS), found 1,073,741,824",
    "envs_2e31": "num_envs: expected at most 65,536 (rlfleet.wire.limits.MAX_ENVS, override with RLFLEET_MAX_ENVS), "
    "found 2,147,483,647",
    "obs_2e30": "observation_space['state'].shape (elements): expected at most 16,777,216 per env",
    "reset_of_every_env_too_big": "num_envs x observation bytes (4,096 x 196,624: a Reset of every env): expected at "
    "most 268,435,456 bytes, one reply",
    "keys_1e6": "observation_space (entries): expected at most 256 (rlfleet.wire.limits.MAX_OBS_ENTRIES), "
    "found 1,000,001",
    "deep_space": "observation_space['state'].shape (dimensions): expected at most 32",
    "dtype_77": "EnvSpec.action_space: dtype: unknown or unset dtype 77",  # not a size: named as the field's fault
    "episode_steps_2e31": "max_episode_steps: expected at most 1,000,000",
    "chunk_2e31": "max_action_chunk: expected at most 1,024 (rlfleet.wire.limits.MAX_ACTION_CHUNK), "
    "found 2,147,483,647",
    "env_id_1mib": "env_id: expected a string of at most 256 characters (rlfleet.wire.limits.MAX_NAME_CHARS), "
    "found 1,048,576 characters",
    "description_1mib": "task_descriptions[0]: expected a string of at most 16,384 characters",
}
REPLY_LIES = {
    "reset_tensor_2e40": "observations['state']: shape [1048576, 1048576] has 1099511627776 elements, more than "
    "the limit",
    "reset_shape_bytes_mismatch": "observations['state']: 16 data bytes do not match shape [2, 268435456] of FLOAT32 "
    "(2147483648 bytes expected)",
    "reset_more_rows": "observations['state']: shape [3, 4] where [2, 4] was expected",
    "reset_instructions_1e5": "ResetResponse: instructions (count): expected at most 2 (one per row asked for, or "
    "none; 2 rows were asked for), found 100,000",
    "reset_instruction_1mib": "ResetResponse: instructions[0]: expected a string of at most 16,384 characters",
    "reset_tensors_1e5": "ResetResponse: observations (entries): expected at most 256",
    "step_tensor_2e40": "rewards: shape [1099511627776] has 1099511627776 elements, more than the limit",
    "step_more_rows": "observations['state']: shape [3, 4] where [2, 4] was expected",
    "step_episodes_1e5": "StepResponse: episodes (count): expected at most 2 (one per ended row; 2 rows were "
    "stepped), found 100,000",
}
# a Step stream that answers without end: answers carry no request id, so an answer is known to be unasked only when
# it arrives with no request outstanding; one that arrives just after the client's next request is taken as that
# request's answer. What holds whatever the timing: at most one answer is read per request (memory bounded), the
# client never hangs, and where the flood is seen it is named
FLOOD = {"step_never_ends": "sent a StepResponse no request asked for"}
BRIDGE_ONLY = {"step_silent": "did not answer a Step within 3s (cluster.act_timeout_s)"}

# every client process caps its own address space (set here, not by a preexec_fn: forking a process that runs
# gRPC threads can abort the child) and prints its own peak resident memory as it exits, whatever ends it
PEAK = f"""
import atexit, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE}))
def _peak():
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
    print(f"peak-kib {{hwm}}", flush=True)
atexit.register(_peak)
"""
CLI = (
    PEAK
    + """
import runpy
sys.argv = ["coordinatorctl", *sys.argv[1:]]
runpy.run_module("services.coordinator.cli", run_name="__main__")
"""
)
BRIDGE = (
    PEAK
    + """
import time
import numpy as np
from rlfleet.errors import InvalidRequest
from services.env.remote import EnvConnectionLost, RemoteVecEnv
t0 = time.monotonic()
try:
    env = RemoteVecEnv(sys.argv[1], timeout=10, call_timeout=3)
    env.reset()
    for _ in range(5):
        env.step([], np.zeros((env.num_envs, *env.action_space.shape), np.float32))
    print("no error")
except (InvalidRequest, EnvConnectionLost) as exc:
    print(f"{type(exc).__name__}: {exc}")
print(f"seconds {time.monotonic() - t0:.2f}")
"""
)


def _run(cmd: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """Run a client as its own process under the address-space cap -> (its output, wall seconds, peak MB)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            timeout=60,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:  # a hang is a failure, not a stuck suite
        raise AssertionError(f"{cmd[-3:]} did not end within 60s: {exc.output}") from None
    peak = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("peak-kib ")]
    assert peak, f"exit status {proc.returncode}: {proc.stdout[-3000:]}"
    return proc.stdout, time.monotonic() - t0, peak[-1] / 1024


def check_env(address: str, *args: str, env=None):
    """`coordinatorctl check-env ADDRESS` (the CLI's own module, as its console script runs it)."""
    return _run([sys.executable, "-c", CLI, "check-env", address, "--timeout", "20", *args], env)


def bridge(address: str, env=None):
    return _run([sys.executable, "-c", BRIDGE, address], env)


@pytest.fixture(scope="module")
def baseline():
    """Peak MB of each client against the honest server: what a claim may add to is measured from it."""
    server, address = _serve(Liar(None))
    try:
        out, _, cli = check_env(address, "--only", "describe", "step_shapes")
        assert "2 passed, 0 failed" in out, out
        out, _, remote = bridge(address)
        assert "no error" in out, out
    finally:
        server.stop(0)
    return {"check-env": cli, "bridge": remote}


@pytest.fixture
def liar(request):
    servicer = Liar(request.param)
    server, address = _serve(servicer)
    yield address
    servicer.stopped.set()
    server.stop(0)


def _line_with(out: str, says: str) -> str:
    lines = [line for line in out.splitlines() if says in line]
    assert lines, out[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "liar,says", [*DESCRIBE_LIES.items(), *REPLY_LIES.items()], indirect=["liar"], ids=[*DESCRIBE_LIES, *REPLY_LIES]
)
def test_check_env_names_the_claim_quickly_and_in_bounded_memory(liar, says, baseline):
    out, seconds, peak = check_env(liar)
    line = _line_with(out, says)
    assert "Traceback" not in out and "MemoryError" not in out, out[-3000:]
    assert line.lstrip().startswith("FAIL"), line  # a check's verdict, not a crash
    if says in DESCRIBE_LIES.values():  # nothing is built from such a spec: describe names it, the rest is SKIP
        assert "FAIL  describe" in line, line
        assert liar in line or "dtype" in says, line  # a size claim names the server (a dtype: the header does)
        assert f"0 passed, 1 failed, {len(_checks()) - 1} skipped" in out, out[-2000:]
    assert seconds < SECONDS, (seconds, out[-2000:])
    assert peak - baseline["check-env"] < GROWTH_MB, (peak, baseline)
    print(f"check-env {says[:50]!r}: {seconds:.2f}s, peak {peak:.0f} MB (honest {baseline['check-env']:.0f} MB)")


@pytest.mark.parametrize(
    "liar,says",
    [*DESCRIBE_LIES.items(), *REPLY_LIES.items(), *BRIDGE_ONLY.items()],
    indirect=["liar"],
    ids=[*DESCRIBE_LIES, *REPLY_LIES, *BRIDGE_ONLY],
)
def test_the_bridge_names_the_claim_quickly_and_in_bounded_memory(liar, says, baseline):
    out, seconds, peak = bridge(liar)
    line = _line_with(out, says)
    assert "Traceback" not in out, out[-3000:]
    if says in DESCRIBE_LIES.values():  # unusable: refused before the first epoch, naming the server
        assert line.startswith(f"InvalidRequest: external env {liar} cannot be used: "), line
    else:  # a malformed answer: a crash of that server (episodes lost, fresh ones after reconnecting)
        assert line.startswith(f"EnvConnectionLost: external env {liar} "), line
    assert seconds < SECONDS, (seconds, out)
    assert peak - baseline["bridge"] < GROWTH_MB, (peak, baseline)
    print(f"bridge {says[:50]!r}: {seconds:.2f}s, peak {peak:.0f} MB (honest {baseline['bridge']:.0f} MB)")


def _checks():
    from rlfleet.simulators.conformance import Checker

    return Checker.NAMES


@pytest.mark.parametrize("liar", ["episode_steps_2e31"], indirect=True)
def test_an_override_lets_a_longer_claim_through(liar):
    """RLFLEET_MAX_EPISODE_STEPS raises the limit for a simulator that needs it: the same server is then used."""
    out, _, _ = bridge(liar, env={"RLFLEET_MAX_EPISODE_STEPS": str(2**31)})
    assert "no error" in out, out
    out, _, _ = bridge(liar, env={"RLFLEET_MAX_EPISODE_STEPS": "lots"})
    assert "RLFLEET_MAX_EPISODE_STEPS='lots': expected a positive integer" in out, out


@pytest.mark.parametrize("liar", ["envs_2e31"], indirect=True)
def test_coordinatorctl_start_refuses_the_claim_before_anything_starts(liar):
    """(before a run folder is chosen: preflight_external Describes the servers first)"""
    out, seconds, peak = _run([sys.executable, "-c", CLI, "start", f"cluster.external_env_addresses=[{liar}]"])
    line = _line_with(out, DESCRIBE_LIES["envs_2e31"])
    assert f"the external env at {liar} cannot be used: EnvSpec: num_envs" in line, out[-2000:]
    assert "Traceback" not in out and seconds < 30 and peak < 1000, (seconds, peak, out[-2000:])


def test_limit_lines_name_the_peer_the_field_the_limit_and_the_claim():
    spec = env_pb2.EnvSpec(num_envs=2**31 - 1, max_episode_steps=5)
    spec.observation_space["state"].CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[4]))
    spec.action_space.CopyFrom(tensor_pb2.TensorSpec(dtype=F32, shape=[2]))
    (line,) = env_contract.limit_problems(spec, "10.0.0.1:5 EnvSpec")
    assert line == (
        "10.0.0.1:5 EnvSpec: num_envs: expected at most 65,536 (rlfleet.wire.limits.MAX_ENVS, override "
        "with RLFLEET_MAX_ENVS), found 2,147,483,647 (docs/env-contract.md#limits)"
    )
    assert env_contract.spec_problems(spec) == [line.replace("10.0.0.1:5 EnvSpec", "EnvSpec")]
    spec.num_envs = limits.MAX_ENVS  # at the limit: accepted
    assert env_contract.limit_problems(spec) == []


def test_the_codec_compares_claimed_bytes_before_it_allocates():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for shape in ([1 << 20, 1 << 20], [2, 1 << 28], [1] * 33):
        with pytest.raises(codec.CodecError) as err:
            codec.decode(tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT64, shape=shape, data=bytes(16)), "obs")
        assert str(err.value).startswith("obs: "), err.value
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB
    # the limit the channels themselves enforce
    assert ("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES) in channels.OPTIONS


class FloodingInference(inference_pb2_grpc.InferenceServiceServicer):
    """An inference server that answers every Act request and then keeps answering (a stream that never ends)."""

    def Act(self, request_iterator, context):
        for req in request_iterator:
            resp = inference_pb2.ActResponse(
                request_id=req.request_id,
                weights_version=1,
                actions=codec.encode(np.zeros((1, 1, 2), np.float32)),
                log_probs=codec.encode(np.zeros((1, 1), np.float32)),
            )
            for _ in range(10_000):
                if not context.is_active():
                    return
                yield resp


def test_an_inference_stream_that_never_ends_is_cut_at_the_first_unasked_answer():
    from concurrent import futures

    from rlfleet.wire.clients import GrpcPolicyClient, PolicyError

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(FloodingInference(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    client = GrpcPolicyClient([address], 1, action_dim=2, timeout=10)
    try:
        client.submit(0, {"state": np.zeros((1, 4), np.float32)})
        assert client.result(0).actions.shape == (1, 1, 2)  # the answer asked for
        stream = client.streams[0]
        deadline = time.monotonic() + 10
        while stream.received.qsize() == 0 and time.monotonic() < deadline:  # the reader sees the next answer
            time.sleep(0.01)
        client.submit(0, {"state": np.zeros((1, 4), np.float32)})
        with pytest.raises(PolicyError, match=rf"inference server {address} sent Act response 2 for 1 requests"):
            client.result(0)
        assert stream.received.qsize() == 0  # nothing more was queued: the reader stopped at the unasked answer
    finally:
        client.close()
        server.stop(0)


def test_the_evaluator_refuses_more_episodes_than_it_asked_for():
    from services.coordinator.evaluation import _check_episodes
    from services.coordinator.service_registry import RunFailed

    resp = rollout_pb2.EvaluateResponse(episodes=[tensor_pb2.EpisodeStats(env_id=10 + i) for i in range(5)])
    _check_episodes(resp, 10, 5, "env[0] (127.0.0.1:1)")
    with pytest.raises(RunFailed, match=r"^env\[0\] \(127.0.0.1:1\) answered Evaluate with 5 episodes; at most 4 "):
        _check_episodes(resp, 10, 4, "env[0] (127.0.0.1:1)")
    with pytest.raises(RunFailed, match=r"episode index 10; the episodes asked for are 11..15"):
        _check_episodes(resp, 11, 5, "env[0] (127.0.0.1:1)")


@pytest.mark.parametrize("liar", list(FLOOD), indirect=True)
@pytest.mark.parametrize("client", ["check-env", "bridge"])
def test_a_step_stream_that_never_ends_costs_bounded_memory_and_no_hang(liar, client, baseline):
    out, seconds, peak = (check_env if client == "check-env" else bridge)(liar)
    assert "Traceback" not in out and "MemoryError" not in out, out[-3000:]
    named = [line for line in out.splitlines() if FLOOD["step_never_ends"] in line]
    assert named or "no error" in out or " passed, " in out, out[-3000:]
    assert seconds < SECONDS, (seconds, out[-2000:])
    assert peak - baseline[client] < GROWTH_MB, (peak, baseline)
    print(f"{client} flooded: {seconds:.2f}s, peak {peak:.0f} MB, {'named' if named else 'paired with requests'}")
