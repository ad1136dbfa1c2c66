"""Layer 5, the top of the shared code (may import every layer). Run configuration: OmegaConf YAML with RLinf's groups and key names, validated against the embedded default.

The embedded default (``rlfleet/configs/pandapickcube_ppo.yaml``), with each policy family's size group merged in
(``actor.model.vla``, ``actor.model.openpi``: a YAML beside the family's module, :func:`default_schema`), is the
schema: a user config or a ``key=value`` override may only set keys that exist there (free-form maps excepted), with
a value of a compatible type.
A misspelled key is an error naming it and the closest valid key.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlfleet.algorithms import ALGORITHMS
from rlfleet.data.loggers import LOGGER_MODES, logger_backend
from rlfleet.registry import UnknownName, closest, did_you_mean, unknown_message
from rlfleet.untrusted import BadFile, parse_yaml, read_yaml

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "pandapickcube_ppo.yaml"
# Maps whose keys are the user's to choose.
FREE_FORM = (
    "cluster.component_placement",
    "cluster.cpu_placement",
    "env.train.init_params",
    "env.eval.init_params",
    "sft.dataset_keys",
)
COMPONENTS = ("env", "rollout", "actor")
KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl")  # estimators of algorithm.kl_penalty (services/learner/ppo.py)
# Types of keys whose default is null (the default cannot say), and of keys that may also be null (a policy
# family's own keys: its entry's ``nullable``, rlfleet.policies.families; :func:`nullable_types` has both).
NULLABLE_TYPES = {
    "cluster.envs_dir": str,
    "runner.early_stop_success_rate": float,
    "runner.resume_dir": str,
    "algorithm.clip_ratio_c": float,
    "algorithm.huber_delta": float,
    "algorithm.target_kl": float,
    "algorithm.value_clip": float,
    "runner.max_env_steps": int,
    "runner.max_wall_time_s": float,
    "algorithm.filter_rewards": list,
    "actor.model.image_key": str,
    "actor.model.model_path": str,
    "actor.model.unnorm_key": str,
    "sft.dataset_path": str,
    "sft.output_path": str,
    "telemetry.otlp_endpoint": str,
    "cluster.tls.cert_file": str,
    "cluster.tls.key_file": str,
    "cluster.tls.ca_file": str,
    "rollout.batch_invariant_rows": int,
    "cluster.learner_num_threads": int,
    "runner.logger.wandb_mode": str,
    "runner.logger.swanlab_mode": str,
}


MAX_STALENESS = 8  # algorithm.max_staleness: epochs the envs may collect ahead of the learner


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


def _flatten(node, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            if path in FREE_FORM:
                out[path] = node[key]
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                out.update(_flatten(child, path))
            else:
                out[path] = OmegaConf.to_container(child) if isinstance(child, ListConfig) else child._value()
    return out


def _suggest(path: str, known: Iterable[str]) -> str:
    """The did-you-mean of a config key: the closest whole dotted path, else the key whose last component is
    closest (a typo in the leaf name)."""
    known = list(known)
    close = closest(path, known, cutoff=0.5)
    if close is None:
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        leaf = closest(path.rsplit(".", 1)[-1], by_leaf)
        close = by_leaf[leaf] if leaf else None
    return did_you_mean(path, (), close=close or "")


def nullable_types() -> dict[str, type]:
    """NULLABLE_TYPES and every policy family's nullable keys (``actor.model.<group>.<key>``)."""
    from rlfleet.policies.families import nullable_keys

    return {**NULLABLE_TYPES, **nullable_keys()}


def schema_sources() -> list[tuple[str, pathlib.Path]]:
    """(prefix, YAML file) of every part of the schema: the embedded default at "" and each policy family's size
    group at ``actor.model.<group>`` (its YAML beside the family's module, named by its entry in
    rlfleet.policies.families). Readers of the schema's text (its comments) read every file."""
    from rlfleet.policies.families import size_groups, sizes_path

    return [
        ("", DEFAULT_CONFIG),
        *((f"actor.model.{group}", sizes_path(family.sizes_file)) for group, family in size_groups().items()),
    ]


def default_schema() -> DictConfig:
    """The schema: the embedded default with each policy family's size group merged in (:func:`schema_sources`)."""
    schema = OmegaConf.create()
    for prefix, path in schema_sources():
        part = OmegaConf.load(path)
        if prefix:
            OmegaConf.update(schema, prefix, part, force_add=True, merge=False)
        else:
            schema = part
    return schema


def _type_ok(default, value, key: str = "", nullable: dict | None = None) -> bool:
    nullable = NULLABLE_TYPES if nullable is None else nullable
    if value is None:
        return default is None or key in nullable
    if default is None:
        want = nullable.get(key)
        if want is None:
            return True
        default = want() if want is not str else ""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return True


def _check_keys(schema: DictConfig, user: DictConfig, source: str) -> None:
    known = _flatten(schema)
    known_groups = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    nullable = nullable_types()
    for path, value in _flatten(user).items():
        if path in known:
            if not _type_ok(known[path], value, path, nullable):
                want = nullable.get(path, type(known[path]))
                raise ConfigError(
                    f"{source}: '{path}' = {value!r} has the wrong type (expected "
                    f"{want.__name__}{' or null' if path in nullable else ''}"
                    + (f", like the default {known[path]!r})" if known[path] is not None else ")")
                )
            continue
        if any(path.startswith(f + ".") for f in FREE_FORM):
            continue
        if path in known_groups:
            raise ConfigError(f"{source}: '{path}' is a config group, not a value")
        raise ConfigError(f"{source}: unknown config key '{path}'{_suggest(path, known)}")


def _parse_override(item: str) -> DictConfig:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, _, value = item.partition("=")
    key = key.strip().lstrip("+")
    if not re.fullmatch(r"[A-Za-z_][\w,]*(\.[A-Za-z_][\w,]*)*", key):
        raise ConfigError(f"override '{item}': '{key}' is not a dotted config key")
    try:
        parsed = parse_yaml(f"v: {value}", f"override '{item}'", what="value")["v"] if value.strip() else ""
    except BadFile as exc:
        raise ConfigError(str(exc)) from None
    node = OmegaConf.create()
    OmegaConf.update(node, key, parsed, force_add=True, merge=True)
    return node


def _container_clash(base, user, prefix: str = "") -> str | None:
    """The first key where ``user`` gives a list for a mapping of ``base`` or a mapping for a list (what OmegaConf's
    merge refuses with a bare TypeError), as 'key: a list where a mapping belongs'."""
    if not OmegaConf.is_dict(user) or not OmegaConf.is_dict(base):
        return None
    for key in user:
        if key not in base:
            continue
        b, u = base._get_node(key), user._get_node(key)
        name = f"{prefix}{key}"
        if OmegaConf.is_dict(b) and OmegaConf.is_list(u):
            return f"'{name}': a list where a mapping belongs (e.g. {name}={{key: value}})"
        if OmegaConf.is_list(b) and OmegaConf.is_dict(u):
            return f"'{name}': a mapping where a list belongs (e.g. {name}=[a, b])"
        found = _container_clash(b, u, f"{name}.")
        if found:
            return found
    return None


def _merge(cfg: DictConfig, user: DictConfig) -> DictConfig:
    try:
        merged = OmegaConf.merge(cfg, user)
    except (TypeError, ValueError) as exc:  # ValidationError is a ValueError
        raise ConfigError(_container_clash(cfg, user) or f"cannot merge: {exc}") from None
    for key in ("component_placement", "cpu_placement"):
        placement = OmegaConf.select(user, f"cluster.{key}")
        if placement is not None:  # a placement replaces the default one instead of adding to it
            merged.cluster[key] = placement
    return merged


def read_config_file(path: str | pathlib.Path, root: str | pathlib.Path | None = None) -> DictConfig:
    """A config file as a user or a run folder supplies it, read as untrusted (rlfleet.untrusted): bounded in size,
    plain YAML (no anchors, aliases or tags), a mapping at the top; inside ``root`` when given (a run folder's
    ``config.yaml`` that is a symbolic link out of the folder is refused). Any problem: ConfigError naming the file,
    the line and what was expected."""
    try:
        data = read_yaml(path, root=root, what="config")
    except BadFile as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level: expected a mapping of config groups, found {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{path}: key {bad[0]!r}: expected a string key")
    if root is not None:  # rlfleet writes a run folder's config resolved: an interpolation there came from elsewhere
        found = _interpolation(data)
        if found:
            raise ConfigError(
                f"{path}: '{found[0]}': expected a resolved value (a run folder's config.yaml is written "
                f"resolved), found the interpolation {found[1][:80]!r}"
            )
    try:
        return OmegaConf.create(data)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's own refusals (e.g. an interpolation that does not parse)
        raise ConfigError(f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None


def _interpolation(node, prefix: str = "") -> tuple[str, str] | None:
    """(key, value) of the first string in a plain YAML tree holding an OmegaConf interpolation, or None."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, str) and "${" in value:
            return name, value
        found = _interpolation(value, name)
        if found:
            return found
    return None


def builtin_configs() -> list[str]:
    """The names of the built-in configs (``rlfleet/configs/NAME.yaml``), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_not_found(path: str | pathlib.Path) -> str:
    """A config that is neither a file nor a built-in name: the nearest built-in name, and where the list is."""
    names = builtin_configs()
    name = pathlib.Path(path).name.removesuffix(".yaml").removesuffix(".yml")
    return (
        f"config file '{path}' not found{did_you_mean(name, names)} (neither a file nor one of the {len(names)} "
        f"built-in configs: `coordinatorctl configs` lists them)"
    )


def load_config(
    path: str | pathlib.Path | None = None, overrides: Sequence[str] = (), *, root: str | pathlib.Path | None = None
) -> DictConfig:
    """Default <- config file <- overrides; validated and resolved. Raises ConfigError naming any bad key.
    ``root``: the folder the config file must stay inside (a run folder's ``config.yaml``)."""
    schema = default_schema()
    cfg = schema.copy()
    if path is not None:
        path = pathlib.Path(path)
        if not path.exists() and (CONFIG_DIR / path).exists():
            path = CONFIG_DIR / path
        if not path.exists() and (CONFIG_DIR / f"{path}.yaml").exists():
            path = CONFIG_DIR / f"{path}.yaml"
        if not path.exists():
            raise ConfigError(config_not_found(path))
        user = read_config_file(path, root)
        _check_keys(schema, user, str(path))
        cfg = _merge(cfg, user)
    for item in overrides:
        node = _parse_override(item)
        _check_keys(schema, node, f"override '{item}'")
        cfg = _merge(cfg, node)
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:  # noqa: BLE001 - an interpolation that names nothing, a resolver that fails
        raise ConfigError(
            f"{path or 'config'}: an interpolation does not resolve: {str(exc).splitlines()[0][:200]}"
        ) from None
    resolve_auto_rollout(cfg)
    validate(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def config_from_yaml(text: str) -> DictConfig:
    """A resolved config passed between services (already validated by the coordinator)."""
    return OmegaConf.create(text)


PER_SERVER_KEYS = ("simulator_type", "env_id", "init_params", "max_episode_steps")  # env.per_server items


def env_server_config(cfg: DictConfig, index: int) -> DictConfig:
    """The config env server ``index`` runs with: its ``env.per_server`` item (if any) replaces those keys of
    env.train and env.eval. The one place a per-server simulator is resolved (env server, launcher, plan)."""
    items = cfg.env.per_server
    item = items[index] if index < len(items) else None
    if not item:
        return cfg
    out = cfg.copy()
    for split in ("train", "eval"):
        for key, value in item.items():
            out.env[split][key] = value
    return out


def _check_per_server(cfg: DictConfig) -> None:
    items, n_servers = cfg.env.per_server, cfg.cluster.num_env_servers
    _require(
        len(items) <= n_servers,
        "env.per_server",
        f"{len(items)} items for {n_servers} env servers (cluster.num_env_servers): item i is env server i",
    )
    _require(
        not items or not cfg.cluster.external_env_addresses,
        "env.per_server",
        "external simulators (cluster.external_env_addresses) are not started by rlfleet; give per-server "
        "simulators to built-in env servers only",
    )
    for i, item in enumerate(items):
        if item is None:
            continue
        _require(
            isinstance(item, DictConfig),
            f"env.per_server[{i}]",
            f"must be a map of {', '.join(PER_SERVER_KEYS)}, got {item!r}",
        )
        unknown = sorted(set(item) - set(PER_SERVER_KEYS))
        _require(not unknown, f"env.per_server[{i}]", f"unknown key(s) {unknown} (known: {', '.join(PER_SERVER_KEYS)})")
        for key in ("simulator_type", "env_id"):
            _require(key not in item or isinstance(item[key], str), f"env.per_server[{i}].{key}", "must be a string")
        _require(
            "init_params" not in item or isinstance(item.init_params, DictConfig),
            f"env.per_server[{i}].init_params",
            "must be a map",
        )
        steps = item.get("max_episode_steps", 1)
        _require(
            isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
            f"env.per_server[{i}].max_episode_steps",
            f"must be an integer >= 1, got {steps!r}",
        )


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"'{key}': {message}")


def validate(cfg: DictConfig) -> None:
    """Cross-key checks that the schema's types cannot express, section by section (the first failure is raised
    as a ConfigError naming its key)."""
    _check_cluster(cfg)
    _check_rollout(cfg)
    _check_batches(cfg)
    _check_algorithm(cfg)
    _check_simulators(cfg)
    _check_model(cfg)
    _check_runtime(cfg)


def _check_cluster(cfg: DictConfig) -> None:
    """The cluster's counts."""
    n_servers = cfg.cluster.num_env_servers
    stages = cfg.rollout.pipeline_stage_num
    _require(n_servers >= 1, "cluster.num_env_servers", f"must be >= 1, got {n_servers}")
    ext = list(cfg.cluster.external_env_addresses)
    _require(
        not ext or len(ext) == n_servers,
        "cluster.external_env_addresses",
        f"{len(ext)} addresses for {n_servers} env servers (cluster.num_env_servers): give one per server",
    )
    _require(cfg.cluster.num_inference_servers >= 1, "cluster.num_inference_servers", "must be >= 1")
    _require(stages >= 1, "rollout.pipeline_stage_num", f"must be >= 1, got {stages}")
    lt = cfg.cluster.learner_num_threads
    _require(lt is None or lt >= 1, "cluster.learner_num_threads", f"must be null or >= 1, got {lt}")


def _check_rollout(cfg: DictConfig) -> None:
    """The inference backend and precisions."""
    from rlfleet.policies.backends import check_backend, get_backend

    try:
        get_backend(cfg.rollout.backend)
    except KeyError as exc:
        raise ConfigError(f"'rollout.backend': {exc}") from None
    from rlfleet.policies import POLICIES

    if cfg.actor.model.model_type in POLICIES:  # (an unknown model type is reported by its own check)
        why = check_backend(cfg.rollout.backend, cfg.actor.model.model_type)
        _require(why is None, "rollout.backend", why or "")
    _require(
        cfg.actor.model.precision in ("fp32", "bf16"),
        "actor.model.precision",
        f"'{cfg.actor.model.precision}' is not one of fp32, bf16",
    )
    _require(
        not (cfg.actor.model.precision == "bf16" and cfg.rollout.backend == "vllm"),
        "actor.model.precision",
        "bf16 is for the hf backend: the vllm backend's engine runs its own dtype (float32 on CPU); "
        "use rollout.backend=hf with bf16",
    )
    _require(
        cfg.rollout.weights_precision in ("fp32", "bf16"),
        "rollout.weights_precision",
        f"'{cfg.rollout.weights_precision}' is not one of fp32, bf16",
    )
    _require(
        cfg.rollout.weights_precision == "fp32" or cfg.actor.model.precision == "bf16",
        "rollout.weights_precision",
        "bf16 weights need bf16 compute: set actor.model.precision=bf16",
    )
    pi = cfg.actor.model.openpi
    _require(
        pi.noise_method in ("flow_sde", "flow_noise"),
        "actor.model.openpi.noise_method",
        f"'{pi.noise_method}' is not one of flow_sde, flow_noise",
    )
    _require(
        0 < pi.noise_std_min <= pi.noise_std_max,
        "actor.model.openpi.noise_std_min",
        f"need 0 < noise_std_min <= noise_std_max, got {pi.noise_std_min}, {pi.noise_std_max}",
    )
    inv = cfg.rollout.batch_invariant_rows
    _require(
        inv is None or 0 <= inv <= 4096,
        "rollout.batch_invariant_rows",
        f"must be null or an integer in [0, 4096], got {inv}",
    )


def _check_batches(cfg: DictConfig) -> None:
    """Env counts, episodes, supervised fine-tuning and the batch arithmetic."""
    n_servers = cfg.cluster.num_env_servers
    stages = cfg.rollout.pipeline_stage_num
    for split in ("train", "eval"):
        n = cfg.env[split].total_num_envs
        _require(
            n >= 1 and n % n_servers == 0,
            f"env.{split}.total_num_envs",
            f"{n} must be a positive multiple of cluster.num_env_servers ({n_servers})",
        )
        _require(cfg.env[split].max_episode_steps >= 1, f"env.{split}.max_episode_steps", "must be >= 1")
    per_server = cfg.env.train.total_num_envs // n_servers
    _require(
        per_server % stages == 0,
        "rollout.pipeline_stage_num",
        f"each env server's {per_server} envs must split evenly into {stages} stages",
    )
    _require(cfg.env.train.max_steps_per_rollout_epoch >= 1, "env.train.max_steps_per_rollout_epoch", "must be >= 1")
    _require(cfg.env.eval.num_episodes >= 1, "env.eval.num_episodes", "must be >= 1")
    _require(cfg.env.eval.video_episodes >= 0, "env.eval.video_episodes", "must be >= 0")
    for key in ("num_demos", "max_steps", "batch_size"):
        _require(cfg.sft[key] >= 1, f"sft.{key}", f"must be >= 1, got {cfg.sft[key]}")
    _require(cfg.sft.lr > 0, "sft.lr", f"must be > 0, got {cfg.sft.lr}")
    _require(cfg.sft.image_shift >= 0, "sft.image_shift", f"must be >= 0 pixels, got {cfg.sft.image_shift}")
    _require(cfg.sft.demo_fps >= 1, "sft.demo_fps", f"must be >= 1, got {cfg.sft.demo_fps}")
    keys = cfg.sft.dataset_keys
    _require(
        isinstance(keys, DictConfig) and all(isinstance(v, str) and v for v in keys.values()),
        "sft.dataset_keys",
        f"must map policy input names to dataset feature names (strings), got {keys}",
    )
    chunk = cfg.actor.model.num_action_chunks
    _require(
        cfg.env.train.max_steps_per_rollout_epoch % max(chunk, 1) == 0,
        "env.train.max_steps_per_rollout_epoch",
        f"{cfg.env.train.max_steps_per_rollout_epoch} env steps must be a multiple of "
        f"actor.model.num_action_chunks ({chunk}): one sample is one action chunk",
    )
    batch = cfg.env.train.total_num_envs * (cfg.env.train.max_steps_per_rollout_epoch // max(chunk, 1))
    _require(
        cfg.actor.global_batch_size % cfg.actor.micro_batch_size == 0,
        "actor.global_batch_size",
        f"{cfg.actor.global_batch_size} must be a multiple of actor.micro_batch_size ({cfg.actor.micro_batch_size})",
    )
    on_policy = cfg.algorithm.name not in ALGORITHMS or ALGORITHMS[cfg.algorithm.name].on_policy
    _require(
        not on_policy or batch % cfg.actor.global_batch_size == 0,  # off-policy: a batch is drawn from the buffer
        "actor.global_batch_size",
        f"the rollout batch (env.train.total_num_envs x max_steps_per_rollout_epoch / num_action_chunks = "
        f"{batch} samples) must be a "
        f"multiple of actor.global_batch_size ({cfg.actor.global_batch_size})",
    )


def _check_algorithm(cfg: DictConfig) -> None:
    """The algorithm group."""
    per_server = cfg.env.train.total_num_envs // cfg.cluster.num_env_servers
    alg = cfg.algorithm
    _require(alg.name in ALGORITHMS, "algorithm.name", unknown_message("algorithm", alg.name, ALGORITHMS))
    _require(
        alg.name != "grpo" or alg.adv_type == "grpo",
        "algorithm.adv_type",
        f"'{alg.adv_type}' with algorithm.name grpo: grpo scores with group-relative advantages (adv_type: grpo)",
    )
    if alg.name in ("sac", "rlpd"):
        _require(
            cfg.actor.model.model_type == "sac",
            "actor.model.model_type",
            f"'{cfg.actor.model.model_type}' with algorithm.name {alg.name}: {alg.name} trains the sac policy family "
            f"(a squashed-Gaussian actor, twin critics, a temperature; actor.model.model_type: sac)",
        )
        _require(alg.replay_capacity >= 1, "algorithm.replay_capacity", f"must be >= 1, got {alg.replay_capacity}")
        _require(alg.utd_ratio > 0, "algorithm.utd_ratio", f"must be > 0, got {alg.utd_ratio}")
        _require(alg.learning_starts >= 0, "algorithm.learning_starts", f"must be >= 0, got {alg.learning_starts}")
        _require(0 < alg.tau <= 1, "algorithm.tau", f"must be in (0, 1], got {alg.tau}")
        _require(alg.actor_update_interval >= 1, "algorithm.actor_update_interval", "must be >= 1")
        _require(0 < alg.demo_ratio < 1, "algorithm.demo_ratio", f"must be in (0, 1), got {alg.demo_ratio}")
        _require(cfg.actor.model.init_alpha > 0, "actor.model.init_alpha", "must be > 0")
    elif cfg.actor.model.model_type == "sac":
        _require(
            False,
            "algorithm.name",
            f"'{alg.name}' with actor.model.model_type sac: the sac family trains with algorithm.name sac or rlpd",
        )
    _require(alg.adv_type in ("gae", "grpo"), "algorithm.adv_type", f"'{alg.adv_type}' is not one of gae, grpo")
    _require(
        alg.loss_type in ("actor_critic", "actor"),
        "algorithm.loss_type",
        f"'{alg.loss_type}' is not one of actor_critic, actor",
    )
    _require(
        (alg.adv_type == "grpo") == (alg.loss_type == "actor"),
        "algorithm.loss_type",
        f"'{alg.loss_type}' does not go with adv_type '{alg.adv_type}' (gae: actor_critic, grpo: actor)",
    )
    if alg.adv_type == "grpo":
        _require(alg.group_size >= 2, "algorithm.group_size", f"grpo needs groups of >= 2 envs, got {alg.group_size}")
        _require(
            per_server % alg.group_size == 0,
            "algorithm.group_size",
            f"each env server's {per_server} envs must split into groups of {alg.group_size}",
        )
        _require(
            not cfg.env.train.auto_reset,
            "env.train.auto_reset",
            "grpo scores whole episodes that start together: set env.train.auto_reset=false",
        )
        _require(
            cfg.env.train.max_steps_per_rollout_epoch >= cfg.env.train.max_episode_steps,
            "env.train.max_steps_per_rollout_epoch",
            f"grpo needs whole episodes per epoch: >= env.train.max_episode_steps ({cfg.env.train.max_episode_steps})",
        )
    fr = alg.filter_rewards
    _require(
        fr is None or (len(fr) == 2 and fr[0] <= fr[1]),
        "algorithm.filter_rewards",
        f"must be [low, high] or null, got {fr}",
    )
    _require(0 < alg.gamma <= 1, "algorithm.gamma", f"must be in (0, 1], got {alg.gamma}")
    _require(0 <= alg.gae_lambda <= 1, "algorithm.gae_lambda", f"must be in [0, 1], got {alg.gae_lambda}")
    _require(alg.clip_ratio_c is None or alg.clip_ratio_c > 1, "algorithm.clip_ratio_c", "must be > 1 or null")
    _require(alg.update_epoch >= 1, "algorithm.update_epoch", "must be >= 1")
    _require(alg.critic_warmup_epochs >= 0, "algorithm.critic_warmup_epochs", "must be >= 0")
    _require(
        alg.critic_warmup_epochs == 0 or alg.loss_type == "actor_critic",
        "algorithm.critic_warmup_epochs",
        f"needs a critic: loss_type '{alg.loss_type}' trains none (gae/actor_critic does)",
    )


def _check_simulators(cfg: DictConfig) -> None:
    """Each env server's simulators (train and eval share its environment), timeouts."""
    n_servers = cfg.cluster.num_env_servers
    ext = list(cfg.cluster.external_env_addresses)
    from rlfleet.simulators import get_simulator

    _check_per_server(cfg)
    for index in range(n_servers):
        server = env_server_config(cfg, index)
        where = f"env.per_server[{index}]" if server is not cfg else "env.{split}"
        for split in ("train", "eval"):
            try:
                get_simulator(server.env[split].simulator_type)
            except KeyError as exc:
                raise ConfigError(f"'{where.format(split=split)}.simulator_type': {exc.args[0]}") from None
        train_sim, eval_sim = (get_simulator(server.env[s].simulator_type) for s in ("train", "eval"))
        _require(
            ext or train_sim.environment == eval_sim.environment,
            "env.eval.simulator_type",
            f"'{eval_sim.name}' runs in the "
            f"{eval_sim.environment.name if eval_sim.environment else 'main'} environment but the evaluation "
            f"envs live in the training env servers, which run in the "
            f"{train_sim.environment.name if train_sim.environment else 'main'} environment "
            f"('{train_sim.name}'); evaluate on the same simulator, or serve it standalone and use "
            f"cluster.external_eval_env_addresses",
        )
    ext_eval = list(cfg.cluster.external_eval_env_addresses)
    _require(
        not ext_eval or (ext and len(ext_eval) == n_servers),
        "cluster.external_eval_env_addresses",
        f"{len(ext_eval)} addresses: give one per env server, alongside cluster.external_env_addresses",
    )
    for key in ("act_timeout_s", "rpc_timeout_s", "collect_timeout_s", "external_env_reconnect_timeout_s"):
        _require(cfg.cluster[key] > 0, f"cluster.{key}", f"must be > 0, got {cfg.cluster[key]}")


def _check_model(cfg: DictConfig) -> None:
    """The policy model and optimizer."""
    alg = cfg.algorithm
    from rlfleet.policies import LOGPROB_TYPES

    _require(
        alg.logprob_type in LOGPROB_TYPES,
        "algorithm.logprob_type",
        f"'{alg.logprob_type}' is not one of {', '.join(LOGPROB_TYPES)}",
    )
    from rlfleet.policies.families import FAMILIES, OPTION_KEYS

    model = cfg.actor.model
    _require(
        model.model_type in FAMILIES,
        "actor.model.model_type",
        unknown_message("model_type", model.model_type, FAMILIES),
    )
    _require(
        model.num_action_chunks >= 1, "actor.model.num_action_chunks", f"must be >= 1, got {model.num_action_chunks}"
    )
    family = FAMILIES[model.model_type]
    for key, (unused, what) in OPTION_KEYS.items():  # an optional key only the families taking it may set
        if key not in family.options and model.get(key) not in (unused, None):
            takers = [f.model_type for f in FAMILIES.values() if key in f.options]
            _require(
                False,
                f"actor.model.{key}",
                f"{what} is for model_type {' and '.join(takers) or 'none'}; model_type is '{model.model_type}'",
            )
    _require(
        cfg.actor.model.activation in ("tanh", "relu", "elu"),
        "actor.model.activation",
        f"'{cfg.actor.model.activation}' is not one of tanh, relu, elu",
    )
    _require(
        cfg.actor.optim.lr_schedule in ("constant", "linear"),
        "actor.optim.lr_schedule",
        f"'{cfg.actor.optim.lr_schedule}' is not one of constant, linear",
    )


def _check_runtime(cfg: DictConfig) -> None:
    """Launcher, TLS, staleness, KL, telemetry, loggers and placement."""
    alg = cfg.algorithm
    _require(
        cfg.cluster.launcher in ("local", "attach"),
        "cluster.launcher",
        f"'{cfg.cluster.launcher}' is not one of local, attach",
    )
    # ("off", as a string set by code or quoted in YAML, is read as inline; unquoted, YAML makes it false)
    _require(
        cfg.cluster.shared_memory in ("auto", "inline", "off"),
        "cluster.shared_memory",
        f"'{cfg.cluster.shared_memory}' is not one of auto, inline",
    )
    tls = cfg.cluster.tls
    if tls.cert_file or tls.key_file or tls.client_auth:
        _require(
            bool(tls.cert_file and tls.key_file and tls.ca_file),
            "cluster.tls",
            "TLS needs cert_file, key_file and ca_file together",
        )
        for key in ("cert_file", "key_file", "ca_file"):
            _require(pathlib.Path(tls[key]).is_file(), f"cluster.tls.{key}", f"'{tls[key]}' is not a readable file")
    _require(
        0 <= alg.max_staleness <= MAX_STALENESS,
        "algorithm.max_staleness",
        f"{alg.max_staleness} is not in 0..{MAX_STALENESS} (0: synchronous; N: the envs collect up to N "
        f"epochs ahead of the learner)",
    )
    _require(
        alg.decoupled_staleness >= 1,
        "algorithm.decoupled_staleness",
        f"must be >= 1 (samples of the current weights need no correction), got {alg.decoupled_staleness}",
    )
    _require(
        alg.importance_weight_cap >= 1.0,
        "algorithm.importance_weight_cap",
        f"must be >= 1 (an importance weight of 1 is an on-policy sample), got {alg.importance_weight_cap}",
    )
    rate = cfg.runner.early_stop_success_rate
    _require(
        rate is None or 0.0 <= rate <= 1.0,
        "runner.early_stop_success_rate",
        f"must be null (train the full budget) or a success rate in [0, 1], got {rate}",
    )
    _require(
        cfg.runner.early_stop_evals >= 1,
        "runner.early_stop_evals",
        f"must be >= 1 (evaluations in a row at runner.early_stop_success_rate), got {cfg.runner.early_stop_evals}",
    )
    _require(alg.kl_beta >= 0.0, "algorithm.kl_beta", f"must be >= 0 (0 = no KL penalty), got {alg.kl_beta}")
    _require(
        alg.kl_penalty in KL_PENALTIES,
        "algorithm.kl_penalty",
        f"'{alg.kl_penalty}' is not one of {', '.join(KL_PENALTIES)}",
    )
    _require(
        cfg.telemetry.traces in ("file", "otlp", "none"),
        "telemetry.traces",
        f"'{cfg.telemetry.traces}' is not one of file, otlp, none",
    )
    _require(
        cfg.telemetry.metrics_interval_s > 0,
        "telemetry.metrics_interval_s",
        f"must be > 0, got {cfg.telemetry.metrics_interval_s}",
    )
    lg = cfg.runner.logger
    for backend in lg.logger_backends:  # installed or not: the coordinator's preflight_loggers says
        try:
            logger_backend(backend)
        except UnknownName as exc:
            raise ConfigError(f"'runner.logger.logger_backends': {exc}") from None
    for key, modes in LOGGER_MODES.items():
        _require(
            lg[key] is None or lg[key] in modes,
            f"runner.logger.{key}",
            f"'{lg[key]}' is not one of {', '.join(modes)} (or null)",
        )
    parse_placement(cfg.cluster.component_placement, cfg.cluster.num_nodes * cfg.cluster.num_gpus_per_node)
    parse_placement(resolve_cpu_placement(cfg), 1 << 16, "cluster.cpu_placement", "CPU core")  # syntax; cores at launch
    _check_collocated(cfg)
    _check_learner_ranks(cfg)


ROLLOUT_IN_ENV = "env"  # cluster.component_placement.rollout: env -> the policy acts in each env server's process
ROLLOUT_AUTO = "auto"  # cluster.component_placement.rollout: auto -> env where the policy may act there, else GPUs


def _rollout_spec(placement) -> str | None:
    """The placement's value for the rollout component (None: not placed)."""
    items = placement.items() if hasattr(placement, "items") else []
    for names, spec in items:
        if "rollout" in [n.strip() for n in str(names).split(",")]:
            return str(spec).strip()
    return None


def rollout_in_env(cfg) -> bool:
    """Collocated acting (issue 37): ``cluster.component_placement`` places the rollout component in the env
    servers (``rollout: env``): each env server acts with the policy in its own process, the learner publishes
    the weights to the env servers, and no inference server runs."""
    return _rollout_spec(cfg.cluster.component_placement) == ROLLOUT_IN_ENV


def collocation_refusal(cfg) -> tuple[str, str] | None:
    """Why this run's policy cannot act in its env servers' processes -> (the key, the reason), or None when it
    can: a policy whose family does not act collocated (a VLA: one copy per env server, no batching across
    them), another inference backend than the policy's own ``act`` (hf), a simulator that runs in its own Python
    environment (no policy code there). Pipeline stages are the caller's concern (``rollout: env`` refuses them,
    ``rollout: auto`` turns them into env servers)."""
    from rlfleet.policies.families import FAMILIES

    family = FAMILIES.get(cfg.actor.model.model_type)
    if family is None or not family.collocated:
        ok = [name for name, f in FAMILIES.items() if f.collocated]
        return (
            "actor.model.model_type",
            f"it is for small policies ({', '.join(ok)}); a policy of model_type {cfg.actor.model.model_type} "
            f"acts on inference servers",
        )
    if cfg.rollout.backend != "hf":
        return (
            "rollout.backend",
            f"it acts with the policy's own act (rollout.backend: hf), not '{cfg.rollout.backend}'",
        )
    if not cfg.cluster.external_env_addresses:  # a bridge to an external simulator runs in the main environment
        from rlfleet.simulators import get_simulator

        try:
            sims = {env_server_config(cfg, i).env.train.simulator_type for i in range(cfg.cluster.num_env_servers)}
            own = sorted(s for s in sims if get_simulator(s).environment is not None)
        except Exception:  # noqa: BLE001 - an unknown simulator or a bad per_server entry: validate() names it
            return "env.train.simulator_type", "the run's simulators are not all known"
        if own:
            return (
                "env.train.simulator_type",
                f"the {', '.join(own)} env servers run in their simulator's own Python environment, which carries "
                f"no policy code (torch)",
            )
    return None


CPU_AUTO = "auto"  # cluster.cpu_placement.env: auto -> every core split over the env servers where that measured faster


def resolve_cpu_placement(cfg) -> dict[str, str]:
    """``cluster.cpu_placement`` with ``env: auto`` (the default) resolved: ``all`` (each env server pinned to its
    slice of the cores the run may use: one core each for two env servers on two cores) for a synchronous run
    whose env servers act with the policy themselves (``rollout: env``); not placed (any core) otherwise. Measured
    on 2 cores (docs/benchmarks.md, CPU placement): pinned, a synchronous collocated run's env servers keep their
    caches between acting and stepping (10% more env steps/s over six paired runs); an asynchronous run lost 4%
    (its learner then shares one env server's core instead of moving between them)."""
    out: dict[str, str] = {}
    for names, spec in cfg.cluster.cpu_placement.items():
        if str(spec).strip() != CPU_AUTO:
            out[str(names)] = spec
            continue
        if [n.strip() for n in str(names).split(",")] != ["env"]:
            raise ConfigError(
                f"'cluster.cpu_placement.{names}': '{CPU_AUTO}' places only the env component (env: auto: each env "
                f"server on its slice of the cores in a synchronous run with collocated acting, else any core)"
            )
        if int(cfg.algorithm.max_staleness) == 0 and rollout_in_env(cfg):
            out[str(names)] = "all"
    return out


def resolve_auto_rollout(cfg) -> None:
    """``cluster.component_placement.rollout: auto`` (the default) -> ``env`` (collocated acting) for a run
    without GPUs whose policy may act in its env servers (:func:`collocation_refusal`) and that places its env
    servers itself (no external simulators, no per-server simulators): there the pipeline's
    ``rollout.pipeline_stage_num`` env groups become env servers of their own (``cluster.num_env_servers`` at
    least the stage count, one stage each, where that count splits the train and eval envs evenly), so the groups
    step in parallel processes instead of overlapping with an inference server. Otherwise -> ``all`` (inference servers on every GPU, as ``env,rollout,actor: all``).
    The run's ``config.yaml`` holds the result."""
    cl = cfg.cluster
    placement = cl.component_placement
    if _rollout_spec(placement) != ROLLOUT_AUTO:
        return
    servers = max(int(cl.num_env_servers), int(cfg.rollout.pipeline_stage_num))
    collocate = (
        cl.num_gpus_per_node == 0
        and not cl.external_env_addresses
        and not cfg.env.per_server
        and all(
            int(n) > 0 and int(n) % servers == 0 for n in (cfg.env.train.total_num_envs, cfg.env.eval.total_num_envs)
        )
        and collocation_refusal(cfg) is None
    )
    resolved = {}
    for names, spec in placement.items():
        parts = [n.strip() for n in str(names).split(",")]
        if "rollout" in parts and str(spec).strip() == ROLLOUT_AUTO:
            rest = [n for n in parts if n != "rollout"]
            if rest:
                resolved[",".join(rest)] = "all" if collocate else spec
            resolved["rollout"] = ROLLOUT_IN_ENV if collocate else "all"
        else:
            resolved[names] = spec
    if not collocate:
        resolved = {k: ("all" if str(v).strip() == ROLLOUT_AUTO else v) for k, v in resolved.items()}
    cl.component_placement = resolved
    if collocate:
        cl.num_env_servers = servers
        cfg.rollout.pipeline_stage_num = 1


def _check_collocated(cfg) -> None:
    """What collocated acting (``rollout: env``) cannot do: :func:`collocation_refusal`, and pipeline stages (in
    one process the env waits for the policy either way: there is nothing to overlap)."""
    if not rollout_in_env(cfg):
        return
    key = "cluster.component_placement.rollout"
    refusal = collocation_refusal(cfg)
    if refusal is not None:
        _require(
            False,
            key,
            f"'{ROLLOUT_IN_ENV}' (acting in each env server's process): {refusal[1]} ({refusal[0]}); drop rollout: "
            f"{ROLLOUT_IN_ENV} (e.g. \"cluster.component_placement={{'env,rollout,actor': all}}\", or rollout: "
            f"{ROLLOUT_AUTO}, which picks it where it can)",
        )
    _require(
        cfg.rollout.pipeline_stage_num == 1,
        key,
        f"'{ROLLOUT_IN_ENV}' with rollout.pipeline_stage_num={cfg.rollout.pipeline_stage_num}: in one process the "
        f"envs wait for the policy either way, so pipeline stages overlap nothing; set rollout.pipeline_stage_num=1 "
        f"(rollout: {ROLLOUT_AUTO} turns the stages into env servers)",
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_learner_ranks(cfg) -> None:
    cl = cfg.cluster
    ws = cl.learner_world_size
    _require(_is_int(ws) and ws >= 1, "cluster.learner_world_size", f"must be an integer >= 1, got {ws!r}")
    gpus = learner_gpus(cfg)
    _require(
        not gpus or ws in (1, len(gpus)),
        "cluster.learner_world_size",
        f"{ws} ranks, but the actor is placed on {len(gpus)} GPU(s) ({_actor_key(cl.component_placement)}"
        f" = '{_actor_spec(cl.component_placement)}'): with GPUs the placement decides (one rank per GPU); "
        f"leave it at 1 or set {len(gpus)}",
    )
    learner_layout(cfg)  # the actor's GPUs fill the same count on every node they span
    _require(
        cl.learner_collective_timeout_s > 0,
        "cluster.learner_collective_timeout_s",
        f"must be > 0, got {cl.learner_collective_timeout_s}",
    )
    port = cl.learner_master_port
    _require(
        _is_int(port) and 1 <= port <= 65535,
        "cluster.learner_master_port",
        f"must be a port number in 1..65535, got {port!r}",
    )
    bucket = cfg.actor.weights_bucket_mb
    _require(bucket > 0, "actor.weights_bucket_mb", f"must be > 0, got {bucket}")


def _actor_key(placement) -> str:
    for names in placement.keys() if hasattr(placement, "keys") else []:
        if "actor" in (n.strip() for n in str(names).split(",")):
            return f"cluster.component_placement.{names}"
    return "cluster.component_placement"


def _actor_spec(placement) -> str:
    key = _actor_key(placement).removeprefix("cluster.component_placement").lstrip(".")
    return str(placement[key]) if key else ""


def learner_gpus(cfg) -> list[int]:
    """The global GPU ranks of the learner (the actor component's range of cluster.component_placement);
    [] when it has none (cluster.num_gpus_per_node 0, or no actor range): it then runs on CPU."""
    cl = cfg.cluster
    return parse_placement(cl.component_placement, cl.num_nodes * cl.num_gpus_per_node)["actor"]


def learner_layout(cfg) -> tuple[int, int]:
    """(nnodes, nproc_per_node) of the learner's rank group (torch.distributed; world size = their product).

    With GPUs, one rank per GPU of the actor's range (``actor: 0-7`` -> (1, 8); on 2 nodes of 8 GPUs,
    ``actor: 0-15`` -> (2, 8)); the range must hold the same number of GPUs on every node it touches. Without
    (cluster.num_gpus_per_node 0, or no actor range): ``cluster.learner_world_size`` ranks on one node (gloo on
    CPU). (1, 1) is a single learner process, as before rank groups. Pure: used by validation, the process plan,
    every launcher and the learner itself."""
    cl = cfg.cluster
    gpus = learner_gpus(cfg)
    if not gpus:
        return 1, int(cl.learner_world_size)
    per_node: dict[int, int] = {}
    for rank in gpus:
        per_node[rank // cl.num_gpus_per_node] = per_node.get(rank // cl.num_gpus_per_node, 0) + 1
    counts = sorted(set(per_node.values()))
    _require(
        len(counts) == 1,
        _actor_key(cl.component_placement),
        f"the learner runs one rank per GPU of the actor's range '{_actor_spec(cl.component_placement)}', "
        f"which must hold the same number of GPUs on each node it spans (cluster.num_gpus_per_node = "
        f"{cl.num_gpus_per_node}); it holds " + ", ".join(f"{n} on node {node}" for node, n in per_node.items()),
    )
    return len(per_node), counts[0]


def parse_ranks(spec, world: int, key: str = "cluster.component_placement", unit: str = "GPU") -> list[int]:
    """'0-3' / '0,2-3' / 'all' / 5 -> sorted ranks within [0, world) (global GPU ranks, or CPU core ids)."""
    if spec is None:  # YAML's flow style reads {env,rollout: 0-1} as {env: null, rollout: 0-1}
        raise ConfigError(
            f"'{key}': no {unit} range given (in a {{...}} override, quote a key that names several "
            f"components: {{'env,rollout': 0-1}})"
        )
    text = str(spec).strip()
    if text == "all":
        return list(range(world))
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            also = (
                f" (or, for the rollout alone, '{ROLLOUT_IN_ENV}' or '{ROLLOUT_AUTO}')"
                if unit == "GPU" and key.rsplit(".", 1)[-1] == "rollout"
                else f" (or, for env alone, '{CPU_AUTO}')"
                if unit == "CPU core" and key.rsplit(".", 1)[-1] == "env"
                else ""
            )
            raise ConfigError(f"'{key}': '{spec}' is not a {unit} range like '0-3', '0,2-3' or 'all'{also}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ConfigError(f"'{key}': range '{part}' ends before it starts")
        if hi >= world:
            where = (
                "the cluster's {n} GPUs (cluster.num_nodes x cluster.num_gpus_per_node)"
                if unit == "GPU"
                else "this machine's {n} {unit}s"
            ).format(n=world, unit=unit)
            raise ConfigError(f"'{key}': {'rank' if unit == 'GPU' else unit} {hi} in '{spec}' is outside {where}")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


def parse_placement(
    placement, world: int, key: str = "cluster.component_placement", unit: str = "GPU"
) -> dict[str, list[int]]:
    """{'env,rollout': '0-3', 'actor': 'all'} -> {'env': [0..3], 'rollout': [0..3], 'actor': [...]}."""
    out: dict[str, list[int]] = {}
    items = placement.items() if hasattr(placement, "items") else []
    in_env = False
    for names, spec in items:
        if str(spec).strip() == ROLLOUT_AUTO and unit == "GPU":  # unresolved (resolve_auto_rollout): the GPU answer
            spec = "all"
        if str(spec).strip() == ROLLOUT_IN_ENV and unit == "GPU":  # rollout: env (collocated acting)
            if [n.strip() for n in str(names).split(",")] != ["rollout"]:
                raise ConfigError(
                    f"'{key}.{names}': '{ROLLOUT_IN_ENV}' places only the rollout component (rollout: env: the "
                    f"policy acts in each env server's process, on the env's GPUs)"
                )
            if "rollout" in out:
                raise ConfigError(f"'{key}': component 'rollout' is placed twice")
            in_env = True
            out["rollout"] = []
            continue
        ranks = parse_ranks(spec, world, f"{key}.{names}", unit)
        for name in str(names).split(","):
            name = name.strip()
            if name not in COMPONENTS:
                raise ConfigError(
                    f"'{key}.{names}': unknown component '{name}' "
                    f"(components: {', '.join(COMPONENTS)}){_suggest(name, COMPONENTS)}"
                )
            if name in out:
                raise ConfigError(f"'{key}': component '{name}' is placed twice")
            out[name] = ranks
    for name in COMPONENTS:
        out.setdefault(name, [])
    if in_env:
        out["rollout"] = list(out["env"])
    return out


def cuda_visible_devices(ranks: list[int], gpus_per_node: int) -> str:
    """Local device ids for a process placed on these global ranks (single node)."""
    return ",".join(str(r % gpus_per_node) for r in ranks) if gpus_per_node else ""


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def load_service_config(args):
    """The run config a service was started with (``args.config``; defaults merged and validated, like the
    coordinator's); a bad one exits naming the key."""
    try:
        return load_config(args.config)
    except ConfigError as exc:
        raise SystemExit(f"config error: {exc}") from None


def load_cli_config(parser, argv=None):
    """Parse a command line whose parser has ``--config`` and ``overrides`` -> (args, config); a bad config prints
    ``config error: ...`` and exits with code 2."""
    import sys

    args = parser.parse_args(argv)
    try:
        return args, load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
