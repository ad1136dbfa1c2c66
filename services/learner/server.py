"""Learner server: gRPC <-> Learner translation, plus shipping weights to the inference servers.

    python -m services.learner.server --config run/config.yaml --run-dir runs/exp [--coordinator ADDR]
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from rlfleet import codec, rpc, tracing, weights
from rlfleet.models.actor_critic import obs_specs_from_proto
from rlfleet.service import ServiceRuntime, common_args, exit_after, load_service_config, pick_device, setup_process
from rlfleet.v1 import inference_pb2_grpc, learner_pb2, learner_pb2_grpc
from services.learner.learner import Learner

ROLE = "learner"


def send_weights(addresses: list[str], learner: Learner, version: int, timeout: float = 120.0,
                 synced: set[str] | None = None) -> int:
    """Push the learner's weights to every inference server in parallel; returns the bytes sent per server
    (the largest). A server in ``synced`` (it holds a full set from this learner) gets only the tensors that
    change in training (a partial set: with LoRA, the adapters and the value head); any other gets the full set
    with the spaces, and joins ``synced``. A partial update a server refuses (it restarted) is resent in full."""
    synced = set() if synced is None else synced
    full = partial = None

    def one(address: str) -> int:
        nonlocal full, partial
        for send_full in ((False, True) if address in synced else (True,)):
            if send_full:
                full = full if full is not None else learner.state_dict()
                state, kw = full, {"obs_specs": learner.obs_specs, "action_dim": learner.action_dim}
            else:
                partial = partial if partial is not None else learner.sync_state_dict()
                state, kw = partial, {"partial": True}
            try:
                with rpc.channel(address) as ch:
                    stub = inference_pb2_grpc.InferenceServiceStub(ch)
                    # fail fast on a dead server (no wait_for_ready): the coordinator restarts it, waits until
                    # it has registered, and has the weights republished; waiting here would hold up Train
                    stub.UpdateWeights(weights.iter_chunks(state, version, **kw), timeout=timeout)
            except grpc.RpcError as exc:
                if send_full or exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT,
                                                   grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                continue  # a restarted server without a full set: send it one
            synced.add(address)
            return sum(t.numel() * t.element_size() for t in state.values())
        return 0

    if not addresses:
        raise rpc.InvalidRequest("inference_addresses: empty")
    sent = 0
    with ThreadPoolExecutor(len(addresses)) as pool:
        for address, fut in [(a, tracing.submit(pool, one, a)) for a in addresses]:
            try:
                sent = max(sent, fut.result())
            except Exception as exc:
                synced.discard(address)
                why = rpc.describe_error(exc) if isinstance(exc, grpc.RpcError) else str(exc)
                raise rpc.FailedPrecondition(f"weight update to inference server {address} failed: {why}") from exc
    learner.last_sync_bytes = sent
    return sent


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner: Learner):
        self.learner = learner
        self.synced: set[str] = set()  # inference servers holding a full weights set from this learner

    @rpc.handler
    def PushRollout(self, request_iterator, context):
        time_major: dict[str, list[np.ndarray]] = {}
        per_env: dict[str, np.ndarray] = {}
        episodes = []
        head = None
        expect_t = 0
        complete = False
        for chunk in request_iterator:
            if complete:
                raise rpc.InvalidRequest("rollout: chunk after the one marked last")
            if head is None:
                head = (chunk.epoch, chunk.worker_index, chunk.num_steps)
                self.learner.check_rollout_epoch(chunk.epoch)  # before anything is buffered
            elif (chunk.epoch, chunk.worker_index, chunk.num_steps) != head:
                raise rpc.InvalidRequest("rollout: chunks disagree on epoch/worker_index/num_steps")
            if chunk.t_start != expect_t:
                raise rpc.InvalidRequest(f"rollout: chunk starts at t={chunk.t_start}, expected t={expect_t}")
            data = codec.decode_map(chunk.data, "rollout")
            steps = None
            for k, v in data.items():
                if v.ndim == 0:
                    raise rpc.InvalidRequest(f"rollout['{k}']: a 0-d tensor; rollout tensors are [T, N, ...] "
                                             f"(last_values: [N])")
                if chunk.last and k == "last_values":
                    per_env[k] = v
                    continue
                time_major.setdefault(k, []).append(v)
                steps = v.shape[0] if steps is None else steps
                if v.shape[0] != steps:
                    raise rpc.InvalidRequest(f"rollout['{k}']: {v.shape[0]} time steps in a chunk of {steps}")
            expect_t += steps or 0
            episodes.extend(chunk.episodes)
            complete = chunk.last
        if head is None or not complete:
            raise rpc.InvalidRequest("rollout: stream ended without a chunk marked last; discarded")
        if expect_t != head[2]:
            raise rpc.InvalidRequest(f"rollout: received {expect_t} of {head[2]} time steps")
        T, N = self.learner.receive(head[0], head[1], {k: np.concatenate(v) for k, v in time_major.items()},
                                    per_env, episodes)
        return learner_pb2.PushRolloutResponse(num_steps=T, num_envs=N)

    @rpc.handler
    def Train(self, request, context):
        addresses = list(request.inference_addresses)
        metrics = self.learner.train(request.epoch, list(request.worker_indices), dict(request.extra_metrics),
                                     publish=lambda v: send_weights(addresses, self.learner, v, synced=self.synced))
        return learner_pb2.TrainResponse(epoch=request.epoch, weights_version=self.learner.version,
                                         metrics=metrics, checkpoint_path=self.learner.last_checkpoint,
                                         publish_error=self.learner.publish_error)

    @rpc.handler
    def PublishWeights(self, request, context):
        spec = request.env_spec
        if request.HasField("env_spec"):
            if len(spec.action_space.shape) != 1:
                raise rpc.InvalidRequest(f"env_spec.action_space: shape {list(spec.action_space.shape)} is not 1-D")
            self.learner.setup(obs_specs_from_proto(spec.observation_space), int(spec.action_space.shape[0]))
        if self.learner.model is None:
            raise rpc.FailedPrecondition("env_spec: required on the first PublishWeights")
        # a full set: PublishWeights starts a run or follows an inference server's restart
        self.synced.difference_update(request.inference_addresses)
        send_weights(list(request.inference_addresses), self.learner, self.learner.version, synced=self.synced)
        return learner_pb2.PublishWeightsResponse(weights_version=self.learner.version)

    @rpc.handler
    def LogMetrics(self, request, context):
        self.learner.log_metrics(request.step, dict(request.metrics))
        return learner_pb2.LogMetricsResponse()

    @rpc.handler
    def SaveCheckpoint(self, request, context):
        if self.learner.model is None:
            raise rpc.FailedPrecondition("nothing to save: the learner has no policy yet")
        return learner_pb2.SaveCheckpointResponse(path=str(self.learner.save_checkpoint()))

    @rpc.handler
    def Status(self, request, context):
        le = self.learner
        return learner_pb2.LearnerStatus(epoch=le.epoch, weights_version=le.version, env_steps=le.env_steps,
                                         last_checkpoint=le.last_checkpoint, elapsed_time_s=le.elapsed())


def serve(cfg, address: str, run_dir: str, index: int = 0, coordinator: str | None = None, device: str = "cpu"):
    learner = Learner(cfg, run_dir, device)
    server = rpc.make_server(max_workers=16)
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(learner), server)
    rpc.add_health_and_reflection(server, rpc.service_name(learner_pb2, "LearnerService"))
    bound = rpc.bind(server, address)
    server.start()
    runtime = ServiceRuntime("learner", index, server, bound, coordinator, cfg.cluster.heartbeat_interval_s,
                             cfg.cluster.heartbeat_timeout_s)
    return server, bound, learner, runtime


def main(argv=None) -> int:
    parser = common_args("rlfleet learner (PPO)")
    parser.add_argument("--run-dir", required=True, help="where metrics, TensorBoard events and checkpoints go")
    args = parser.parse_args(argv)
    cfg = load_service_config(args)
    setup_process(args, cfg, ROLE)
    server, bound, learner, runtime = serve(cfg, args.address, args.run_dir, args.index, args.coordinator,
                                            pick_device())
    code = runtime.serve_until_stopped(cfg, args)
    learner.close()
    return code


if __name__ == "__main__":
    exit_after(main)
