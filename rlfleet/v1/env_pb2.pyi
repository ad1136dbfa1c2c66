from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeEnvRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvSpec(_message.Message):
    __slots__ = ("env_id", "num_envs", "observation_space", "action_space", "max_episode_steps", "task_descriptions", "auto_reset", "incarnation", "contract_version", "num_reset_states", "max_action_chunk", "max_step_streams", "simulator")
    class ObservationSpaceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.TensorSpec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ...) -> None: ...
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TASK_DESCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    AUTO_RESET_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RESET_STATES_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTION_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SIMULATOR_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    num_envs: int
    observation_space: _containers.MessageMap[str, _tensor_pb2.TensorSpec]
    action_space: _tensor_pb2.TensorSpec
    max_episode_steps: int
    task_descriptions: _containers.RepeatedScalarFieldContainer[str]
    auto_reset: bool
    incarnation: str
    contract_version: str
    num_reset_states: int
    max_action_chunk: int
    max_step_streams: int
    simulator: str
    def __init__(self, env_id: _Optional[str] = ..., num_envs: _Optional[int] = ..., observation_space: _Optional[_Mapping[str, _tensor_pb2.TensorSpec]] = ..., action_space: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., max_episode_steps: _Optional[int] = ..., task_descriptions: _Optional[_Iterable[str]] = ..., auto_reset: _Optional[bool] = ..., incarnation: _Optional[str] = ..., contract_version: _Optional[str] = ..., num_reset_states: _Optional[int] = ..., max_action_chunk: _Optional[int] = ..., max_step_streams: _Optional[int] = ..., simulator: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env_ids", "seeds", "reset_state_ids")
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    RESET_STATE_IDS_FIELD_NUMBER: _ClassVar[int]
    env_ids: _containers.RepeatedScalarFieldContainer[int]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    reset_state_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, env_ids: _Optional[_Iterable[int]] = ..., seeds: _Optional[_Iterable[int]] = ..., reset_state_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observations", "instructions")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _tensor_pb2.TensorMap
    instructions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, observations: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ..., instructions: _Optional[_Iterable[str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("env_ids", "actions")
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    env_ids: _containers.RepeatedScalarFieldContainer[int]
    actions: _tensor_pb2.Tensor
    def __init__(self, env_ids: _Optional[_Iterable[int]] = ..., actions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observations", "rewards", "terminated", "truncated", "success", "final_observations", "episodes", "final_rows", "instructions")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FINAL_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    FINAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _tensor_pb2.TensorMap
    rewards: _tensor_pb2.Tensor
    terminated: _tensor_pb2.Tensor
    truncated: _tensor_pb2.Tensor
    success: _tensor_pb2.Tensor
    final_observations: _tensor_pb2.TensorMap
    episodes: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.EpisodeStats]
    final_rows: _containers.RepeatedScalarFieldContainer[int]
    instructions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, observations: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ..., rewards: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., terminated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., truncated: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., success: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., final_observations: _Optional[_Union[_tensor_pb2.TensorMap, _Mapping]] = ..., episodes: _Optional[_Iterable[_Union[_tensor_pb2.EpisodeStats, _Mapping]]] = ..., final_rows: _Optional[_Iterable[int]] = ..., instructions: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
