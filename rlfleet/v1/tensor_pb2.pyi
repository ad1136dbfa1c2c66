from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
INT8: DType
UINT8: DType
BOOL: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared: SharedRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedRef, _Mapping]] = ...) -> None: ...

class SharedRef(_message.Message):
    __slots__ = ("pid", "fd", "offset", "length", "generation", "key")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    offset: int
    length: int
    generation: int
    key: bytes
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., generation: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("host", "probe")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    host: str
    probe: SharedRef
    def __init__(self, host: _Optional[str] = ..., probe: _Optional[_Union[SharedRef, _Mapping]] = ...) -> None: ...

class SharedMemoryAnswer(_message.Message):
    __slots__ = ("accepted", "reason", "host")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    host: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class TensorMap(_message.Message):
    __slots__ = ("tensors",)
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.MessageMap[str, Tensor]
    def __init__(self, tensors: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape", "low", "high", "low_per_element", "high_per_element")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LOW_PER_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    HIGH_PER_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    low: float
    high: float
    low_per_element: _containers.RepeatedScalarFieldContainer[float]
    high_per_element: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., low: _Optional[float] = ..., high: _Optional[float] = ..., low_per_element: _Optional[_Iterable[float]] = ..., high_per_element: _Optional[_Iterable[float]] = ...) -> None: ...

class EpisodeStats(_message.Message):
    __slots__ = ("env_id", "length", "success_once", "success_at_end", "reset_state_id", "instruction")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_ONCE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_AT_END_FIELD_NUMBER: _ClassVar[int]
    RESET_STATE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    env_id: int
    length: int
    success_once: bool
    success_at_end: bool
    reset_state_id: int
    instruction: str
    def __init__(self, env_id: _Optional[int] = ..., length: _Optional[int] = ..., success_once: _Optional[bool] = ..., success_at_end: _Optional[bool] = ..., reset_state_id: _Optional[int] = ..., instruction: _Optional[str] = ..., **kwargs) -> None: ...
