from rlfleet.v1 import env_pb2 as _env_pb2
from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class RolloutChunk(_message.Message):
    __slots__ = ("epoch", "worker_index", "worker_incarnation", "t_start", "data", "episodes", "last", "num_steps")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    T_START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    worker_index: int
    worker_incarnation: str
    t_start: int
    data: _tensor_pb2.TensorMap
    episodes: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.EpisodeStats]
    last: bool
    num_steps: int
    def __init__(self, epoch: _Optional[int] = ..., worker_index: _Optional[int] = ..., worker_incarnation: _Optional[str] = ..., t_start: _Optional[int] = ..., data: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ..., episodes: _Optional[_Iterable[_Union[_tensor_pb2.EpisodeStats, _Mapping]]] = ..., last: _Optional[bool] = ..., num_steps: _Optional[int] = ...) -> None: ...

class PushRolloutResponse(_message.Message):
    __slots__ = ("num_steps", "num_envs")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_envs: int
    def __init__(self, num_steps: _Optional[int] = ..., num_envs: _Optional[int] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("epoch", "worker_indices", "inference_addresses", "extra_metrics")
    class ExtraMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDICES_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_METRICS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    worker_indices: _containers.RepeatedScalarFieldContainer[int]
    inference_addresses: _containers.RepeatedScalarFieldContainer[str]
    extra_metrics: _containers.ScalarMap[str, float]
    def __init__(self, epoch: _Optional[int] = ..., worker_indices: _Optional[_Iterable[int]] = ..., inference_addresses: _Optional[_Iterable[str]] = ..., extra_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("epoch", "weights_version", "metrics", "checkpoint_path", "publish_error")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ERROR_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    weights_version: int
    metrics: _containers.ScalarMap[str, float]
    checkpoint_path: str
    publish_error: str
    def __init__(self, epoch: _Optional[int] = ..., weights_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., checkpoint_path: _Optional[str] = ..., publish_error: _Optional[str] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("inference_addresses", "env_spec")
    INFERENCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ENV_SPEC_FIELD_NUMBER: _ClassVar[int]
    inference_addresses: _containers.RepeatedScalarFieldContainer[str]
    env_spec: _env_pb2.EnvSpec
    def __init__(self, inference_addresses: _Optional[_Iterable[str]] = ..., env_spec: _Optional[_Union[_env_pb2.EnvSpec, _Mapping]] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("weights_version",)
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    def __init__(self, weights_version: _Optional[int] = ...) -> None: ...

class LogMetricsRequest(_message.Message):
    __slots__ = ("step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LogMetricsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("epoch", "weights_version", "env_steps", "last_checkpoint", "elapsed_time_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_TIME_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    weights_version: int
    env_steps: int
    last_checkpoint: str
    elapsed_time_s: float
    def __init__(self, epoch: _Optional[int] = ..., weights_version: _Optional[int] = ..., env_steps: _Optional[int] = ..., last_checkpoint: _Optional[str] = ..., elapsed_time_s: _Optional[float] = ...) -> None: ...
