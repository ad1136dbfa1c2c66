"""Versioned weights sets on the wire: a state dict <-> a stream of ``WeightsChunk`` messages."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from rlfleet.v1 import inference_pb2, tensor_pb2
from rlfleet.wire import codec, shm
from rlfleet.wire.codec import CodecError, DType
from rlfleet.wire.spaces import TensorSpace, spaces_from_proto

CHUNK_BYTES = 1 << 20


def _tensor_array(t: torch.Tensor) -> tuple[int, np.ndarray]:
    """A tensor's DType and its values as a C-contiguous numpy array (bfloat16: the raw 16-bit words)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return DType.BFLOAT16, t.view(torch.int16).numpy().view(np.uint16)
    arr = t.numpy()
    return codec.dtype_of(arr), arr


def obs_specs_to_proto(obs_specs: dict[str, TensorSpace]) -> dict[str, tensor_pb2.TensorSpec]:
    return {
        k: tensor_pb2.TensorSpec(dtype=codec.dtype_of(np.zeros((), s.dtype)), shape=list(s.shape))
        for k, s in obs_specs.items()
    }


def iter_chunks(
    state: dict[str, torch.Tensor],
    version: int,
    *,
    obs_specs: dict[str, TensorSpace] | None = None,
    action_dim: int | None = None,
    partial: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    arena=None,
    abandon=None,
    packed: bool = False,
) -> Iterator[inference_pb2.WeightsChunk]:
    """The chunks of weights set ``state``. ``arena`` (an ``rlfleet.wire.shm.Arena``, toward a server that accepted
    shared memory): the tensors of at least ``arena.min_bytes`` go into one shared-memory segment together, one
    chunk of a handle each (``abandon()`` true: stop waiting for the segment's previous bucket to be taken).
    ``packed`` (toward a server that reads ``WeightsChunk.tensors``): the inline tensors of at most ``chunk_bytes``
    travel several to a message, up to ``chunk_bytes`` of them per message; larger ones are cut as without it.
    A small policy's whole set is then one message instead of one per tensor (a stream's message costs the
    receiver about as much as 100 KB of bytes: docs/benchmarks.md)."""
    arrays = {name: _tensor_array(tensor) for name, tensor in state.items()}
    refs = {}
    if arena is not None:
        big = [name for name, (_, a) in arrays.items() if a.nbytes >= arena.min_bytes]
        if big:
            refs = dict(zip(big, arena.pack([arrays[n][1] for n in big], abandon=abandon)[1]))
    first = True

    def message(**fields) -> inference_pb2.WeightsChunk:
        nonlocal first
        msg = inference_pb2.WeightsChunk(version=version, partial=partial, **fields)
        if first and obs_specs is not None:
            for k, spec in obs_specs_to_proto(obs_specs).items():
                msg.observation_space[k].CopyFrom(spec)
            msg.action_space.dtype = DType.FLOAT32
            msg.action_space.shape[:] = [int(action_dim)]
        first = False
        return msg

    pack, pack_bytes = {}, 0  # whole small tensors waiting for their message (packed)
    for name, tensor in state.items():
        dtype, arr = arrays[name]
        if packed and name not in refs and arr.nbytes <= chunk_bytes:
            if pack and pack_bytes + arr.nbytes > chunk_bytes:
                yield message(tensors=pack)
                pack, pack_bytes = {}, 0
            pack[name] = tensor_pb2.Tensor(dtype=dtype, shape=list(tensor.shape), data=arr.tobytes())
            pack_bytes += arr.nbytes
            continue
        data = b"" if name in refs else arr.tobytes()
        for offset in range(0, max(len(data), 1), chunk_bytes):
            msg = message(name=name, offset=offset)
            msg.data.dtype = dtype
            msg.data.shape[:] = list(tensor.shape)
            if name in refs:
                msg.data.shared.CopyFrom(refs[name])
            else:
                msg.data.data = data[offset : offset + chunk_bytes]
            yield msg
    if pack:
        yield message(tensors=pack)


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


def receive(
    chunks: Iterator[inference_pb2.WeightsChunk], holder, shared_memory: bool
) -> inference_pb2.UpdateWeightsResponse:
    """One UpdateWeights stream into ``holder`` (the inference engine, or an env server's in-process policy: anything
    with ``check_version`` and ``set_weights``): a made-up or stale version is refused before the set's tensors are
    read; with ``shared_memory`` tensors may come by handle from a sender on this host (the reader is closed however
    the stream ends)."""
    first = next(chunks, None)
    if first is not None:
        holder.check_version(first.version)
        chunks = itertools.chain([first], chunks)
    reader = shm.Reader() if shared_memory else None
    try:
        version, state, obs_specs, action_dim, partial = assemble(chunks, shm=reader)
    finally:
        if reader is not None:
            reader.close()
    holder.set_weights(version, state, obs_specs=obs_specs, action_dim=action_dim, partial=partial)
    return inference_pb2.UpdateWeightsResponse(version=version, num_tensors=len(state))


_DTYPES = (
    DType.FLOAT32,
    DType.FLOAT64,
    DType.FLOAT16,
    DType.BFLOAT16,
    DType.INT64,
    DType.INT32,
    DType.UINT8,
    DType.BOOL,
    DType.INT8,
)


def assemble(chunks: Iterable[inference_pb2.WeightsChunk], shm=None):
    """-> (version, state_dict, obs_specs | None, action_dim | None, partial). Validates every chunk. ``shm``: an
    ``rlfleet.wire.shm.Reader`` where the set may come by shared-memory handle (a whole tensor per chunk). A chunk
    carries a slice of one tensor (``name``, ``data``, ``offset``) and/or whole tensors (``tensors``, packed)."""
    buffers: dict[str, tuple[int, list[int], bytearray]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}  # byte ranges received per tensor: coverage, not a byte count

    def add(name: str, tensor, offset: int) -> None:
        """Bytes [offset, ...) of tensor ``name`` (described by ``tensor``'s dtype and shape)."""
        dtype = tensor.dtype
        if dtype not in _DTYPES:
            raise CodecError(f"weights['{name}']: unknown dtype {dtype}")
        shape = list(tensor.shape)
        nbytes = codec.check_shape(shape, f"weights['{name}']") * codec.numpy_dtype(dtype).itemsize
        if name not in buffers:
            # the bytes are kept as received and joined only once they cover the tensor: a 4-byte chunk that
            # declares a huge shape costs 4 bytes, not the declared size
            buffers[name] = (dtype, shape, nbytes, [])
            spans[name] = []
        bdtype, bshape, _, pieces = buffers[name]
        if (bdtype, bshape) != (dtype, shape):
            raise CodecError(f"weights['{name}']: chunks disagree on dtype/shape")
        if tensor.HasField("shared"):  # the whole tensor, copied out of the sender's segment
            if offset != 0:
                raise CodecError(
                    f"weights['{name}']: a shared-memory chunk at offset {offset}; it holds the whole tensor (offset 0)"
                )
            data = codec.decode(tensor, f"weights['{name}']", shm=shm).reshape(-1).view(np.uint8)
        else:
            data = tensor.data
        end = offset + len(data)
        if offset < 0 or end > nbytes:
            raise CodecError(f"weights['{name}']: bytes [{offset}, {end}) outside the tensor's {nbytes}")
        pieces.append((offset, data))
        spans[name].append((offset, end))

    version = None
    partial = False
    obs_specs = action_dim = None
    for i, chunk in enumerate(chunks):
        if version is None:
            version, partial = chunk.version, chunk.partial
            if chunk.observation_space:
                obs_specs = spaces_from_proto(chunk.observation_space)
                if len(chunk.action_space.shape) != 1:
                    raise CodecError(f"action_space: shape {list(chunk.action_space.shape)} is not 1-D")
                action_dim = int(chunk.action_space.shape[0])
        elif chunk.version != version:
            raise CodecError(f"chunk {i}: version {chunk.version} differs from the set's version {version}")
        if chunk.name:
            add(chunk.name, chunk.data, chunk.offset)
        elif not chunk.tensors:
            raise CodecError(f"chunk {i}: empty tensor name")
        elif chunk.HasField("data") or chunk.offset:
            raise CodecError(f"chunk {i}: data or offset {chunk.offset} without a tensor name")
        for name, tensor in chunk.tensors.items():
            if not name:
                raise CodecError(f"chunk {i}: a packed tensor with an empty name")
            add(name, tensor, 0)
    if version is None:
        raise CodecError("weights: empty stream")
    state = {}
    for name, (dtype, shape, nbytes, pieces) in buffers.items():
        _check_coverage(name, spans[name], nbytes)
        if len(pieces) == 1 and isinstance(pieces[0][1], np.ndarray):  # from shared memory: already a private copy
            buf = pieces[0][1]
        else:
            buf = bytearray(nbytes)
            for offset, data in pieces:
                buf[offset : offset + len(data)] = data
        arr = np.frombuffer(buf, dtype=codec.numpy_dtype(dtype)).reshape(shape)
        t = torch.from_numpy(arr)
        state[name] = t.view(torch.bfloat16) if dtype == DType.BFLOAT16 else t
    return version, state, obs_specs, action_dim, partial
