"""Learner server: gRPC <-> Learner translation.

    python -m services.learner.server --config run/config.yaml --run-dir runs/exp [--coordinator ADDR]
    torchrun --nproc-per-node N -m services.learner.server ...      # N ranks (services/learner/group.py)

Rank 0 serves gRPC, registers and heartbeats; the other ranks serve nothing and follow rank 0's commands.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from rlfleet.config import load_service_config
from rlfleet.config.views import LearnerView, service_view
from rlfleet.data.metrics import check_record
from rlfleet.errors import FailedPrecondition, InvalidRequest
from rlfleet.v1 import coordinator_pb2, coordinator_pb2_grpc, learner_pb2, learner_pb2_grpc
from rlfleet.wire import callers, channels, codec, servers, shm, status
from rlfleet.wire.service import ServiceRuntime, common_args, exit_after, pick_device, setup_process
from rlfleet.wire.spaces import spaces_from_proto
from services.learner import warmup
from services.learner.group import RankGroup
from services.learner.learner import Learner

ROLE = "learner"


def _checked(check, *args) -> None:
    """A check of a peer's values whose ValueError is the caller's bad input (INVALID_ARGUMENT)."""
    try:
        check(*args)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


WIRE_EPOCHS = 64  # epochs whose PushRollout decode time is kept until their Train


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner: Learner, shared_memory: bool = True):
        self.learner = learner
        self.shared_memory = shared_memory  # read pushed tensors by handle from env servers on this host
        self.decode_s: dict[int, float] = {}  # epoch -> seconds its pushes spent decoding (time/wire/rollout_s)
        self.decode_lock = threading.Lock()

    @status.handler
    def SharedMemory(self, request, context):
        return shm.answer(request, self.shared_memory)

    @status.handler
    def PushRollout(self, request_iterator, context):
        reader = shm.Reader() if self.shared_memory else None  # dropped when the push ends, however it ends
        try:
            return self._push(request_iterator, context, reader)
        finally:
            if reader is not None:
                reader.close()

    def _push(self, request_iterator, context, reader):
        time_major: dict[str, list[np.ndarray]] = {}
        decode_s = 0.0
        tail: dict[str, np.ndarray] = {}
        episodes = []
        head = None
        expect_t = 0
        complete = False
        for chunk in request_iterator:
            if complete:
                raise InvalidRequest("rollout: chunk after the one marked last")
            if head is None:
                head = (chunk.epoch, chunk.worker_index, chunk.num_steps)
                self.learner.rollouts.check_pusher(chunk.worker_index, callers.caller_of(context))
                self.learner.rollouts.check_rollout_epoch(chunk.epoch)  # before anything is buffered
                self.learner.rollouts.check_worker(chunk.worker_index)
            elif (chunk.epoch, chunk.worker_index, chunk.num_steps) != head:
                raise InvalidRequest("rollout: chunks disagree on epoch/worker_index/num_steps")
            if chunk.t_start != expect_t:
                raise InvalidRequest(f"rollout: chunk starts at t={chunk.t_start}, expected t={expect_t}")
            t0 = time.perf_counter()
            data = codec.decode_map(chunk.data, "rollout", shm=reader)  # by handle: copied out, private
            decode_s += time.perf_counter() - t0
            steps = None
            for k, v in data.items():
                if v.ndim == 0:
                    raise InvalidRequest(
                        f"rollout['{k}']: a 0-d tensor; rollout tensors are [T, N, ...] (its tail: [N, ...] or [M, ...])"
                    )
                if chunk.last and codec.is_tail(k):
                    tail[k] = v
                    continue
                time_major.setdefault(k, []).append(v)
                steps = v.shape[0] if steps is None else steps
                if v.shape[0] != steps:
                    raise InvalidRequest(f"rollout['{k}']: {v.shape[0]} time steps in a chunk of {steps}")
            expect_t += steps or 0
            episodes.extend(codec.episode_from_proto(e) for e in chunk.episodes)
            complete = chunk.last
        if head is None or not complete:
            raise InvalidRequest("rollout: stream ended without a chunk marked last; discarded")
        if expect_t != head[2]:
            raise InvalidRequest(f"rollout: received {expect_t} of {head[2]} time steps")
        t0 = time.perf_counter()  # one chunk read from shared memory is already a private array: kept as it is
        rollout = {
            k: v[0] if len(v) == 1 and v[0].flags.writeable else np.concatenate(v) for k, v in time_major.items()
        }
        decode_s += time.perf_counter() - t0
        T, N = self.learner.rollouts.receive(head[0], head[1], rollout, tail, episodes)
        with self.decode_lock:
            self.decode_s[head[0]] = self.decode_s.get(head[0], 0.0) + decode_s
            while len(self.decode_s) > WIRE_EPOCHS:
                self.decode_s.pop(min(self.decode_s))
        return learner_pb2.PushRolloutResponse(num_steps=T, num_envs=N)

    @status.handler
    def Train(self, request, context):
        addresses = list(request.inference_addresses)
        extra = dict(request.extra_metrics)
        _checked(check_record, request.epoch, extra, "extra_metrics")
        with self.decode_lock:  # the rollout's share of the wire: the env servers' side (the coordinator's) + ours
            learner_side = self.decode_s.pop(request.epoch, 0.0)
        extra["time/wire/rollout_s"] = extra.get("time/wire/rollout_s", 0.0) + learner_side
        metrics = self.learner.train(request.epoch, list(request.worker_indices), extra, inference_addresses=addresses)
        return learner_pb2.TrainResponse(
            epoch=request.epoch,
            weights_version=self.learner.version,
            metrics=metrics,
            checkpoint_path=self.learner.last_checkpoint,
            publish_error=self.learner.publish_error,
        )

    @status.handler
    def PublishWeights(self, request, context):
        spec = request.env_spec
        if request.HasField("env_spec"):
            if len(spec.action_space.shape) != 1:
                raise InvalidRequest(f"env_spec.action_space: shape {list(spec.action_space.shape)} is not 1-D")
            self.learner.setup(
                spaces_from_proto(spec.observation_space, "env_spec.observation_space"), int(spec.action_space.shape[0])
            )
        if self.learner.model is None:
            raise FailedPrecondition("env_spec: required on the first PublishWeights")
        # a full set: PublishWeights starts a run or follows an inference server's restart
        self.learner.publish(list(request.inference_addresses), full=True)
        return learner_pb2.PublishWeightsResponse(weights_version=self.learner.version)

    @status.handler
    def LogMetrics(self, request, context):
        metrics = dict(request.metrics)
        _checked(check_record, request.step, metrics)
        self.learner.log_metrics(request.step, metrics)
        return learner_pb2.LogMetricsResponse()

    @status.handler
    def SaveCheckpoint(self, request, context):
        if self.learner.model is None:
            raise FailedPrecondition("nothing to save: the learner has no policy yet")
        return learner_pb2.SaveCheckpointResponse(path=str(self.learner.save_checkpoint()))

    @status.handler
    def Status(self, request, context):
        le = self.learner
        return learner_pb2.LearnerStatus(
            epoch=le.epoch,
            weights_version=le.version,
            env_steps=le.env_steps,
            last_checkpoint=le.last_checkpoint,
            elapsed_time_s=le.elapsed(),
        )


def env_server_count(coordinator: str, timeout: float = 10.0) -> int | None:
    """How many env servers the run has now (the coordinator's registry; None: it lists none)."""
    with channels.channel(coordinator) as ch:
        status = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Status(
            coordinator_pb2.StatusRequest(), timeout=min(timeout, 10.0)
        )
    envs = [s.index for s in status.services if s.role == coordinator_pb2.ENV]
    return max(envs) + 1 if envs else None


def serve(
    cfg,
    address: str,
    run_dir: str,
    index: int = 0,
    coordinator: str | None = None,
    device: str = "cpu",
    group: RankGroup | None = None,
):
    """Rank 0's gRPC face (a group of one unless ``group`` says otherwise); ``cfg``: the run config or the
    learner's view of it."""
    view = cfg if isinstance(cfg, LearnerView) else service_view(LearnerView, cfg)
    learner = Learner(view, run_dir, device, group)
    if coordinator:  # a scale-up's new env servers push before a Train names them: ask the coordinator
        learner.rollouts.scale_probe = lambda: env_server_count(coordinator, view.rpc_timeout_s)
    server = servers.make_server(max_workers=16)
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(
        LearnerServicer(learner, view.shared_memory == "auto"), server
    )
    servers.add_health_and_reflection(server, servers.service_name(learner_pb2, "LearnerService"))
    bound = servers.bind(server, address)
    server.start()
    runtime = ServiceRuntime(
        "learner", index, server, bound, coordinator, view.heartbeat_interval_s, view.heartbeat_timeout_s
    )
    return server, bound, learner, runtime


def main(argv=None) -> int:
    parser = common_args("rlfleet learner (PPO)")
    parser.add_argument("--run-dir", required=True, help="where metrics, TensorBoard events and checkpoints go")
    args = parser.parse_args(argv)
    cfg = load_service_config(args)
    view = service_view(LearnerView, cfg)  # built and checked once, before anything starts
    setup_process(args, cfg, ROLE)
    group = RankGroup.from_environ(view.learner_collective_timeout_s, view.heartbeat_timeout_s)
    if not group.is_leader:  # a follower: no gRPC, rank 0's commands until it says stop
        learner = Learner(view, args.run_dir, group=group)
        warmup.start()
        learner.follow()
        learner.close()
        return 0
    server, bound, learner, runtime = serve(
        view, args.address, args.run_dir, args.index, args.coordinator, pick_device(), group
    )
    warmup.start()  # while the other services start: the first setup's imports (warmup.py)
    code = runtime.serve_until_stopped(cfg, args)
    learner.close()
    return code


if __name__ == "__main__":
    exit_after(main)
