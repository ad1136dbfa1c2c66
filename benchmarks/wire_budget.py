"""The wire at real sizes: what each gRPC path costs, next to the GPU compute of the same step.

The payloads are built from the real-size configs' shapes (OpenVLA-OFT 7.6B from libero_spatial_grpo_openvla_oft
with two 224 px cameras and proprio; pi0 3.5B from metaworld_mt50_ppo_pi0) on PandaPickCubeVision-v0 (two 224 px
cameras, 7-D state, 4-D actions) and LIBERO (agentview + wrist at 224 px, 8-D state, 7-D actions). The reply's
tensors (actions, log-probs, values, forward inputs) get their per-row shapes from the policy itself: the same config
with tiny hidden sizes acts on two rows. Parameter counts, the LoRA rank-32 adapters and the full weights set come
from the real architecture built on PyTorch's meta device.

Every path runs through a real gRPC server on loopback, the sender and the receiver each in a fresh process of its
own (rlfleet.wire.servers and rlfleet.wire.channels, the project's messages and codec):

  act       Act (bidi stream, one request in flight), as rlfleet.wire.clients._Stream sends it and the inference
            server answers it: N rows of observations, instructions and noise keys; the reply's actions, log-probs,
            values and forward inputs encoded per request as the server does
  rollout   PushRollout of one epoch (N envs x max_steps_per_rollout_epoch / chunk samples), chunked by
            rlfleet.wire.clients.rollout_chunks; the receiver decodes, concatenates and checks it as the learner does
  weights   UpdateWeights as services.learner.publisher.WeightPublisher streams it (buckets of
            actor.weights_bucket_mb, 1 MiB chunks); the receiver runs rlfleet.wire.weights.assemble and the
            finiteness check of the inference engine
  compression  LZ4 and zstd (levels 1, 3), with and without an XOR delta against the previous step of the same
            env, on frames PandaPickCubeVision-v0 renders at 224 px (MuJoCo, EGL)

Per row: bytes, messages, the CPU stages (encode: codec into messages; serialise: SerializeToString; parse:
FromString; decode: codec back to arrays and the receiver's checks; both directions for Act), transfer (the CPU both
processes spent beyond those stages: gRPC's framing, copies, socket I/O, hand-offs), wall time, each process's CPU
and peak memory (VmHWM), the GPU compute of the same step (a FLOP estimate at a stated H100 rate) and the env
steps/s at which the path saturates one receiving process. Sizes too large to hold twice here (a 30 GB weights set,
a multi-GB rollout) are measured on a slice and scaled linearly; the row says so.

    python -m benchmarks.wire_budget [--envs 64,128,256] [--only act,rollout,weights,compression]
                                     [--transport grpc|shm|both] [--markdown [PATH]] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import multiprocessing as mp
import os
import pathlib
import platform
import queue
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

H100_FLOPS = 400e12  # effective bf16 FLOP/s assumed for one H100 (about 40% of the SXM's 989 TFLOP/s dense peak)
TRAIN_FACTOR = 3  # a training step (forward + backward) over a sample: ~3 forward passes
ROLLOUT_CAP = 512 << 20  # bytes of rollout materialised per measurement; larger epochs are measured on a T-slice
WEIGHTS_CAP = 1 << 30  # bytes of weights materialised per measurement; larger sets are measured on a slice
MARK_BEGIN, MARK_END = "<!-- wire-budget:begin -->", "<!-- wire-budget:end -->"


# --- the cases: model x env, with the real-size configs' shapes --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    config: str  # a built-in real-size config
    overrides: tuple[str, ...]  # what makes it two-camera on this env
    obs: dict  # {key: (shape, dtype)}: what the env server sends per row
    action_dim: int
    env_steps: int  # env steps per env per rollout epoch
    instruction: str


def _cams(a: str, b: str, size: int, state: int) -> dict:
    return {a: ((size, size, 3), "uint8"), b: ((size, size, 3), "uint8"), "state": ((state,), "float32")}


PANDA_TASK = "pick up the red cube and lift it"
LIBERO_TASK = "pick up the black bowl between the plate and the ramekin and place it on the plate"
OFT = "libero_spatial_grpo_openvla_oft"
PI0 = "metaworld_mt50_ppo_pi0"


def cases(image_size: int = 224) -> list[Case]:
    """OpenVLA-OFT and pi0 on PandaPickCubeVision-v0 and LIBERO. Epochs: 80 env steps on PandaPickCube (as the
    real-size ManiSkill configs; it has no real-size config of its own), 240 on LIBERO (its config's)."""
    oft_panda = (
        "actor.model.image_key=third_person",
        "actor.model.extra_image_keys=[wrist]",
        "actor.model.use_proprio=true",
    )
    oft_libero = (
        "actor.model.image_key=agentview",
        "actor.model.extra_image_keys=[wrist]",
        "actor.model.use_proprio=true",
    )
    s = image_size
    return [
        Case(
            "OpenVLA-OFT, PandaPickCubeVision", OFT, oft_panda, _cams("third_person", "wrist", s, 7), 4, 80, PANDA_TASK
        ),
        Case("OpenVLA-OFT, LIBERO", OFT, oft_libero, _cams("agentview", "wrist", s, 8), 7, 240, LIBERO_TASK),
        Case("pi0, PandaPickCubeVision", PI0, (), _cams("third_person", "wrist", s, 7), 4, 80, PANDA_TASK),
        Case("pi0, LIBERO", PI0, (), _cams("agentview", "wrist", s, 8), 7, 240, LIBERO_TASK),
    ]


def _specs(case: Case) -> dict:
    from rlfleet.wire.spaces import TensorSpace

    return {k: TensorSpace(shape, dtype) for k, (shape, dtype) in case.obs.items()}


def _tiny(cfg, image_size: int):
    """The config with tiny hidden sizes, keeping what decides the wire's shapes (image and patch size, chunk,
    prompt length, action and state widths, denoising steps)."""
    from omegaconf import OmegaConf

    m = cfg.actor.model
    from rlfleet.policies.families import get_family

    family = get_family(m.model_type)
    key = family.sizes_group  # the family's size group (vla, openpi) and its tiny defaults
    real = dict(m[key])
    sizes = family.defaults()
    for k in (
        "patch_size",
        "max_state_dim",
        "max_action_dim",
        "num_denoise_steps",
        "noise_level",
        "noise_method",
        "pi05",
    ):
        if k in real:
            sizes[k] = real[k]
    sizes["image_size"] = image_size
    if image_size % int(sizes["patch_size"]):
        sizes["patch_size"] = 16 if image_size % 16 == 0 else image_size
    OmegaConf.set_struct(m, False)
    m[key] = sizes
    m.precision = "fp32"
    m.gradient_checkpointing = False
    return cfg


@dataclasses.dataclass
class Model:
    """What a case's policy puts on the wire and computes: per-row reply arrays, weights sets, FLOPs."""

    chunk: int
    reply: dict  # {name: (per-row shape, dtype)} of actions, log_probs, values, fi.*
    log_prob_width: int
    state: list  # [(name, shape, dtype name)] of the full weights set, in publish order
    sync: list  # ... of the set a partial update carries (LoRA: the adapters)
    lora: bool
    parts: dict  # parameters by part: vision, projector, llm, expert, other
    fwd_flops: float  # forward FLOPs per Act row
    train_flops: float  # training FLOPs per sample (TRAIN_FACTOR x the training forward)
    llm_tokens: int
    bucket_mb: float
    update_epoch: int
    weights_precision: str


def _parts(policy, model_type: str) -> dict[str, int]:
    """Parameters by the part of the network that sees which tokens; token tables, the LM head (OFT reads its action
    bins' rows only) and LoRA adapters are left out."""
    parts = dict.fromkeys(("vision", "projector", "llm", "expert", "other"), 0)
    for name, p in policy.named_parameters():
        if "lora_" in name or "embed_tokens" in name or "lm_head" in name:
            continue
        if model_type == "openpi":
            part = (
                "vision"
                if ".vision_tower." in name
                else "projector"
                if ".multi_modal_projector." in name
                else "llm"
                if ".language_model." in name
                else "expert"
                if ".dit." in name
                else "other"
            )
        else:
            part = (
                "vision"
                if name.startswith("vision.")
                else "projector"
                if name.startswith(("projector.", "proprio_projector."))
                else "llm"
                if name.startswith("llm.")
                else "other"
            )
        parts[part] += p.numel()
    return parts


def flops(model_cfg, parts: dict, cameras: int, action_dim: int) -> tuple[float, float, int]:
    """(forward FLOPs per Act row, training FLOPs per sample, LLM tokens per row): 2 x parameters x tokens per part.
    OpenVLA-OFT: the vision backbone (SigLIP + DINOv2) and projector over (image/patch)^2 patches per camera, the
    Llama over those + 1 proprio token + the prompt + chunk x action_dim action queries + 2. pi0: SigLIP over the
    patches, the Gemma VLM over patches + prompt, the action expert over chunk + 1 tokens per denoising step (all of
    them to act, one in training: Flow-SDE's evaluate). Training: TRAIN_FACTOR x that forward."""
    from rlfleet.policies.families import get_family

    key = get_family(model_cfg.model_type).sizes_group
    s = model_cfg[key]
    patches = (int(s.image_size) // int(s.patch_size)) ** 2
    prompt = int(model_cfg.max_prompt_tokens)
    chunk = int(model_cfg.num_action_chunks)
    vis = 2 * (parts["vision"] + parts["projector"]) * cameras * patches + 2 * parts["other"]
    if key == "openpi":
        llm_tokens = cameras * patches + prompt
        expert_tokens = chunk + 1
        steps = int(s.num_denoise_steps)
        prefix = vis + 2 * parts["llm"] * llm_tokens
        return (
            prefix + 2 * parts["expert"] * expert_tokens * steps,
            TRAIN_FACTOR * (prefix + 2 * parts["expert"] * expert_tokens),
            llm_tokens,
        )
    llm_tokens = cameras * patches + (1 if model_cfg.get("use_proprio") else 0) + prompt + chunk * action_dim + 2
    fwd = vis + 2 * parts["llm"] * llm_tokens
    return fwd, TRAIN_FACTOR * fwd, llm_tokens


def model_for(case: Case, quick: bool, image_size: int) -> Model:
    """The case's wire shapes (a tiny policy of the same config acting on two rows) and sizes (the real
    architecture on the meta device; the tiny one with --quick)."""
    import torch

    from rlfleet.config import load_config
    from rlfleet.policies import build_policy

    torch.set_num_threads(1)
    specs = _specs(case)
    cfg = load_config(case.config, list(case.overrides))
    mcfg = cfg.actor.model
    lp_type = cfg.algorithm.logprob_type
    lora = bool(mcfg.is_lora)
    # the reply's per-row shapes: the policy's own act on two rows
    tiny = _tiny(load_config(case.config, list(case.overrides)), image_size)
    torch.manual_seed(0)
    pol = build_policy(tiny.actor.model, specs, case.action_dim, True, lp_type)
    rng = np.random.default_rng(0)
    obs = {
        k: torch.from_numpy(
            rng.integers(0, 256, (2, *s.shape), dtype=np.uint8)
            if s.dtype == "uint8"
            else rng.standard_normal((2, *s.shape)).astype(np.float32)
        )
        for k, s in specs.items()
    }
    out = pol.act(obs, False, [case.instruction] * 2).to_numpy(0)
    reply = {"actions": (out.actions.shape[1:], "float32"), "log_probs": (out.log_probs.shape[1:], "float32")}
    if out.values is not None:
        reply["values"] = ((), "float32")
    for k, v in out.forward_inputs.items():
        reply[f"fi.{k}"] = (v.shape[1:], v.dtype.name)
    if quick:
        sized, target = tiny, pol
    else:
        sized = cfg
        with torch.device("meta"):
            target = build_policy(cfg.actor.model, specs, case.action_dim, True, lp_type)
    dt = lambda t: str(t.dtype).replace("torch.", "")  # noqa: E731
    state = [(n, tuple(t.shape), dt(t)) for n, t in target.state_dict().items()]
    sync = [(n, tuple(t.shape), dt(t)) for n, t in target.sync_state_dict().items()]
    parts = _parts(target, mcfg.model_type)
    cameras = sum(1 for _, dtype in case.obs.values() if dtype == "uint8")
    fwd, train, llm_tokens = flops(sized.actor.model, parts, cameras, case.action_dim)
    return Model(
        out.actions.shape[1],
        reply,
        out.log_probs.shape[1],
        state,
        sync,
        lora,
        parts,
        fwd,
        train,
        llm_tokens,
        float(cfg.actor.weights_bucket_mb),
        int(cfg.algorithm.update_epoch),
        str(cfg.rollout.weights_precision),
    )


# --- the processes: a receiving server and a sending client, each fresh per row ----------------------------------
def _status_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


_cpu = time.thread_time  # a stage's cost: CPU seconds of the thread that runs it (waits for a core not counted)


def _timed(fn, sink: list, sizes: list | None = None):
    """fn wrapped so that each call's CPU seconds (and, for serialisers, output bytes) are recorded."""

    def wrapped(x):
        t0 = _cpu()
        out = fn(x)
        sink.append(_cpu() - t0)
        if sizes is not None:
            sizes.append(len(out))
        return out

    return wrapped


def _fill(shape, dtype, rng) -> np.ndarray:
    """An array of this shape: images a repeating random byte pattern, floats small random values (finite, within
    the rollout schema's bounds), ints small, bools true."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == np.uint8:
        block = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        return np.resize(block, count).reshape(shape)
    if dtype.kind == "f":
        return rng.uniform(-1, 1, count).astype(dtype).reshape(shape)
    if dtype.kind == "b":
        return np.ones(shape, dtype)
    return rng.integers(0, 8, count).astype(dtype).reshape(shape)


ACT = "/rlfleet.v1.InferenceService/Act"
UPDATE = "/rlfleet.v1.InferenceService/UpdateWeights"
PUSH = "/rlfleet.v1.LearnerService/PushRollout"


def _server_main(kind: str, spec: dict, conn) -> None:
    """A receiving server for one row: an inference server's Act or UpdateWeights, or a learner's PushRollout."""
    import grpc

    from rlfleet.v1 import inference_pb2, learner_pb2
    from rlfleet.wire import codec, servers

    base = _status_mb("VmRSS")
    st: dict[str, list] = {"parse": [], "serialise": [], "decode": [], "encode": [], "cpu": [], "calls": []}
    rng = np.random.default_rng(1)
    use_shm = spec.get("shm", False)

    def reader():  # where the receiver takes shared-memory handles: one reader per call, as the services do
        from rlfleet.wire import shm

        return shm.Reader()

    shm_kw = (lambda r: {"shm": r}) if use_shm else (lambda r: {})
    if kind == "act":
        n = spec["n"]
        reply = {k: _fill((n, *shape), dtype, rng) for k, (shape, dtype) in spec["reply"].items()}

        def act(request_iterator, context):
            r = reader() if use_shm else None
            for req in request_iterator:
                st["cpu"].append(time.process_time())
                t0 = _cpu()
                for key, t in req.observations.tensors.items():  # the server's row check, then its decode
                    assert t.shape[0] <= 4096, key
                codec.decode_map(req.observations, "observations", **shm_kw(r))
                t1 = _cpu()
                resp = inference_pb2.ActResponse(
                    request_id=req.request_id,
                    actions=codec.encode(reply["actions"]),
                    log_probs=codec.encode(reply["log_probs"]),
                    weights_version=1,
                    forward_inputs=codec.encode_map({k[3:]: v for k, v in reply.items() if k.startswith("fi.")}),
                )
                if "values" in reply:
                    resp.values.CopyFrom(codec.encode(reply["values"]))
                st["decode"].append(t1 - t0)
                st["encode"].append(_cpu() - t1)
                yield resp
            if r is not None:
                r.close()

        handler = grpc.stream_stream_rpc_method_handler(
            act,
            request_deserializer=_timed(inference_pb2.ActRequest.FromString, st["parse"]),
            response_serializer=_timed(inference_pb2.ActResponse.SerializeToString, st["serialise"]),
        )
        service, method = "rlfleet.v1.InferenceService", "Act"
    elif kind == "rollout":
        from rlfleet.wire.spaces import TensorSpace

        obs_specs = {k: TensorSpace(shape, dtype) for k, (shape, dtype) in spec["obs"].items()}

        def push(request_iterator, context):
            c0, w0 = time.process_time(), time.perf_counter()
            r = reader() if use_shm else None
            time_major: dict[str, list] = {}
            tail: dict[str, np.ndarray] = {}
            decode = 0.0
            for chunk in request_iterator:  # as services/learner/server.py's PushRollout, then RolloutStore.receive
                t0 = _cpu()
                data = codec.decode_map(chunk.data, "rollout", **shm_kw(r))
                for k, v in data.items():
                    if chunk.last and codec.is_tail(k):
                        tail[k] = v
                    else:
                        time_major.setdefault(k, []).append(v)
                [codec.episode_from_proto(e) for e in chunk.episodes]
                decode += _cpu() - t0
            t0 = _cpu()
            # one chunk read from shared memory is already a private array (services/learner/server.py keeps it)
            whole = {
                k: v[0] if len(v) == 1 and v[0].flags.writeable else np.concatenate(v) for k, v in time_major.items()
            }
            if r is not None:
                r.close()
            T, N = codec.check_rollout(
                whole,
                tail,
                obs_specs=obs_specs,
                chunk=spec["chunk"],
                action_dim=spec["action_dim"],
                log_prob_width=spec["log_prob_width"],
            )
            decode += _cpu() - t0
            del whole, time_major
            st["calls"].append({"cpu": time.process_time() - c0, "decode": decode, "wall": time.perf_counter() - w0})
            return learner_pb2.PushRolloutResponse(num_steps=T, num_envs=N)

        handler = grpc.stream_unary_rpc_method_handler(
            push,
            request_deserializer=_timed(learner_pb2.RolloutChunk.FromString, st["parse"]),
            response_serializer=learner_pb2.PushRolloutResponse.SerializeToString,
        )
        service, method = "rlfleet.v1.LearnerService", "PushRollout"
    else:
        import torch

        from rlfleet.wire import weights

        torch.set_num_threads(1)

        def update(request_iterator, context):
            c0, w0 = time.process_time(), time.perf_counter()
            waited = [0.0]

            def chunks():  # the CPU spent inside next() (receiving, parsing) is not the decode's
                while True:
                    t0 = _cpu()
                    try:
                        msg = next(request_iterator)
                    except StopIteration:
                        return
                    finally:
                        waited[0] += _cpu() - t0
                    yield msg

            t0 = _cpu()
            r = reader() if use_shm else None
            version, state, _, _, _ = weights.assemble(chunks(), **shm_kw(r))
            if r is not None:
                r.close()
            t1 = _cpu()
            for name, tensor in state.items():  # the engine's check before it loads a set
                if tensor.is_floating_point():
                    bool(torch.isfinite(tensor).all())
            check = _cpu() - t1
            decode = _cpu() - t0 - waited[0]
            nt = len(state)
            del state
            st["calls"].append(
                {"cpu": time.process_time() - c0, "decode": decode, "check": check, "wall": time.perf_counter() - w0}
            )
            return inference_pb2.UpdateWeightsResponse(version=version, num_tensors=nt)

        handler = grpc.stream_unary_rpc_method_handler(
            update,
            request_deserializer=_timed(inference_pb2.WeightsChunk.FromString, st["parse"]),
            response_serializer=inference_pb2.UpdateWeightsResponse.SerializeToString,
        )
        service, method = "rlfleet.v1.InferenceService", "UpdateWeights"
    methods = {method: handler}
    if use_shm:  # the SharedMemory handshake the services answer (rlfleet.wire.shm.answer)
        from rlfleet.v1 import tensor_pb2
        from rlfleet.wire import shm

        methods["SharedMemory"] = grpc.unary_unary_rpc_method_handler(
            lambda request, context: shm.answer(request, True),
            request_deserializer=tensor_pb2.SharedMemoryOffer.FromString,
            response_serializer=tensor_pb2.SharedMemoryAnswer.SerializeToString,
        )
    server = servers.make_server(max_workers=4)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    address = servers.bind(server, "127.0.0.1:0")
    server.start()
    conn.send(address)
    conn.recv()  # the client is done
    conn.send({**st, "base_mb": base, "peak_mb": _status_mb("VmHWM")})
    server.stop(0)


def _client_main(kind: str, spec: dict, address: str, conn) -> None:
    try:
        conn.send({"base_mb": _status_mb("VmRSS"), **_CLIENTS[kind](spec, address), "peak_mb": _status_mb("VmHWM")})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _has_shared(tensor) -> bool:
    return "shared" in tensor.DESCRIPTOR.fields_by_name and tensor.HasField("shared")


def _shared(tmap) -> int:
    """Bytes a TensorMap carries by shared-memory handle (0 before the path existed)."""
    return sum(t.shared.length for t in tmap.tensors.values() if _has_shared(t))


def _offer(channel, service: str) -> None:
    """The SharedMemory handshake, as the services' clients make it; refused: an error (this row is shm's)."""
    from rlfleet.v1 import tensor_pb2
    from rlfleet.wire.clients import offer_shared_memory

    method = channel.unary_unary(
        f"/rlfleet.v1.{service}/SharedMemory",
        request_serializer=tensor_pb2.SharedMemoryOffer.SerializeToString,
        response_deserializer=tensor_pb2.SharedMemoryAnswer.FromString,
    )
    ok, why = offer_shared_memory(method, 10.0)
    if not ok:
        raise RuntimeError(f"shared memory refused: {why}")


def _client_act(spec: dict, address: str) -> dict:
    """An env server's stage: requests as rlfleet.wire.clients._Stream.submit builds them, replies decoded and
    checked as its result() does."""
    import grpc

    from rlfleet.v1 import inference_pb2
    from rlfleet.wire import channels, codec
    from rlfleet.wire.clients import _check_result
    from rlfleet.wire.codec import PolicyOutput, row_keys

    n, rng = spec["n"], np.random.default_rng(0)
    obs = {k: _fill((n, *shape), dtype, rng) for k, (shape, dtype) in spec["obs"].items()}
    instructions = [spec["instruction"]] * n
    st: dict[str, list] = {
        "encode": [],
        "serialise": [],
        "parse": [],
        "decode": [],
        "wall": [],
        "cpu": [],
        "req_bytes": [],
        "resp_bytes": [],
        "shm_bytes": [],
    }
    channel = channels.channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    arena, kw = None, {}
    if spec.get("shm"):  # as rlfleet.wire.clients._Stream: observations into a ring of two segments
        from rlfleet.wire import shm

        _offer(channel, "InferenceService")
        arena = shm.Arena("act", slots=2)
        kw = {"arena": arena}
    requests: queue.SimpleQueue = queue.SimpleQueue()
    end = object()
    call = channel.stream_stream(
        ACT,
        request_serializer=_timed(inference_pb2.ActRequest.SerializeToString, st["serialise"], st["req_bytes"]),
        response_deserializer=_timed(inference_pb2.ActResponse.FromString, st["parse"]),
    )
    responses = call(iter(requests.get, end), wait_for_ready=True)
    for i in range(spec["warmup"] + spec["reps"]):
        st["cpu"].append(time.process_time())
        w0, t0 = time.perf_counter(), _cpu()
        req = inference_pb2.ActRequest(
            request_id=i,
            observations=codec.encode_map(obs, **kw),
            deterministic=False,
            instructions=list(instructions),
            trace_context={},
            noise_keys=np.asarray(row_keys(np.arange(n), 0, i), np.uint64).tolist(),
        )
        t1 = _cpu()
        st["shm_bytes"].append(_shared(req.observations))
        requests.put(req)
        resp = next(responses)
        if arena is not None:  # answered: the server is done with the request's segment
            arena.release()
        t2 = _cpu()
        res = PolicyOutput(
            codec.decode(resp.actions, "actions", dtype=np.float32),
            codec.decode(resp.log_probs, "log_probs", dtype=np.float32),
            codec.decode(resp.values, "values", dtype=np.float32) if resp.HasField("values") else None,
            codec.decode_map(resp.forward_inputs, "forward_inputs"),
            resp.weights_version,
        )
        _check_result(res, n, spec["action_dim"])
        t3 = _cpu()
        st["encode"].append(t1 - t0)
        st["decode"].append(t3 - t2)
        st["wall"].append(time.perf_counter() - w0)
        st["resp_bytes"].append(resp.ByteSize())
    st["cpu"].append(time.process_time())
    requests.put(end)
    responses.cancel()
    channel.close()
    if arena is not None:
        arena.close()
    return st


def _client_rollout(spec: dict, address: str) -> dict:
    """An env server's push of one epoch (or a T-slice of it): rlfleet.wire.clients.rollout_chunks over
    PushRollout, the buffers as the rollout worker fills them."""
    import grpc

    from rlfleet.v1 import learner_pb2
    from rlfleet.wire import channels, codec
    from rlfleet.wire.clients import rollout_chunks

    T, n, rng = spec["T"], spec["n"], np.random.default_rng(0)
    tm = {f"{codec.OBS}{k}": _fill((T, n, *shape), dtype, rng) for k, (shape, dtype) in spec["obs"].items()}
    arena, kw = None, {}
    channel = channels.channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    if spec.get("shm"):  # as the env server: the observation buffers live in the arena's segment
        from rlfleet.wire import shm

        _offer(channel, "LearnerService")
        arena = shm.Arena("rollout", slots=1)
        kw = {"arena": arena}
        bufs = arena.buffers({k: (v.shape, v.dtype) for k, v in tm.items()})
        for k, v in tm.items():
            bufs[k][...] = v
        tm = bufs
    for k, f in codec.TIME_MAJOR.items():
        trailing = {"": (), "chunk,action_dim": (spec["chunk"], spec["action_dim"]), "L": (spec["log_prob_width"],)}[
            f.trailing
        ]
        tm[k] = _fill((T, n, *trailing), f.dtype, rng)
    for k, (shape, dtype) in spec["reply"].items():
        if k.startswith("fi."):
            tm[k] = _fill((T, n, *shape), dtype, rng)
    tm["terminated"][:] = False
    tm["truncated"][:] = False
    eps = [codec.EpisodeStat(i % n, 1.0, 50, True, True, -1, spec["instruction"]) for i in range(n)]
    # the tail: each env's observation after the last step (no episode ends inside this rollout)
    rollout = codec.Rollout(
        tm, codec.make_tail({k[4:]: v[-1].copy() for k, v in tm.items() if k.startswith("obs.")}), eps
    )
    st: dict[str, list] = {
        "encode": [],
        "serialise": [],
        "wall": [],
        "cpu": [],
        "bytes": [],
        "msgs": [],
        "shm_bytes": [],
    }
    ser: list = []
    sizes: list = []
    call = channel.stream_unary(
        PUSH,
        request_serializer=_timed(learner_pb2.RolloutChunk.SerializeToString, ser, sizes),
        response_deserializer=learner_pb2.PushRolloutResponse.FromString,
    )
    for rep in range(spec["warmup"] + spec["reps"]):
        enc: list = []
        shared = [0]
        ser.clear()
        sizes.clear()

        def chunks():
            it = rollout_chunks(rollout, 0, 0, "bench", **kw)
            while True:
                t0 = _cpu()
                msg = next(it, None)
                enc.append(_cpu() - t0)
                if msg is None:
                    return
                shared[0] += _shared(msg.data)
                yield msg

        c0, t0 = time.process_time(), time.perf_counter()
        call(chunks(), timeout=600, wait_for_ready=True)
        if arena is not None:
            arena.release()
        st["wall"].append(time.perf_counter() - t0)
        st["cpu"].append(time.process_time() - c0)
        st["encode"].append(sum(enc))
        st["serialise"].append(sum(ser))
        st["bytes"].append(sum(sizes))
        st["msgs"].append(len(sizes))
        st["shm_bytes"].append(shared[0])
    channel.close()
    if arena is not None:
        arena.close()
    return st


def _client_weights(spec: dict, address: str) -> dict:
    """The learner's rank 0: services.learner.publisher.WeightPublisher.publish of a set (or a slice of it) with
    buckets of actor.weights_bucket_mb gathered by services.learner.sharding.gather_buckets. The publisher runs as
    it is; its encode and serialise stages are timed in a separate pass over the same buckets (weights.iter_chunks,
    SerializeToString), in this process."""
    import inspect

    import torch

    from rlfleet.wire import weights
    from rlfleet.wire.spaces import TensorSpace
    from services.learner import publisher as pub
    from services.learner.sharding import gather_buckets

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, shape, dtype in spec["tensors"]:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        if t.is_floating_point():
            t.uniform_(-0.02, 0.02, generator=gen)
        else:
            t.zero_()
        state[name] = t
    names = list(state)
    bucket = int(spec["bucket_mb"] * 2**20)
    obs_specs = {k: TensorSpace(shape, dtype) for k, (shape, dtype) in spec["obs"].items()}
    kw = (
        {"shared_memory": bool(spec.get("shm"))}
        if "shared_memory" in inspect.signature(pub.WeightPublisher).parameters
        else {}
    )
    if spec.get("shm") and not kw:
        raise RuntimeError("this WeightPublisher has no shared-memory path")
    st: dict[str, list] = {
        "encode": [],
        "serialise": [],
        "wall": [],
        "cpu": [],
        "bytes": [],
        "msgs": [],
        "shm_bytes": [],
    }
    for rep in range(spec["warmup"] + spec["reps"]):
        # the stages, as the publisher's stream runs them: weights.iter_chunks per bucket, then SerializeToString
        arena, akw = None, {}
        if spec.get("shm"):
            from rlfleet.wire import shm

            arena = shm.Arena("weights", slots=2)
            akw = {"arena": arena}
        enc = ser = 0.0
        nbytes = msgs = shared = 0
        first = True
        for part in gather_buckets(state, bucket, True):
            opts = (
                {"partial": True}
                if spec["partial"]
                else ({"obs_specs": obs_specs, "action_dim": spec["action_dim"]} if first else {})
            )
            it = weights.iter_chunks(part, rep + 1, **opts, **akw)
            while True:
                t0 = _cpu()
                msg = next(it, None)
                t1 = _cpu()
                enc += t1 - t0
                if msg is None:
                    break
                data = msg.SerializeToString()
                ser += _cpu() - t1
                nbytes += len(data)
                msgs += 1
                shared += msg.data.shared.length if _has_shared(msg.data) else 0
            first = False
            if arena is not None:
                arena.release()  # nobody reads this pass's segments
        if arena is not None:
            arena.close()
        # the publish itself
        publisher = pub.WeightPublisher(timeout=600, **kw)
        if spec["partial"]:
            publisher.synced.add(address)
        c0, t0 = time.process_time(), time.perf_counter()
        publisher.publish(
            [address],
            rep + 1,
            lambda ns: gather_buckets({n: state[n] for n in ns}, bucket, True),
            names,
            names,
            obs_specs,
            spec["action_dim"],
        )
        st["wall"].append(time.perf_counter() - t0)
        st["cpu"].append(time.process_time() - c0)
        st["encode"].append(enc)
        st["serialise"].append(ser)
        st["bytes"].append(nbytes)
        st["msgs"].append(msgs)
        st["shm_bytes"].append(shared)
    return st


_CLIENTS = {"act": _client_act, "rollout": _client_rollout, "weights": _client_weights}


MALLOC = {"mmap": 0}  # --malloc-mmap-threshold-mb: glibc's thresholds for the measured processes (0: its defaults)


@contextlib.contextmanager
def _malloc_env():
    """glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ in the environment of the processes started inside
    (read by glibc when a process starts): allocations below the threshold come from the heap and freed memory stays
    there, instead of each large buffer being a fresh mmap that faults its pages in and is unmapped when freed."""
    mb = MALLOC["mmap"]
    saved = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    if mb:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mb << 20)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(2 * mb << 20)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_pair(kind: str, spec: dict, timeout: float = 900.0) -> tuple[dict, dict]:
    """Start the receiving server, then the sending client, each in a fresh process -> (client, server) results."""
    ctx = mp.get_context("spawn")
    s_conn, s_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    srv = ctx.Process(target=_server_main, args=(kind, spec, s_child), daemon=True)
    with _malloc_env():
        srv.start()
    cli = None
    try:
        if not s_conn.poll(120):
            raise RuntimeError(f"{kind} server did not start")
        address = s_conn.recv()
        cli = ctx.Process(target=_client_main, args=(kind, spec, address, c_child), daemon=True)
        with _malloc_env():
            cli.start()
        if not c_conn.poll(timeout):
            raise RuntimeError(f"{kind} client did not finish within {timeout:.0f}s")
        client = c_conn.recv()
        if "error" in client:
            raise RuntimeError(f"{kind} client: {client['error']}")
        s_conn.send("report")
        if not s_conn.poll(60):
            raise RuntimeError(f"{kind} server did not report")
        server = s_conn.recv()
        return client, server
    finally:
        for p in (cli, srv):
            if p is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join(5)


# --- rows ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    path: str
    what: str
    envs: str
    nbytes: float
    msgs: float
    encode: float  # ms, each stage summed over the row's messages (both directions for Act)
    serialise: float
    transfer: float
    parse: float
    decode: float
    wall: float
    cpu_send: float
    cpu_recv: float
    peak_send: float  # MB
    peak_recv: float
    gpu_ms: float
    saturates: float  # env steps/s
    note: str = ""
    transport: str = "grpc"


def _med(xs) -> float:
    return float(np.median(xs)) if len(xs) else 0.0


def measure_act(case: Case, model: Model, n: int, quick: bool, transport: str = "grpc") -> Row:
    spec = {
        "shm": transport == "shm",
        "n": n,
        "obs": case.obs,
        "reply": model.reply,
        "instruction": case.instruction,
        "action_dim": case.action_dim,
        "warmup": 1 if quick else 2,
        "reps": 3 if quick else 10,
    }
    c, s = _run_pair("act", spec)
    w = spec["warmup"]
    k = spec["reps"]
    ms = lambda xs: 1e3 * _med(xs[w:])  # noqa: E731
    cpu_c = 1e3 * (c["cpu"][-1] - c["cpu"][w]) / k
    cpu_s = 1e3 * (s["cpu"][-1] - s["cpu"][w]) / (len(s["cpu"]) - 1 - w) if len(s["cpu"]) > w + 1 else float("nan")
    stages = dict(
        encode=ms(c["encode"]) + ms(s["encode"]),
        serialise=ms(c["serialise"]) + ms(s["serialise"]),
        parse=ms(s["parse"]) + ms(c["parse"]),
        decode=ms(s["decode"]) + ms(c["decode"]),
    )
    shared = _med(c["shm_bytes"][w:])
    nbytes = _med(c["req_bytes"][w:]) + _med(c["resp_bytes"][w:]) + shared
    gpu = 1e3 * n * model.fwd_flops / H100_FLOPS
    steps = n * model.chunk
    return Row(
        "Act",
        case.label,
        str(n),
        nbytes,
        2,
        **stages,
        transport=transport,
        transfer=cpu_c + cpu_s - sum(stages.values()),
        wall=ms(c["wall"]),
        cpu_send=cpu_c,
        cpu_recv=cpu_s,
        peak_send=c["peak_mb"],
        peak_recv=s["peak_mb"],
        gpu_ms=gpu,
        saturates=steps / (cpu_s / 1e3),
        note=f"request {(_med(c['req_bytes'][w:]) + shared) / 1e6:.1f} MB"
        + (f" ({shared / 1e6:.1f} MB by handle)" if shared else "")
        + f" + reply {_med(c['resp_bytes'][w:]) / 1e3:.0f} kB; {n} rows of {model.chunk} env steps",
    )


def _per_sample_bytes(case: Case, model: Model) -> int:
    from rlfleet.wire import codec

    total = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in case.obs.values())
    total += sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        for k, (shape, dt) in model.reply.items()
        if k.startswith("fi.")
    )
    for f in codec.TIME_MAJOR.values():
        width = {"": 1, "chunk,action_dim": model.chunk * case.action_dim, "L": model.log_prob_width}[f.trailing]
        total += width * np.dtype(f.dtype).itemsize
    return total


def measure_rollout(case: Case, model: Model, n: int, quick: bool, cap: int, transport: str = "grpc") -> Row:
    T = case.env_steps // model.chunk
    per_step = n * _per_sample_bytes(case, model)
    T_slice = max(1, min(T, cap // per_step))
    scale = T / T_slice
    spec = {
        "shm": transport == "shm",
        "T": T_slice,
        "n": n,
        "obs": case.obs,
        "reply": model.reply,
        "chunk": model.chunk,
        "action_dim": case.action_dim,
        "log_prob_width": model.log_prob_width,
        "instruction": case.instruction,
        "warmup": 1,
        "reps": 1 if quick else 2,
    }
    c, s = _run_pair("rollout", spec)
    w = spec["warmup"]
    ms = lambda xs: 1e3 * _med(xs[w:]) * scale  # noqa: E731
    calls = s["calls"][w:]
    parse_per_call = np.array_split(np.array(s["parse"]), len(s["calls"]))[w:]
    stages = dict(
        encode=ms(c["encode"]),
        serialise=ms(c["serialise"]),
        parse=1e3 * _med([p.sum() for p in parse_per_call]) * scale,
        decode=1e3 * _med([x["decode"] for x in calls]) * scale,
    )
    cpu_s = 1e3 * _med([x["cpu"] for x in calls]) * scale
    cpu_c = ms(c["cpu"])
    steps = n * T * model.chunk
    gpu = 1e3 * n * T * model.train_flops * model.update_epoch / H100_FLOPS
    shared = _med(c["shm_bytes"][w:]) * scale
    note = f"{n} x {T} samples of {model.chunk} env steps ({steps:,} env steps)"
    if shared:
        note += f"; {shared / 1e6:,.0f} MB by handle"
    if scale > 1:
        note += f"; measured on {T_slice} of {T} time steps, x{scale:.1f}"
    return Row(
        "PushRollout",
        case.label,
        str(n),
        _med(c["bytes"][w:]) * scale + shared,
        _med(c["msgs"][w:]) * scale,
        **stages,
        transport=transport,
        transfer=cpu_c + cpu_s - sum(stages.values()),
        wall=ms(c["wall"]),
        cpu_send=cpu_c,
        cpu_recv=cpu_s,
        peak_send=c["peak_mb"],
        peak_recv=s["peak_mb"],
        gpu_ms=gpu,
        saturates=steps / (cpu_s / 1e3),
        note=note,
    )


def _slice(tensors: list, cap: int, bytes_of) -> list:
    """Every k-th tensor of the set, k chosen so that about ``cap`` bytes are taken (the size mix of the whole)."""
    total = sum(bytes_of(t) for t in tensors)
    if total <= cap:
        return list(tensors)
    k = max(1, math.ceil(total / cap))
    taken, size = [], 0
    for start in range(k):
        for t in tensors[start::k]:
            if size >= cap:
                return taken
            taken.append(t)
            size += bytes_of(t)
    return taken


def measure_weights(
    case: Case,
    model: Model,
    which: str,
    dtype: str | None,
    quick: bool,
    cap: int,
    epoch_envs: int,
    transport: str = "grpc",
) -> Row:
    """``which``: full (the first set a server gets, or every set of a model without LoRA) or partial (LoRA
    adapters); ``dtype``: None = as the learner holds them (fp32), or cast (bf16)."""
    import torch

    tensors = model.sync if which == "partial" else model.state
    if dtype is not None:
        tensors = [(n, s, dtype if t in ("float32", "float64") else t) for n, s, t in tensors]

    def bytes_of(t) -> int:
        return int(np.prod(t[1], dtype=np.int64)) * torch.empty((), dtype=getattr(torch, t[2])).element_size()

    total = sum(bytes_of(t) for t in tensors)
    taken = _slice(tensors, cap, bytes_of)
    taken_bytes = sum(bytes_of(t) for t in taken)
    scale = total / taken_bytes
    spec = {
        "shm": transport == "shm",
        "tensors": taken,
        "obs": case.obs,
        "action_dim": case.action_dim,
        "bucket_mb": model.bucket_mb,
        "partial": which == "partial",
        "warmup": 0 if scale > 1 else 1,
        "reps": 1 if quick else 2,
    }
    c, s = _run_pair("weights", spec)
    w = spec["warmup"]
    ms = lambda xs: 1e3 * _med(xs[w:]) * scale  # noqa: E731
    calls = s["calls"][w:]
    parse_per_call = np.array_split(np.array(s["parse"]), len(s["calls"]))[w:]
    stages = dict(
        encode=ms(c["encode"]),
        serialise=ms(c["serialise"]),
        parse=1e3 * _med([p.sum() for p in parse_per_call]) * scale,
        decode=1e3 * _med([x["decode"] for x in calls]) * scale,
    )
    cpu_s = 1e3 * _med([x["cpu"] for x in calls]) * scale
    cpu_c = ms(c["cpu"])
    wall = ms(c["wall"])
    T = case.env_steps // model.chunk
    steps = epoch_envs * T * model.chunk
    gpu = 1e3 * epoch_envs * T * model.train_flops * model.update_epoch / H100_FLOPS
    kind = (
        ("LoRA r32 adapters (partial)" if model.lora else "trained set (partial)") if which == "partial" else "full set"
    )
    held = dtype or "fp32, as the learner holds it"
    shared = _med(c["shm_bytes"][w:]) * scale
    check = 1e3 * _med([x["check"] for x in calls]) * scale
    note = (
        f"{kind}, {len(tensors)} tensors, {held}; decode includes the engine's finiteness check, "
        f"{check:,.0f} ms; GPU: one epoch's training at {epoch_envs} envs ({steps:,} env steps)"
    )
    if shared:
        note += f"; {shared / 1e9:,.2f} GB by handle"
    if scale > 1:
        note += f"; measured on {taken_bytes / 1e9:.2f} GB ({len(taken)} tensors), x{scale:.1f}"
    short = ("LoRA r32 adapters" if model.lora else "trained set") if which == "partial" else "full set"
    return Row(
        "UpdateWeights",
        f"{case.label.split(',')[0]}, {short}, {held.split(',')[0]}",
        "-",
        total,
        _med(c["msgs"][w:]) * scale,
        **stages,
        transfer=cpu_c + cpu_s - sum(stages.values()),
        wall=wall,
        transport=transport,
        cpu_send=cpu_c,
        cpu_recv=cpu_s,
        peak_send=c["peak_mb"],
        peak_recv=s["peak_mb"],
        gpu_ms=gpu,
        saturates=steps / (wall / 1e3),
        note=note,
    )


# --- compression of rendered frames ------------------------------------------------------------------------------
FRAME_SOURCES = {"panda": ("gym", "PandaPickCubeVision-v0"), "libero": ("libero", "libero_spatial")}


def render_frames(source: str, envs: int, steps: int, image_size: int, seed: int = 0) -> np.ndarray:
    """[steps, envs, cameras, S, S, 3] uint8: each camera of ``source``'s simulator (its backend, as the env server
    steps it, in the simulator's own environment) under uniformly random actions, consecutive steps of each env
    (a slot whose episode ends is reset and goes on)."""
    import subprocess
    import tempfile

    from services.env.environment import python_for

    sim, env_id = FRAME_SOURCES[source]
    python = python_for(sim)
    if python == sys.executable:
        return _render_here(sim, env_id, envs, steps, image_size, seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "frames.npy")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [
                python,
                "-m",
                "benchmarks.wire_budget",
                "--render",
                f"{sim},{env_id},{envs},{steps},{image_size},{seed},{out}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode:
            raise RuntimeError(f"rendering {env_id} in the {sim} environment failed: {done.stderr[-2000:]}")
        return np.load(out)


def _render_here(sim: str, env_id: str, envs: int, steps: int, image_size: int, seed: int) -> np.ndarray:
    from services.env.backends import make_sim_backend

    backend = make_sim_backend(sim, env_id, envs, {"image_size": image_size})
    cams = sorted(
        k for k, sp in backend.observation_space.items() if len(sp.shape) == 3 and np.dtype(sp.dtype) == np.uint8
    )
    ids = np.arange(envs)
    obs, _ = backend.reset(ids, [seed + i for i in range(envs)], [None] * envs)
    obs = {k: np.array(obs[k]) for k in cams}
    space = backend.action_space
    rng = np.random.default_rng(seed)
    frames = np.empty((steps, envs, len(cams), *backend.observation_space[cams[0]].shape), np.uint8)
    for t in range(steps):
        for c, k in enumerate(cams):
            frames[t, :, c] = obs[k]
        res = backend.step(ids, rng.uniform(space.low, space.high, (envs, *space.shape)).astype(np.float32))
        obs = {k: np.array(res.obs[k]) for k in cams}
        done = ids[np.asarray(res.terminated) | np.asarray(res.truncated)]
        if done.size:
            again, _ = backend.reset(done, [None] * done.size, [None] * done.size)
            for k in cams:
                obs[k][done] = again[k]
    backend.close()
    return frames


def codecs() -> dict:
    """name -> (compress, decompress) over bytes-like objects, single-threaded."""
    try:
        import lz4.block
        import zstandard
    except ImportError as exc:
        raise SystemExit(
            f"the compression study needs lz4 and zstandard ({exc.name} is missing): "
            f"pip install -e '.[compression]', or --only act,rollout,weights"
        ) from None

    out = {"lz4": (lambda b: lz4.block.compress(b, store_size=True), lz4.block.decompress)}
    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (c.compress, d.decompress)
    return out


def compression_study(frames: np.ndarray) -> list[dict]:
    """Each codec, with and without an XOR delta against the previous step of the same env, over the steps' batches
    (one batch = every env's two cameras at one step, compressed as one buffer): ratio, encode and decode ms per MB
    (the delta's XOR counted in both), and a lossless check."""
    steps = frames.shape[0]
    raw = frames[0].nbytes
    rows = []
    for name, (comp, decomp) in codecs().items():
        for delta in (False, True):
            enc = dec = 0.0
            out_bytes = 0
            prev_sent = prev_got = None
            scratch = np.empty_like(frames[0])
            for t in range(steps):
                batch = frames[t]
                t0 = _cpu()
                if delta and prev_sent is not None:
                    np.bitwise_xor(batch, prev_sent, out=scratch)
                    blob = comp(scratch)
                else:
                    blob = comp(np.ascontiguousarray(batch))
                t1 = _cpu()
                got = np.frombuffer(decomp(blob), np.uint8).reshape(batch.shape)
                if delta and prev_got is not None:
                    got = np.bitwise_xor(got, prev_got)
                t2 = _cpu()
                enc += t1 - t0
                dec += t2 - t1
                out_bytes += len(blob)
                if not np.array_equal(got, batch):
                    raise AssertionError(f"{name}{' + delta' if delta else ''}: not lossless at step {t}")
                prev_sent, prev_got = batch, got
            mb = steps * raw / 2**20
            rows.append(
                {
                    "codec": ("XOR delta + " if delta else "") + name,
                    "ratio": out_bytes / (steps * raw),
                    "enc_ms_mb": 1e3 * enc / mb,
                    "dec_ms_mb": 1e3 * dec / mb,
                    "batch_mb": raw / 2**20,
                }
            )
    return rows


def break_even_gbit(row: dict) -> float:
    """The link speed below which compressing wins: (bytes saved per MB) / (encode + decode time per MB), serial."""
    saved_mb = 1.0 - row["ratio"]
    spent_s = (row["enc_ms_mb"] + row["dec_ms_mb"]) / 1e3
    return saved_mb * 2**20 * 8 / spent_s / 1e9 if spent_s > 0 else float("inf")


# --- the zero-copy path, once it exists ---------------------------------------------------------------------------
def shm_available() -> str | None:
    """None when this checkout has a shared-memory path for tensors (rlfleet.wire.shm, a ``shared`` reference in the
    Tensor message) that this host can use, else why not."""
    from rlfleet.wire import codec

    if "shared" not in codec.Tensor.DESCRIPTOR.fields_by_name:
        return "not available: rlfleet.wire has no shared-memory path yet (no `shared` field in the Tensor message)"
    from rlfleet.wire import shm

    why = shm.unavailable()
    return f"not available on this host: {why}" if why else None


# --- output -------------------------------------------------------------------------------------------------------
HEADER = (
    "| path | model, env | envs | MB | msgs | encode ms | serialise ms | transfer ms | parse ms | decode ms "
    "| wall ms | CPU ms send / recv | peak MB send / recv | GPU ms (H100 est.) | wire / GPU "
    "| saturates one receiver at (env steps/s) | notes |"
)


def _fmt(x: float, digits: int = 1) -> str:
    if x != x:
        return "-"
    return f"{x:,.{digits}f}" if abs(x) < 100 else f"{x:,.0f}"


def table(rows: list[Row]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.path}{'' if r.transport == 'grpc' else f' ({r.transport})'} | {r.what} | {r.envs} "
            f"| {_fmt(r.nbytes / 1e6, 3 if r.nbytes < 1e6 else 1)} | {_fmt(r.msgs, 0)} | {_fmt(r.encode)} "
            f"| {_fmt(r.serialise)} | {_fmt(r.transfer)} | {_fmt(r.parse)} | {_fmt(r.decode)} | {_fmt(r.wall)} "
            f"| {_fmt(r.cpu_send)} / {_fmt(r.cpu_recv)} | {r.peak_send:,.0f} / {r.peak_recv:,.0f} "
            f"| {_fmt(r.gpu_ms)} | {100 * r.wall / r.gpu_ms:.0f}% | {r.saturates:,.0f} | {r.note} |"
        )
    return "\n".join(lines)


def summary_table(rows: list[Row]) -> str:
    """gRPC against shared memory, row by row (rows measured over both transports): what the receiver and the
    sender spend, the wall time and the saturation, and how much more the receiver can take in."""
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r.path, r.what, r.envs), {})[r.transport] = r
    lines = [
        "| path | model, env | envs | wall ms gRPC / shm | CPU ms send, gRPC / shm | CPU ms recv, gRPC / shm "
        "| saturates at, gRPC / shm (env steps/s) | capacity, shm / gRPC |",
        "|---" * 8 + "|",
    ]
    for (path, what, envs), by in pairs.items():
        if {"grpc", "shm"} <= set(by):
            g, m = by["grpc"], by["shm"]
            lines.append(
                f"| {path} | {what} | {envs} | {_fmt(g.wall)} / {_fmt(m.wall)} "
                f"| {_fmt(g.cpu_send)} / {_fmt(m.cpu_send)} | {_fmt(g.cpu_recv)} / {_fmt(m.cpu_recv)} "
                f"| {g.saturates:,.0f} / {m.saturates:,.0f} | {m.saturates / g.saturates:.1f}x |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def compression_table(rows: list[dict], frames_shape) -> str:
    steps, envs, cams, s = frames_shape[0], frames_shape[1], frames_shape[2], frames_shape[3]
    out = [
        f"({steps} consecutive steps x {envs} envs x {cams} cameras of {s} px = {steps * envs * cams} frames; "
        f"one buffer per step: {rows[0]['batch_mb']:.2f} MiB)",
        "",
        "| codec | bytes kept | encode ms / MB | decode ms / MB | encode / decode ms per 3 MiB | wins below (Gbit/s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['codec']} | {100 * r['ratio']:.1f}% | {r['enc_ms_mb']:.2f} | {r['dec_ms_mb']:.2f} "
            f"| {3 * r['enc_ms_mb']:.2f} / {3 * r['dec_ms_mb']:.2f} | {break_even_gbit(r):.2f} |"
        )
    return "\n".join(out)


def _machine() -> str:
    load = os.getloadavg()
    mem = next((int(line.split()[1]) / 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, load average {load[0]:.2f} / {load[1]:.2f} at the start; "
        f"{datetime.date.today().isoformat()}; Python {platform.python_version()}"
    )


def write_markdown(path: pathlib.Path, block: str) -> None:
    """Replace the measured block between the markers in ``path`` (created with just the block if absent)."""
    text = path.read_text() if path.exists() else f"{MARK_BEGIN}\n{MARK_END}\n"
    if MARK_BEGIN not in text or MARK_END not in text:
        text = text.rstrip("\n") + f"\n\n{MARK_BEGIN}\n{MARK_END}\n"
    head, rest = text.split(MARK_BEGIN, 1)
    _, tail = rest.split(MARK_END, 1)
    path.write_text(f"{head}{MARK_BEGIN}\n{block.strip()}\n{MARK_END}{tail}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", default="64,128,256", help="env counts per Act batch and PushRollout epoch")
    ap.add_argument("--only", default="act,rollout,weights,compression")
    ap.add_argument("--cases", default="", help="';'-separated substrings of case labels (default: all)")
    ap.add_argument(
        "--transport",
        default="grpc",
        choices=("grpc", "shm", "both"),
        help="grpc (the contract), shm (the same-host shared-memory path, once rlfleet.wire has one)",
    )
    ap.add_argument(
        "--markdown",
        nargs="?",
        const=str(ROOT / "docs" / "wire-budget.md"),
        default=None,
        help="also write the tables into this file, between its wire-budget markers (default: docs/wire-budget.md)",
    )
    ap.add_argument(
        "--malloc-mmap-threshold-mb",
        type=int,
        default=0,
        help="glibc's mmap (and 2x trim) threshold for the measured processes, in MB (0: glibc's "
        "defaults); their rows are marked",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes (4 envs, 32 px, tiny models): a smoke run")
    ap.add_argument("--frames", default="8,60", help="compression: envs,steps of rendered frames")
    ap.add_argument(
        "--frames-from",
        default="panda",
        help=f"compression: comma-separated frame sources of {', '.join(FRAME_SOURCES)} (libero renders in "
        f"its own environment, ~1 GB per env)",
    )
    ap.add_argument("--render", default=None, help=argparse.SUPPRESS)  # internal: frames in a simulator's environment
    args = ap.parse_args(argv)
    MALLOC["mmap"] = args.malloc_mmap_threshold_mb
    if args.render:
        sim, env_id, e, t, size, seed, out = args.render.split(",")
        np.save(out, _render_here(sim, env_id, int(e), int(t), int(size), int(seed)))
        return
    only = set(args.only.split(","))
    image = 32 if args.quick else 224
    envs = [4] if args.quick else [int(x) for x in args.envs.split(",")]
    rollout_cap = (256 << 10) if args.quick else ROLLOUT_CAP
    weights_cap = (1 << 20) if args.quick else WEIGHTS_CAP
    picked = [c for c in cases(image) if not args.cases or any(s in c.label for s in args.cases.split(";"))]
    if args.quick:
        picked = [c for c in picked if c.label in ("OpenVLA-OFT, PandaPickCubeVision", "pi0, LIBERO")]
        picked = [dataclasses.replace(c, env_steps=40) for c in picked]
    machine = _machine()
    print(f"[wire budget] {machine}", flush=True)
    transports = ["grpc", "shm"] if args.transport == "both" else [args.transport]
    shm_note = shm_available() if "shm" in transports else None
    if shm_note:
        print(f"[wire budget] shm: {shm_note}", flush=True)
        transports = [t for t in transports if t != "shm"]
    rows: list[Row] = []
    if only & {"act", "rollout", "weights"} and transports:
        models = {}
        for case in picked:
            t0 = time.perf_counter()
            models[case.label] = model = model_for(case, args.quick, image)
            p = model.parts
            print(
                f"[{case.label}] chunk {model.chunk}; reply per row {model.reply}; parameters "
                f"{sum(p.values()) / 1e9:.3f}B (vision {p['vision'] / 1e9:.3f}, LLM {p['llm'] / 1e9:.3f}, expert "
                f"{p['expert'] / 1e9:.3f}), LLM tokens per row {model.llm_tokens}; forward "
                f"{model.fwd_flops / 1e12:.2f} TFLOP per row, training {model.train_flops / 1e12:.2f} per sample "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )

        def add(row: Row) -> None:
            if MALLOC["mmap"]:
                row.transport = (
                    f"{'gRPC' if row.transport == 'grpc' else row.transport}, glibc mmap threshold {MALLOC['mmap']} MB"
                )
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)

        for case in picked:
            model = models[case.label]
            for path in ("act", "rollout"):
                if path not in only:
                    continue
                for n in envs:
                    for tr in transports:
                        add(
                            measure_act(case, model, n, args.quick, tr)
                            if path == "act"
                            else measure_rollout(case, model, n, args.quick, rollout_cap, tr)
                        )
        if "weights" in only:
            seen = set()
            for case in picked:
                model = models[case.label]
                if case.config in seen:
                    continue
                seen.add(case.config)
                libero = next((c for c in picked if c.config == case.config and "LIBERO" in c.label), case)
                variants = [("partial", None)] if model.lora else []
                if not (args.quick and model.lora):  # --quick: LoRA models' partial set only
                    variants += [("full", None)] if args.quick else [("full", None), ("full", "bfloat16")]
                for which, dtype in variants:
                    for tr in transports:
                        add(
                            measure_weights(
                                libero, models[libero.label], which, dtype, args.quick, weights_cap, envs[0], tr
                            )
                        )
    comp_block = ""
    if "compression" in only:
        sources = ["panda"] if args.quick else args.frames_from.split(",")
        blocks = []
        for source in sources:
            e, t = (2, 12) if args.quick else (int(x) for x in args.frames.split(","))
            if source == "libero" and not args.quick:
                e = min(e, 2)  # robosuite: ~1 GB and a slow software renderer per env
            size = 64 if args.quick else 224
            t0 = time.perf_counter()
            frames = render_frames(source, e, t, size)
            print(f"[compression] {source}: rendered {frames.shape} in {time.perf_counter() - t0:.1f} s", flush=True)
            blocks.append(f"{FRAME_SOURCES[source][1]}, " + compression_table(compression_study(frames), frames.shape))
            del frames
        comp_block = "\n\n".join(blocks)
    cmd = "python -m benchmarks.wire_budget " + " ".join(argv if argv is not None else sys.argv[1:])
    end_load = os.getloadavg()
    out = [f"Measured {machine}, {end_load[0]:.2f} / {end_load[1]:.2f} at the end; command: `{cmd.strip()}`.", ""]
    if rows:
        out += [table(rows), ""]
        summary = summary_table(rows)
        if summary:
            out += ["gRPC against shared memory, from the rows above:", "", summary, ""]
    if shm_note:
        out += [f"shm: {shm_note}.", ""]
    if comp_block:
        out += [comp_block, ""]
    text = "\n".join(out)
    print()
    print(text)
    if args.markdown:
        write_markdown(pathlib.Path(args.markdown), text)
        print(f"[wire budget] written into {args.markdown}")


if __name__ == "__main__":
    main()
