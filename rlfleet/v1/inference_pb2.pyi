from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ActRequest(_message.Message):
    __slots__ = ("request_id", "observations", "deterministic", "instructions", "trace_context", "noise_keys")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NOISE_KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    observations: _tensor_pb2.TensorMap
    deterministic: bool
    instructions: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    noise_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., observations: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ..., deterministic: _Optional[bool] = ..., instructions: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., noise_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("request_id", "actions", "log_probs", "values", "weights_version", "forward_inputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORWARD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    actions: _tensor_pb2.Tensor
    log_probs: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    weights_version: int
    forward_inputs: _tensor_pb2.TensorMap
    def __init__(self, request_id: _Optional[int] = ..., actions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., log_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weights_version: _Optional[int] = ..., forward_inputs: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("version", "name", "data", "offset", "partial", "observation_space", "action_space", "tensors")
    class ObservationSpaceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.TensorSpec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ...) -> None: ...
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    data: _tensor_pb2.Tensor
    offset: int
    partial: bool
    observation_space: _containers.MessageMap[str, _tensor_pb2.TensorSpec]
    action_space: _tensor_pb2.TensorSpec
    tensors: _containers.MessageMap[str, _tensor_pb2.Tensor]
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., data: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., offset: _Optional[int] = ..., partial: _Optional[bool] = ..., observation_space: _Optional[_Mapping[str, _tensor_pb2.TensorSpec]] = ..., action_space: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., tensors: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "num_tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_tensors: int
    def __init__(self, version: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class DescribeInferenceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InferenceInfo(_message.Message):
    __slots__ = ("model_type", "weights_version", "num_parameters", "requests_served", "batches_run", "mean_batch_rows", "reads_packed_weights")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_RUN_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    READS_PACKED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    weights_version: int
    num_parameters: int
    requests_served: int
    batches_run: int
    mean_batch_rows: float
    reads_packed_weights: bool
    def __init__(self, model_type: _Optional[str] = ..., weights_version: _Optional[int] = ..., num_parameters: _Optional[int] = ..., requests_served: _Optional[int] = ..., batches_run: _Optional[int] = ..., mean_batch_rows: _Optional[float] = ..., reads_packed_weights: _Optional[bool] = ...) -> None: ...
