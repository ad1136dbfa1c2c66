"""Versioned weights sets on the wire: a state dict <-> a stream of ``WeightsChunk`` messages."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from rlfleet.wire import codec
from rlfleet.wire.codec import CodecError, DType
from rlfleet.policies.models.actor_critic import ObsSpec, obs_specs_from_proto
from rlfleet.wire.rpc import MAX_MESSAGE_BYTES
from rlfleet.v1 import inference_pb2, tensor_pb2

CHUNK_BYTES = 1 << 20


def _tensor_bytes(t: torch.Tensor) -> tuple[int, bytes]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return DType.BFLOAT16, t.view(torch.int16).numpy().tobytes()
    arr = t.numpy()
    return codec.dtype_of(arr), arr.tobytes()


def obs_specs_to_proto(obs_specs: dict[str, ObsSpec]) -> dict[str, tensor_pb2.TensorSpec]:
    return {k: tensor_pb2.TensorSpec(dtype=codec.dtype_of(np.zeros((), s.dtype)), shape=list(s.shape))
            for k, s in obs_specs.items()}


def iter_chunks(state: dict[str, torch.Tensor], version: int, *, obs_specs: dict[str, ObsSpec] | None = None,
                action_dim: int | None = None, partial: bool = False,
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[inference_pb2.WeightsChunk]:
    first = True
    for name, tensor in state.items():
        dtype, data = _tensor_bytes(tensor)
        for offset in range(0, max(len(data), 1), chunk_bytes):
            msg = inference_pb2.WeightsChunk(version=version, name=name, offset=offset, partial=partial)
            msg.data.dtype = dtype
            msg.data.shape[:] = list(tensor.shape)
            msg.data.data = data[offset:offset + chunk_bytes]
            if first and obs_specs is not None:
                for k, spec in obs_specs_to_proto(obs_specs).items():
                    msg.observation_space[k].CopyFrom(spec)
                msg.action_space.dtype = DType.FLOAT32
                msg.action_space.shape[:] = [int(action_dim)]
            first = False
            yield msg


def _check_coverage(name: str, spans: list[tuple[int, int]], nbytes: int) -> None:
    """The chunks of one tensor must cover [0, nbytes) exactly once."""
    pos = 0
    for start, end in sorted(spans):
        if start < pos:
            raise CodecError(f"weights['{name}']: bytes [{start}, {min(end, pos)}) were sent twice")
        if start > pos:
            raise CodecError(f"weights['{name}']: bytes [{pos}, {start}) were never sent")
        pos = end
    if pos != nbytes:
        raise CodecError(f"weights['{name}']: bytes [{pos}, {nbytes}) were never sent")


def assemble(chunks: Iterable[inference_pb2.WeightsChunk]):
    """-> (version, state_dict, obs_specs | None, action_dim | None, partial). Validates every chunk."""
    buffers: dict[str, tuple[int, list[int], bytearray]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}  # byte ranges received per tensor: coverage, not a byte count
    version = None
    partial = False
    obs_specs = action_dim = None
    for i, chunk in enumerate(chunks):
        if version is None:
            version, partial = chunk.version, chunk.partial
            if chunk.observation_space:
                obs_specs = obs_specs_from_proto(chunk.observation_space)
                if len(chunk.action_space.shape) != 1:
                    raise CodecError(f"action_space: shape {list(chunk.action_space.shape)} is not 1-D")
                action_dim = int(chunk.action_space.shape[0])
        elif chunk.version != version:
            raise CodecError(f"chunk {i}: version {chunk.version} differs from the set's version {version}")
        if not chunk.name:
            raise CodecError(f"chunk {i}: empty tensor name")
        dtype = chunk.data.dtype
        if dtype not in (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16, DType.INT64, DType.INT32,
                         DType.UINT8, DType.BOOL, DType.INT8):
            raise CodecError(f"weights['{chunk.name}']: unknown dtype {dtype}")
        shape = list(chunk.data.shape)
        nbytes = codec.check_shape(shape, f"weights['{chunk.name}']") * codec.numpy_dtype(dtype).itemsize
        if chunk.name not in buffers:
            # the bytes are kept as received and joined only once they cover the tensor: a 4-byte chunk that
            # declares a huge shape costs 4 bytes, not the declared size
            buffers[chunk.name] = (dtype, shape, nbytes, [])
            spans[chunk.name] = []
        bdtype, bshape, _, pieces = buffers[chunk.name]
        if (bdtype, bshape) != (dtype, shape):
            raise CodecError(f"weights['{chunk.name}']: chunks disagree on dtype/shape")
        end = chunk.offset + len(chunk.data.data)
        if chunk.offset < 0 or end > nbytes:
            raise CodecError(f"weights['{chunk.name}']: bytes [{chunk.offset}, {end}) outside the tensor's {nbytes}")
        pieces.append((chunk.offset, chunk.data.data))
        spans[chunk.name].append((chunk.offset, end))
    if version is None:
        raise CodecError("weights: empty stream")
    state = {}
    for name, (dtype, shape, nbytes, pieces) in buffers.items():
        _check_coverage(name, spans[name], nbytes)
        buf = bytearray(nbytes)
        for offset, data in pieces:
            buf[offset:offset + len(data)] = data
        arr = np.frombuffer(bytes(buf), dtype=codec.numpy_dtype(dtype)).reshape(shape)
        t = torch.from_numpy(arr.copy())
        state[name] = t.view(torch.bfloat16) if dtype == DType.BFLOAT16 else t
    return version, state, obs_specs, action_dim, partial


# --- what a policy for declared spaces would cost, known before anything is allocated --------------------------
MAX_OBS_ROW_BYTES = MAX_MESSAGE_BYTES  # one observation row must fit one Act request


def observation_row_bytes(obs_specs: dict[str, ObsSpec], name: str = "observation_space") -> int:
    """Bytes of one observation row of the declared spaces; refused (InvalidRequest naming ``name``) beyond what
    one Act request can carry, so that nothing is built for spaces no request could ever fill."""
    from rlfleet.wire.rpc import InvalidRequest

    total, sizes = 0, {}
    for k, s in obs_specs.items():
        sizes[k] = int(np.prod(s.shape, dtype=object)) * np.dtype(s.dtype).itemsize
        total += sizes[k]
    if total > MAX_OBS_ROW_BYTES:
        big = max(sizes, key=sizes.get)
        raise InvalidRequest(f"{name}: one observation row declares {total / 2**20:.0f} MiB ('{big}': "
                             f"{list(obs_specs[big].shape)} {obs_specs[big].dtype}, {sizes[big] / 2**20:.0f} MiB); "
                             f"at most {MAX_OBS_ROW_BYTES / 2**20:.0f} MiB, what one request can carry")
    return total


def planned_state(model_cfg, obs_specs: dict[str, ObsSpec], action_dim: int, normalize_obs: bool,
                  logprob_type: str, name: str = "observation_space",
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]] | None:
    """The state dict the configured policy would have for these spaces, built on PyTorch's meta device (shapes
    and dtypes, no storage): {name: (shape, dtype, is_parameter)}. None where it is not planned: a policy loaded
    from a checkpoint directory (``model_path``: its size is the checkpoint's, and reading it here would cost as
    much as the build), or one that cannot be built on the meta device (both are checked after their real build,
    as before). Spaces the policy cannot take: InvalidRequest naming ``name``."""
    from rlfleet.policies import build_policy
    from rlfleet.wire.rpc import InvalidRequest

    if model_cfg.get("model_path"):
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            policy = build_policy(model_cfg, obs_specs, action_dim, normalize_obs, logprob_type)
    except ValueError as exc:  # the spaces do not suit this policy (e.g. images for an MLP)
        raise InvalidRequest(f"{name}: {exc}") from None
    except Exception:  # noqa: BLE001 - e.g. a checkpoint directory that cannot load onto meta tensors
        return None
    params = {n for n, _ in policy.named_parameters()}
    return {n: (tuple(t.shape), t.dtype, n in params) for n, t in policy.state_dict().items()}


def state_bytes(planned: dict, parameter_dtype: torch.dtype | None = None) -> int:
    """Bytes of a planned state (``parameter_dtype``: the dtype parameters are held in, e.g. bf16 copies)."""
    total = 0
    for shape, dtype, is_param in planned.values():
        dt = parameter_dtype if is_param and parameter_dtype is not None and dtype.is_floating_point else dtype
        total += math.prod(shape) * torch.empty((), dtype=dt).element_size()
    return total


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process could still allocate on ``device``: a GPU's free memory (plus what PyTorch's cache holds
    unused), or the host's MemAvailable bounded by this container's cgroup limit (what it may still use, its
    reclaimable page cache counted as free). None when unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    if dev.type != "cpu":
        return None
    have = None
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have = int(line.split()[1]) * 1024
    except OSError:
        pass
    cg = pathlib.Path("/sys/fs/cgroup")
    try:
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cg / "memory.current").read_text())
            stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines() if " " in line)
            room = int(limit) - used + int(stat.get("inactive_file", 0))
            have = room if have is None else min(have, room)
    except (OSError, ValueError):
        pass
    return have


def check_fits(need: int, what: str, device: str | torch.device = "cpu", budget: int | None = None) -> None:
    """Refuse (ResourceExhausted, with the numbers) what would need more than ``budget`` bytes (None: what
    :func:`available_memory` says is left on ``device``)."""
    from rlfleet.wire.rpc import ResourceExhausted

    have = budget if budget is not None else available_memory(device)
    if have is not None and need > have:
        raise ResourceExhausted(f"{what} would need {need / 2**30:.2f} GiB; {have / 2**30:.2f} GiB are available "
                                f"on {torch.device(device)}")
