from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ENV: _ClassVar[Role]
    INFERENCE: _ClassVar[Role]
    LEARNER: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ENV: Role
INFERENCE: Role
LEARNER: Role

class RegisterRequest(_message.Message):
    __slots__ = ("role", "index", "address", "pid", "incarnation", "config_yaml")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    role: Role
    index: int
    address: str
    pid: int
    incarnation: str
    config_yaml: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., incarnation: _Optional[str] = ..., config_yaml: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("role", "index", "incarnation")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    role: Role
    index: int
    incarnation: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., index: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("shutdown",)
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    shutdown: bool
    def __init__(self, shutdown: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("role", "index", "address", "pid", "alive", "restarts", "last_heartbeat_age_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    role: Role
    index: int
    address: str
    pid: int
    alive: bool
    restarts: int
    last_heartbeat_age_s: float
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ..., restarts: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("experiment_name", "run_dir", "phase", "epoch", "max_epochs", "env_steps", "elapsed_s", "last_metrics", "services", "bottleneck")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EXPERIMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    experiment_name: str
    run_dir: str
    phase: str
    epoch: int
    max_epochs: int
    env_steps: int
    elapsed_s: float
    last_metrics: _containers.ScalarMap[str, float]
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    bottleneck: str
    def __init__(self, experiment_name: _Optional[str] = ..., run_dir: _Optional[str] = ..., phase: _Optional[str] = ..., epoch: _Optional[int] = ..., max_epochs: _Optional[int] = ..., env_steps: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., bottleneck: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("stopping",)
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    stopping: bool
    def __init__(self, stopping: _Optional[bool] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    role: Role
    count: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., count: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("previous", "count", "message")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    previous: int
    count: int
    message: str
    def __init__(self, previous: _Optional[int] = ..., count: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
