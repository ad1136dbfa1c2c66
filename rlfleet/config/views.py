"""Typed views of the run config: one frozen dataclass per service slice, built and checked once at start-up.

The user's interface stays the one YAML (RLinf's group and key names, ``key=value`` overrides, did-you-mean on a
wrong key: ``rlfleet.config.load_config``). A service's ``server.py`` loads it, builds its view with
:func:`build_view` and hands the view to its core, which then reads typed attributes named as the code names things
(the inference view's ``max_batch_size`` is ``rollout.max_batch_size``; the env view's ``pipeline_stage_num`` is
``rollout.pipeline_stage_num``, an env-side key in RLinf's ``rollout`` group).

Each field records the config key it is read from (``metadata["key"]``) and that key's comment in the schema
(``metadata["doc"]``, ``rlfleet.config.schema``). A value of the wrong type is refused while the view is built, with
a :class:`ConfigError` naming the key. A policy family's own config (``actor.model``) is passed through as the
read-only sub-tree the policy registry reads (``model``): its keys belong to the family.
"""

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlfleet.config import ConfigError
from rlfleet.config.schema import comment

V = TypeVar("V")
_MISSING = object()


class _FieldMeta(Mapping):
    """A view field's metadata: ``key``, the config key it is read from, and ``doc``, the schema's comment on that
    key, read from the YAML when first asked for (a service that never asks does not parse the schema's text)."""

    def __init__(self, key: str, doc: str = ""):
        self._items = {"key": key, "doc": doc}

    def __getitem__(self, name: str):
        if name == "doc":
            return comment(self._items["key"]) or self._items["doc"]
        return self._items[name]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _key(path: str, doc: str = "") -> Any:
    """A view field read from config key ``path``; its doc is the schema's comment on that key (``doc`` for a group
    the schema does not comment)."""
    return dataclasses.field(metadata=_FieldMeta(path, doc))


_MODEL_DOC = "the policy family's own config (actor.model: model_type and that family's keys), read-only"


# --- the learner -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LearnerAlgorithm:
    """The ``algorithm.*`` keys the learner trains with (advantages, losses, staleness corrections)."""

    name: str = _key("algorithm.name")

    adv_type: str = _key("algorithm.adv_type")
    loss_type: str = _key("algorithm.loss_type")
    group_size: int = _key("algorithm.group_size")
    filter_rewards: tuple[float, ...] | None = _key("algorithm.filter_rewards")
    reward_coef: float = _key("algorithm.reward_coef")
    logprob_type: str = _key("algorithm.logprob_type")
    normalize_advantages: bool = _key("algorithm.normalize_advantages")
    gamma: float = _key("algorithm.gamma")
    gae_lambda: float = _key("algorithm.gae_lambda")
    clip_ratio_low: float = _key("algorithm.clip_ratio_low")
    clip_ratio_high: float = _key("algorithm.clip_ratio_high")
    clip_ratio_c: float | None = _key("algorithm.clip_ratio_c")
    value_clip: float | None = _key("algorithm.value_clip")
    huber_delta: float | None = _key("algorithm.huber_delta")
    value_loss_coef: float = _key("algorithm.value_loss_coef")
    entropy_bonus: float = _key("algorithm.entropy_bonus")
    critic_warmup_epochs: int = _key("algorithm.critic_warmup_epochs")
    update_epoch: int = _key("algorithm.update_epoch")
    max_staleness: int = _key("algorithm.max_staleness")
    decoupled_staleness: int = _key("algorithm.decoupled_staleness")
    importance_weight_cap: float = _key("algorithm.importance_weight_cap")
    max_grad_norm: float = _key("algorithm.max_grad_norm")
    target_kl: float | None = _key("algorithm.target_kl")
    kl_beta: float = _key("algorithm.kl_beta")
    kl_penalty: str = _key("algorithm.kl_penalty")
    normalize_obs: bool = _key("algorithm.normalize_obs")
    normalize_rewards: bool = _key("algorithm.normalize_rewards")
    bootstrap_truncated: bool = _key("algorithm.bootstrap_truncated")
    replay_capacity: int = _key("algorithm.replay_capacity")
    utd_ratio: float = _key("algorithm.utd_ratio")
    learning_starts: int = _key("algorithm.learning_starts")
    tau: float = _key("algorithm.tau")
    actor_update_interval: int = _key("algorithm.actor_update_interval")
    demo_ratio: float = _key("algorithm.demo_ratio")


@dataclasses.dataclass(frozen=True)
class LearnerView:
    """What the learner core (``services/learner``) needs: RLinf's ``actor`` group, the algorithm, and the run's
    seed, budget, logging and cluster keys it reads."""

    algorithm: LearnerAlgorithm
    model: DictConfig = _key("actor.model", _MODEL_DOC)
    lr: float = _key("actor.optim.lr")
    adam_eps: float = _key("actor.optim.adam_eps")
    lr_schedule: str = _key("actor.optim.lr_schedule")
    micro_batch_size: int = _key("actor.micro_batch_size")
    global_batch_size: int = _key("actor.global_batch_size")
    weights_bucket_mb: float = _key("actor.weights_bucket_mb")
    seed: int = _key("runner.seed")
    max_epochs: int = _key("runner.max_epochs")
    save_interval: int = _key("runner.save_interval")
    resume_dir: str | None = _key("runner.resume_dir")
    only_eval: bool = _key("runner.only_eval")
    experiment_name: str = _key("runner.experiment_name")
    log_path: str = _key("runner.logger.log_path")
    dataset_path: str | None = _key("sft.dataset_path")
    dataset_keys: Mapping[str, Any] = _key("sft.dataset_keys")
    logger_backends: tuple[str, ...] = _key("runner.logger.logger_backends")
    project_name: str = _key("runner.logger.project_name")
    wandb_mode: str | None = _key("runner.logger.wandb_mode")
    swanlab_mode: str | None = _key("runner.logger.swanlab_mode")
    num_env_servers: int = _key("cluster.num_env_servers")
    rpc_timeout_s: float = _key("cluster.rpc_timeout_s")
    shared_memory: str = _key("cluster.shared_memory")
    torch_num_threads: int = _key("cluster.torch_num_threads")
    learner_num_threads: int | None = _key("cluster.learner_num_threads")
    learner_critic_process: bool = _key("cluster.learner_critic_process")
    auto_reset: bool = _key("env.train.auto_reset")
    batch_invariant_rows: int | None = _key("rollout.batch_invariant_rows")
    learner_collective_timeout_s: float = _key("cluster.learner_collective_timeout_s")
    heartbeat_interval_s: float = _key("cluster.heartbeat_interval_s")
    heartbeat_timeout_s: float = _key("cluster.heartbeat_timeout_s")


@dataclasses.dataclass(frozen=True)
class SftView:
    """What supervised fine-tuning (``services/learner/sft.py``, ``coordinatorctl sft``) needs: the ``sft`` group,
    the policy it builds and the keys of the update it shares with the learner."""

    model: DictConfig = _key("actor.model", _MODEL_DOC)
    normalize_obs: bool = _key("algorithm.normalize_obs")
    logprob_type: str = _key("algorithm.logprob_type")
    max_grad_norm: float = _key("algorithm.max_grad_norm")
    adam_eps: float = _key("actor.optim.adam_eps")
    seed: int = _key("runner.seed")
    experiment_name: str = _key("runner.experiment_name")
    log_path: str = _key("runner.logger.log_path")
    learner_num_threads: int | None = _key("cluster.learner_num_threads")
    dataset_path: str | None = _key("sft.dataset_path")
    dataset_keys: Mapping[str, Any] = _key("sft.dataset_keys")
    lr: float = _key("sft.lr")
    max_steps: int = _key("sft.max_steps")
    batch_size: int = _key("sft.batch_size")
    image_shift: int = _key("sft.image_shift")
    output_path: str | None = _key("sft.output_path")


# --- the inference servers (RLinf's ``rollout`` component) --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InferenceView:
    """What an inference server's engine needs: the ``rollout.*`` inference keys and the policy it serves."""

    model: DictConfig = _key("actor.model", _MODEL_DOC)
    normalize_obs: bool = _key("algorithm.normalize_obs")
    logprob_type: str = _key("algorithm.logprob_type")
    backend: str = _key("rollout.backend")
    max_batch_size: int = _key("rollout.max_batch_size")
    max_wait_ms: float = _key("rollout.max_wait_ms")
    max_act_streams: int = _key("rollout.max_act_streams")
    max_rows_per_request: int = _key("rollout.max_rows_per_request")
    weights_precision: str = _key("rollout.weights_precision")
    batch_invariant_rows: int | None = _key("rollout.batch_invariant_rows")
    seed: int = _key("runner.seed")
    shared_memory: str = _key("cluster.shared_memory")
    heartbeat_interval_s: float = _key("cluster.heartbeat_interval_s")
    heartbeat_timeout_s: float = _key("cluster.heartbeat_timeout_s")


# --- the env side: env server, vec env, rollout worker ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EnvSplit:
    """One split of ``env`` (``train`` or ``eval``) as an env server builds its simulators."""

    simulator_type: str
    env_id: str
    total_num_envs: int
    max_episode_steps: int
    use_fixed_reset_state_ids: bool
    seed: int
    init_params: Mapping[str, Any]


def _split_field(split: str) -> Any:
    return _key(f"env.{split}", f"env.{split}: one split of the env group")


@dataclasses.dataclass(frozen=True)
class EnvView:
    """What an env server, its vec env and its rollout worker need: RLinf's ``env`` group, the env-side key of its
    ``rollout`` group, and the timeouts of the calls the env side makes."""

    train: EnvSplit = _split_field("train")
    eval: EnvSplit = _split_field("eval")
    max_steps_per_rollout_epoch: int = _key("env.train.max_steps_per_rollout_epoch")
    auto_reset: bool = _key("env.train.auto_reset")
    ignore_terminations: bool = _key("env.train.ignore_terminations")
    deterministic_eval: bool = _key("env.eval.deterministic")
    pipeline_stage_num: int = _key("rollout.pipeline_stage_num")
    num_action_chunks: int = _key("actor.model.num_action_chunks")
    group_size: int = _key("algorithm.group_size")
    seed: int = _key("runner.seed")
    num_env_servers: int = _key("cluster.num_env_servers")
    external_eval_env_addresses: tuple[str, ...] = _key("cluster.external_eval_env_addresses")
    external_env_reconnect_timeout_s: float = _key("cluster.external_env_reconnect_timeout_s")
    act_timeout_s: float = _key("cluster.act_timeout_s")
    shared_memory: str = _key("cluster.shared_memory")
    heartbeat_interval_s: float = _key("cluster.heartbeat_interval_s")
    heartbeat_timeout_s: float = _key("cluster.heartbeat_timeout_s")


# --- the coordinator ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CoordinatorEval:
    """``env.eval`` as the coordinator asks the env servers for an evaluation."""

    num_episodes: int
    total_num_envs: int
    seed: int
    deterministic: bool
    use_fixed_reset_state_ids: bool
    video_episodes: int


@dataclasses.dataclass(frozen=True)
class CoordinatorView:
    """What the coordinator's core reads: the budget (``runner``), the rollout's shape, evaluation, and the
    cluster's timeouts. (It also holds the whole resolved run config, but only to hand it on: it writes it to the
    run folder for the services it starts, and compares a registering service's config with it.)"""

    eval: CoordinatorEval = _split_field("eval")
    experiment_name: str = _key("runner.experiment_name")
    log_path: str = _key("runner.logger.log_path")
    logger_backends: tuple[str, ...] = _key("runner.logger.logger_backends")
    resume_dir: str | None = _key("runner.resume_dir")
    max_epochs: int = _key("runner.max_epochs")
    max_env_steps: int | None = _key("runner.max_env_steps")
    max_wall_time_s: float | None = _key("runner.max_wall_time_s")
    early_stop_success_rate: float | None = _key("runner.early_stop_success_rate")
    early_stop_evals: int = _key("runner.early_stop_evals")
    val_check_interval: int = _key("runner.val_check_interval")
    eval_before_train: bool = _key("runner.eval_before_train")
    save_interval: int = _key("runner.save_interval")
    progress_interval: int = _key("runner.progress_interval")
    simulator_type: str = _key("env.train.simulator_type")
    env_id: str = _key("env.train.env_id")
    total_num_envs: int = _key("env.train.total_num_envs")
    max_steps_per_rollout_epoch: int = _key("env.train.max_steps_per_rollout_epoch")
    num_action_chunks: int = _key("actor.model.num_action_chunks")
    pipeline_stage_num: int = _key("rollout.pipeline_stage_num")
    algorithm_name: str = _key("algorithm.name")
    max_staleness: int = _key("algorithm.max_staleness")
    launcher: str = _key("cluster.launcher")
    num_env_servers: int = _key("cluster.num_env_servers")
    num_inference_servers: int = _key("cluster.num_inference_servers")
    external_env_addresses: tuple[str, ...] = _key("cluster.external_env_addresses")
    external_eval_env_addresses: tuple[str, ...] = _key("cluster.external_eval_env_addresses")
    max_restarts: int = _key("cluster.max_restarts")
    rpc_timeout_s: float = _key("cluster.rpc_timeout_s")
    collect_timeout_s: float = _key("cluster.collect_timeout_s")
    startup_timeout_s: float = _key("cluster.startup_timeout_s")
    heartbeat_interval_s: float = _key("cluster.heartbeat_interval_s")
    heartbeat_timeout_s: float = _key("cluster.heartbeat_timeout_s")


VIEWS = (LearnerView, SftView, InferenceView, EnvView, CoordinatorView)


# --- building -----------------------------------------------------------------------------------------------------
def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if hint in (Mapping, DictConfig) or typing.get_origin(hint) is Mapping:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _convert(key: str, hint, value):
    """``value`` of config key ``key`` as the field's type ``hint`` (a list becomes a tuple, an int a float where a
    float is wanted); ConfigError naming the key when it is not of that type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if value is None or len(inner) != 1:
            return _refuse(key, hint, value)
        try:
            return _convert(key, inner[0], value)
        except ConfigError:
            return _refuse(key, hint, value)
    if hint is bool:
        return value if isinstance(value, bool) else _refuse(key, hint, value)
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _refuse(key, hint, value)
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _refuse(key, hint, value)
    if hint is str:
        return value if isinstance(value, str) else _refuse(key, hint, value)
    if origin is tuple:
        if not isinstance(value, (list, tuple, ListConfig)):
            return _refuse(key, hint, value)
        return tuple(_convert(f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
    if hint is DictConfig:
        if not isinstance(value, DictConfig):
            return _refuse(key, hint, value)
        out = value.copy()
        OmegaConf.set_readonly(out, True)
        return out
    if hint is Mapping or origin is Mapping:
        if isinstance(value, DictConfig):
            return types.MappingProxyType(OmegaConf.to_container(value, resolve=True))
        return types.MappingProxyType(dict(value)) if isinstance(value, Mapping) else _refuse(key, hint, value)
    raise TypeError(f"view field of config key '{key}': unsupported type {hint!r}")


def _refuse(key: str, hint, value):
    shown = (
        "null"
        if value is None
        else repr(value if not isinstance(value, (DictConfig, ListConfig)) else OmegaConf.to_container(value))
    )
    raise ConfigError(f"'{key}' = {shown[:80]} has the wrong type (expected {_type_name(hint)})")


def _select(cfg, key: str):
    value = OmegaConf.select(cfg, key, default=_MISSING)
    if value is _MISSING:
        raise ConfigError(f"'{key}': missing from the config")
    return value


def _build(cls: type[V], cfg, prefix: str = "") -> V:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f.metadata.get("key") or (f"{prefix}.{f.name}" if prefix else "")
        if dataclasses.is_dataclass(hint):  # a group of the view (its fields name their own keys, or sit under key)
            values[f.name] = _build(hint, cfg, f.metadata.get("key", ""))
        else:
            values[f.name] = _convert(key, hint, _select(cfg, key))
    return cls(**values)


def build_view(cls: type[V], cfg) -> V:
    """The view ``cls`` of a loaded run config (``load_config``, ``config_from_yaml``), every field checked against
    its type; a wrong one raises ConfigError naming its key."""
    if not dataclasses.is_dataclass(cls) or cls not in VIEWS:
        raise TypeError(f"{cls!r} is not one of the config views ({', '.join(v.__name__ for v in VIEWS)})")
    return _build(cls, cfg)


def learner_view(cfg) -> LearnerView:
    return build_view(LearnerView, cfg)


def inference_view(cfg) -> InferenceView:
    return build_view(InferenceView, cfg)


def env_view(cfg) -> EnvView:
    """The env view of one env server: pass ``env_server_config(cfg, index)`` for a run with ``env.per_server``."""
    return build_view(EnvView, cfg)


def coordinator_view(cfg) -> CoordinatorView:
    return build_view(CoordinatorView, cfg)


def field_docs(cls, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(field, type, config key, doc) of every field of a view, its groups' fields named ``group.field``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = f.metadata.get("key") or (f"{prefix}.{f.name}" if prefix else "")
        if dataclasses.is_dataclass(hint):
            out += [(f"{f.name}.{name}", kind, k, doc) for name, kind, k, doc in field_docs(hint, key)]
        else:
            out.append((f.name, _type_name(hint), key, f.metadata.get("doc") or comment(key)))
    return out


def service_view(cls: type[V], cfg) -> V:
    """A service's view at start-up (its ``server.py``): a config that does not give it exits the process with
    ``config error: ...`` naming the key, as a config that does not load does (``load_service_config``)."""
    try:
        return build_view(cls, cfg)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None


def as_view(cls: type[V], config_or_view) -> V:
    """``config_or_view`` if it is already a ``cls``, else ``cls`` built from that run config (build_view): for the
    services' build functions, which their ``main`` calls with the view and tests and benchmarks with a config."""
    return config_or_view if isinstance(config_or_view, cls) else build_view(cls, config_or_view)
