import pytest

from rlfleet.config import ConfigError, load_config, parse_placement, parse_ranks
from tests.conftest import INFERENCE_SERVER


def test_default_loads():
    cfg = load_config()
    assert cfg.env.train.env_id == "PandaPickCube-v0"
    assert cfg.actor.model.model_type == "mlp"


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'env\.train\.totl_num_envs'; did you mean "
        r"'env\.train\.total_num_envs'\?",
    ):
        load_config(None, ["env.train.totl_num_envs=8"])
    with pytest.raises(ConfigError, match=r"'algorithm\.clip_ratio_hi'.*did you mean 'algorithm\.clip_ratio_high'"):
        load_config(None, ["algorithm.clip_ratio_hi=0.3"])


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("runner:\n  experimnt_name: x\n")
    with pytest.raises(
        ConfigError,
        match=r"c\.yaml: unknown config key 'runner\.experimnt_name'; did you mean "
        r"'runner\.experiment_name'",
    ):
        load_config(path)


def test_wrong_type_and_cross_checks():
    with pytest.raises(ConfigError, match="'algorithm.gamma' = 'high' has the wrong type"):
        load_config(None, ["algorithm.gamma=high"])
    with pytest.raises(ConfigError, match="rollout.pipeline_stage_num"):
        load_config(None, ["env.train.total_num_envs=10", "rollout.pipeline_stage_num=4", INFERENCE_SERVER])
    with pytest.raises(ConfigError, match="actor.global_batch_size"):
        load_config(None, ["actor.global_batch_size=300"])
    with pytest.raises(
        ConfigError, match="'actor.model.model_type': unknown model_type 'transformer' \\(known: mlp, cnn"
    ):
        load_config(None, ["actor.model.model_type=transformer"])
    with pytest.raises(ConfigError, match="'env.eval.simulator_type': 'metaworld' runs in the metaworld environment"):
        load_config(None, ["env.eval.simulator_type=metaworld"])


def test_free_form_maps_and_builtin_configs(tmp_path):
    cfg = load_config("pandapickcube_vision_ppo", ["env.train.init_params.image_size=32"])
    assert cfg.env.train.init_params.image_size == 32
    assert cfg.actor.model.model_type == "cnn"
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_config")
    # a list given for a mapping (or the reverse) names the key, not OmegaConf's bare TypeError
    with pytest.raises(ConfigError, match=r"'sft\.dataset_keys': a list where a mapping belongs"):
        load_config(None, ["sft.dataset_keys=[a,b]"])
    with pytest.raises(ConfigError, match=r"'env\.train\.init_params': a list where a mapping belongs"):
        load_config(None, ["env.train.init_params=[1,2]"])
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  eval:\n    init_params: [64]\n")
    with pytest.raises(ConfigError, match=r"'env\.eval\.init_params': a list where a mapping belongs"):
        load_config(path)


def test_placement():
    p = parse_placement({"env": "0-3", "rollout": "4-7", "actor": "0-7"}, 8)
    assert p == {"env": [0, 1, 2, 3], "rollout": [4, 5, 6, 7], "actor": list(range(8))}
    assert parse_placement({"env,rollout,actor": "all"}, 4)["rollout"] == [0, 1, 2, 3]
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(ConfigError, match="unknown component 'rolout'.*did you mean 'rollout'"):
        parse_placement({"rolout": "0"}, 2)
    with pytest.raises(ConfigError, match="rank 9 .* outside the cluster's 8 GPUs"):
        parse_ranks("0-9", 8)
    with pytest.raises(ConfigError, match="not a GPU range"):
        parse_ranks("a-b", 8)
    cfg = load_config(
        None, ["cluster.num_gpus_per_node=8", "cluster.component_placement={env: 0-3, rollout: 4-7, actor: 0-7}"]
    )
    assert dict(cfg.cluster.component_placement) == {"env": "0-3", "rollout": "4-7", "actor": "0-7"}


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.target_kl=abc", "'algorithm.target_kl' = 'abc' has the wrong type (expected float or null)"),
        ("algorithm.clip_ratio_c=abc", "'algorithm.clip_ratio_c' = 'abc' has the wrong type (expected float or null)"),
        ("algorithm.gamma=null", "'algorithm.gamma' = None has the wrong type (expected float"),
        ("env.train.simulator_type=mujocoo", "unknown simulator_type 'mujocoo'"),
        ("cluster.act_timeout_s=0", "'cluster.act_timeout_s': must be > 0"),
        ("rollout.batch_invariant_rows=-3", "'rollout.batch_invariant_rows': must be null or an integer in [0, 4096]"),
        ("rollout.batch_invariant_rows=abc", "'rollout.batch_invariant_rows' = 'abc' has the wrong type"),
        ("algorithm.max_staleness=9", "'algorithm.max_staleness': 9 is not in 0..8"),
        ("algorithm.decoupled_staleness=0", "'algorithm.decoupled_staleness': must be >= 1"),
        ("algorithm.importance_weight_cap=0.5", "'algorithm.importance_weight_cap': must be >= 1"),
        ("algorithm.kl_beta=-0.1", "'algorithm.kl_beta': must be >= 0"),
        ("algorithm.kl_penalty=k2", "'algorithm.kl_penalty': 'k2' is not one of kl, abs, mse, low_var_kl"),
        ("cluster.learner_num_threads=0", "'cluster.learner_num_threads': must be null or >= 1"),
        ("cluster.learner_num_threads=two", "'cluster.learner_num_threads' = 'two' has the wrong type"),
        ("actor.model.precision=fp16", "'actor.model.precision': 'fp16' is not one of fp32, bf16"),
        ("rollout.weights_precision=bf16", "'rollout.weights_precision': bf16 weights need bf16 compute"),
        ("rollout.weights_precision=int8", "'rollout.weights_precision': 'int8' is not one of fp32, bf16"),
        (
            "actor.model.openpi.noise_method=sde",
            "'actor.model.openpi.noise_method': 'sde' is not one of flow_sde, flow_noise",
        ),
        (
            "actor.model.openpi.noise_std_max=0.01",
            "'actor.model.openpi.noise_std_min': need 0 < noise_std_min <= noise_std_max",
        ),
    ],
)
def test_null_defaults_are_typed_and_new_keys_checked(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_bf16_is_refused_with_the_vllm_backend():
    with pytest.raises(ConfigError, match="'actor.model.precision': bf16 is for the hf backend"):
        load_config(None, ["actor.model.model_type=openvla", "rollout.backend=vllm", "actor.model.precision=bf16"])


def test_built_in_configs_load():
    from rlfleet.config import CONFIG_DIR

    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        assert load_config(path.stem).runner.experiment_name
    assert load_config(None, ["algorithm.target_kl=0.02", "runner.max_env_steps=null"]).algorithm.target_kl == 0.02


def test_per_server_simulators_resolve_per_env_server_and_bad_items_are_named():
    from rlfleet.config import env_server_config

    cfg = load_config("libero_metaworld_ppo_cnn")
    s0, s1 = env_server_config(cfg, 0), env_server_config(cfg, 1)
    assert s0 is cfg and (s0.env.train.simulator_type, s0.env.eval.env_id) == ("libero", "libero_spatial")
    assert (s1.env.train.simulator_type, s1.env.train.env_id, s1.env.eval.env_id) == (
        "metaworld",
        "reach-v3",
        "reach-v3",
    )
    assert dict(s1.env.eval.init_params) == {"camera": "corner", "image_size": 64}
    assert s1.env.train.max_episode_steps == 100 and s1.env.train.total_num_envs == 4  # the rest as env.train
    assert cfg.env.train.simulator_type == "libero"  # the run's config is unchanged
    bad = {
        "env.per_server=[{},{simulator_type: metaworld},{}]": "'env.per_server': 3 items for 2 env servers",
        "env.per_server=[{},{simulator: metaworld}]": "'env.per_server[1]': unknown key(s) ['simulator']",
        "env.per_server=[{},{simulator_type: mujoco}]": "'env.per_server[1].simulator_type': unknown simulator",
        "env.per_server=[{},{max_episode_steps: 0}]": "'env.per_server[1].max_episode_steps': must be an integer",
        "env.per_server=[{},{init_params: 3}]": "'env.per_server[1].init_params': must be a map",
        "env.per_server=[{},7]": "'env.per_server[1]': must be a map",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config("libero_metaworld_ppo_cnn", [override])
        assert message in str(err.value), (override, str(err.value))
    with pytest.raises(ConfigError, match="'env.per_server': external simulators"):
        load_config(None, ["cluster.external_env_addresses=[a:1]", "env.per_server=[{env_id: Pendulum-v1}]"])
