from rlfleet.v1 import env_pb2 as _env_pb2
from rlfleet.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CollectRequest(_message.Message):
    __slots__ = ("epoch", "num_steps", "inference_addresses", "learner_address", "min_weights_version", "policy_spec", "weights_wait_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_SPEC_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_steps: int
    inference_addresses: _containers.RepeatedScalarFieldContainer[str]
    learner_address: str
    min_weights_version: int
    policy_spec: _env_pb2.EnvSpec
    weights_wait_s: float
    def __init__(self, epoch: _Optional[int] = ..., num_steps: _Optional[int] = ..., inference_addresses: _Optional[_Iterable[str]] = ..., learner_address: _Optional[str] = ..., min_weights_version: _Optional[int] = ..., policy_spec: _Optional[_Union[_env_pb2.EnvSpec, _Mapping]] = ..., weights_wait_s: _Optional[float] = ...) -> None: ...

class CollectResponse(_message.Message):
    __slots__ = ("epoch", "env_steps", "episodes", "rollout_time_s", "env_time_s", "inference_wait_s", "weights_version", "lost_episodes", "wire_act_s", "act_bytes", "act_shm_bytes", "wire_rollout_s", "rollout_bytes", "rollout_shm_bytes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ENV_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOST_EPISODES_FIELD_NUMBER: _ClassVar[int]
    WIRE_ACT_S_FIELD_NUMBER: _ClassVar[int]
    ACT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACT_SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_ROLLOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    env_steps: int
    episodes: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.EpisodeStats]
    rollout_time_s: float
    env_time_s: float
    inference_wait_s: float
    weights_version: int
    lost_episodes: int
    wire_act_s: float
    act_bytes: int
    act_shm_bytes: int
    wire_rollout_s: float
    rollout_bytes: int
    rollout_shm_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., env_steps: _Optional[int] = ..., episodes: _Optional[_Iterable[_Union[_tensor_pb2.EpisodeStats, _Mapping]]] = ..., rollout_time_s: _Optional[float] = ..., env_time_s: _Optional[float] = ..., inference_wait_s: _Optional[float] = ..., weights_version: _Optional[int] = ..., lost_episodes: _Optional[int] = ..., wire_act_s: _Optional[float] = ..., act_bytes: _Optional[int] = ..., act_shm_bytes: _Optional[int] = ..., wire_rollout_s: _Optional[float] = ..., rollout_bytes: _Optional[int] = ..., rollout_shm_bytes: _Optional[int] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("num_episodes", "seed", "first_episode", "deterministic", "inference_addresses", "use_reset_state_ids", "video_episodes", "video_dir", "policy_spec")
    NUM_EPISODES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_EPISODE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    USE_RESET_STATE_IDS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_EPISODES_FIELD_NUMBER: _ClassVar[int]
    VIDEO_DIR_FIELD_NUMBER: _ClassVar[int]
    POLICY_SPEC_FIELD_NUMBER: _ClassVar[int]
    num_episodes: int
    seed: int
    first_episode: int
    deterministic: bool
    inference_addresses: _containers.RepeatedScalarFieldContainer[str]
    use_reset_state_ids: bool
    video_episodes: int
    video_dir: str
    policy_spec: _env_pb2.EnvSpec
    def __init__(self, num_episodes: _Optional[int] = ..., seed: _Optional[int] = ..., first_episode: _Optional[int] = ..., deterministic: _Optional[bool] = ..., inference_addresses: _Optional[_Iterable[str]] = ..., use_reset_state_ids: _Optional[bool] = ..., video_episodes: _Optional[int] = ..., video_dir: _Optional[str] = ..., policy_spec: _Optional[_Union[_env_pb2.EnvSpec, _Mapping]] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("episodes", "eval_time_s", "lost_episodes")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    EVAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOST_EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.EpisodeStats]
    eval_time_s: float
    lost_episodes: int
    def __init__(self, episodes: _Optional[_Iterable[_Union[_tensor_pb2.EpisodeStats, _Mapping]]] = ..., eval_time_s: _Optional[float] = ..., lost_episodes: _Optional[int] = ...) -> None: ...
