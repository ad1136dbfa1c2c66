"""Inference server: gRPC <-> InferenceEngine translation, nothing else.

python -m services.inference.server --config run/config.yaml --address 127.0.0.1:0 [--coordinator ADDR]
"""

from __future__ import annotations

import numpy as np

from rlfleet.config import load_service_config
from rlfleet.config.views import InferenceView, as_view, service_view
from rlfleet.errors import InvalidRequest
from rlfleet.v1 import inference_pb2, inference_pb2_grpc
from rlfleet.wire import codec, servers, shm, status, tracing, weights
from rlfleet.wire.service import ServiceRuntime, common_args, exit_after, pick_device, setup_process
from services.inference.engine import InferenceEngine

ROLE = "inference"


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: InferenceEngine, max_rows_per_request: int = 4096, shared_memory: bool = True):
        self.engine = engine
        self.max_rows = max_rows_per_request
        self.shared_memory = shared_memory  # read observations and weights by handle from callers on this host

    def _check_rows(self, req) -> None:
        """Refuse an oversized request before decoding it (a million rows would block every other stream)."""
        for key, t in req.observations.tensors.items():
            if t.shape and t.shape[0] > self.max_rows:
                raise InvalidRequest(
                    f"observations['{key}']: {t.shape[0]} rows in one request; at most "
                    f"{self.max_rows} (rollout.max_rows_per_request)"
                )

    @status.handler
    def SharedMemory(self, request, context):
        return shm.answer(request, self.shared_memory)

    @status.handler
    def Act(self, request_iterator, context):
        stream = self.engine.open_stream()
        reader = shm.Reader() if self.shared_memory else None  # this stream's mappings, dropped when it ends
        try:
            for req in request_iterator:
                self._check_rows(req)
                obs = codec.decode_map(req.observations, "observations", shm=reader)
                result = self.engine.submit(
                    obs,
                    req.deterministic,
                    stream,
                    list(req.instructions),
                    dict(req.trace_context),
                    list(req.noise_keys),
                ).result()
                resp = inference_pb2.ActResponse(
                    request_id=req.request_id,
                    actions=codec.encode(result.actions),
                    log_probs=codec.encode(result.log_probs),
                    weights_version=result.weights_version,
                    forward_inputs=codec.encode_map(result.forward_inputs),
                )
                if result.values is not None:
                    resp.values.CopyFrom(codec.encode(result.values))
                yield resp
        finally:
            self.engine.close_stream()
            if reader is not None:
                reader.close()

    @status.handler
    def UpdateWeights(self, request_iterator, context):
        return weights.receive(request_iterator, self.engine, self.shared_memory)

    @status.handler
    def Describe(self, request, context):
        info = self.engine.info()  # (vllm: batches are engine steps, rows the rows decoded in each)
        return inference_pb2.InferenceInfo(
            model_type=info.model_type,
            weights_version=info.weights_version,
            num_parameters=info.num_parameters,
            requests_served=info.requests_served,
            batches_run=info.batches_run,
            mean_batch_rows=info.mean_batch_rows,
            reads_packed_weights=True,  # UpdateWeights: rlfleet.wire.weights.assemble reads WeightsChunk.tensors
        )


def build_engine(view: InferenceView, device: str = "cpu", on_fatal=None) -> InferenceEngine:
    """The engine the inference view describes (or the run config: its view is built); ``on_fatal`` is called when
    its backend is lost for good (vllm)."""
    view = as_view(InferenceView, view)
    return InferenceEngine(
        view.model,
        normalize_obs=view.normalize_obs,
        max_batch_size=view.max_batch_size,
        max_wait_ms=view.max_wait_ms,
        device=device,
        logprob_type=view.logprob_type,
        batch_invariant_rows=batch_invariant_rows(view),
        backend=view.backend,
        seed=view.seed,
        weights_precision=view.weights_precision,
        on_fatal=on_fatal,
        step_spans=tracing.enabled(step_spans=True),
    )


def batch_invariant_rows(view: InferenceView) -> int:
    """rollout.batch_invariant_rows, with null resolved by the policy family's entry: 32 for the MLP policy
    (padding is nearly free there), 0 for image and VLA policies (padding costs real compute)."""
    from rlfleet.policies.families import batch_invariant_rows as resolve

    view = as_view(InferenceView, view)
    return resolve(view.batch_invariant_rows, view.model.model_type)


def _exit_for_restart(why: str) -> None:
    """The inference backend (the vLLM engine) is lost for good in this process: exit, so that the server is restarted (local launcher,
    compose restart policy, Kubernetes) and the coordinator has the learner publish the weights to it again."""
    import logging
    import os
    import sys

    logging.getLogger("rlfleet.inference").critical("exiting to be restarted: %s", why)
    sys.stderr.flush()
    os._exit(3)


def serve(view: InferenceView, address: str, index: int = 0, coordinator: str | None = None, device: str = "cpu"):
    """Start serving the inference view (or the run config: its view is built); returns (grpc server, bound
    address, engine, runtime)."""
    view = as_view(InferenceView, view)
    engine = build_engine(view, device, on_fatal=_exit_for_restart)
    engine.start()
    streams = view.max_act_streams
    server = servers.make_server(max_workers=streams + 8, max_concurrent_rpcs=streams + 8)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        InferenceServicer(engine, view.max_rows_per_request, view.shared_memory == "auto"), server
    )
    servers.add_health_and_reflection(server, servers.service_name(inference_pb2, "InferenceService"))
    bound = servers.bind(server, address)
    server.start()
    runtime = ServiceRuntime(
        "inference", index, server, bound, coordinator, view.heartbeat_interval_s, view.heartbeat_timeout_s
    )
    return server, bound, engine, runtime


def main(argv=None) -> int:
    args = common_args("rlfleet batched inference server").parse_args(argv)
    cfg = load_service_config(args)
    view = service_view(InferenceView, cfg)  # built and checked once, before anything starts
    setup_process(args, cfg, ROLE)
    np.random.seed(view.seed + 1000 + args.index)
    import torch

    torch.manual_seed(view.seed + 1000 + args.index)
    server, bound, engine, runtime = serve(view, args.address, args.index, args.coordinator, pick_device())
    code = runtime.serve_until_stopped(cfg, args)
    engine.stop()
    return code


if __name__ == "__main__":
    exit_after(main)
