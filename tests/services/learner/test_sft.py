"""Supervised fine-tuning: demonstrated actions become tokens the policy's own evaluate scores, the loss falls,
and the written model is what an RL config's actor.model.model_path loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlfleet.config import ConfigError, load_config
from rlfleet.config.views import SftView, build_view
from rlfleet.data.datasets import Dataset, DatasetWriter, Episode
from rlfleet.policies import build_policy
from rlfleet.wire.spaces import TensorSpace
from services.learner.sft import SFTTrainer, chunk_samples

SPECS = {"third_person": TensorSpace((64, 64, 3), "uint8"), "state": TensorSpace((7,), "float32")}
TINY = [
    "actor.model.model_type=openvla_oft",
    "actor.model.num_action_chunks=2",
    "actor.model.add_value_head=false",
    "actor.model.image_key=third_person",
    "actor.model.vla.vision_layers=1",
    "actor.model.vla.llm_layers=1",
    "algorithm.logprob_type=token_level",
    "env.train.max_steps_per_rollout_epoch=16",
    "actor.micro_batch_size=64",
    "actor.global_batch_size=128",
]


def _dataset(root, episodes=3, T=6) -> Dataset:
    w = DatasetWriter(root, env_id="Toy-v0", simulator="gym", fps=10, source="test")
    rng = np.random.default_rng(0)
    for e in range(episodes):
        img = np.zeros((T, 64, 64, 3), np.uint8)
        img[:, :, :32] = 255 * (e % 2)  # the image tells which way to move
        act = np.tile(np.array([1.0 if e % 2 else -1.0, 0.5, -0.5, 0.0], np.float32), (T, 1))
        w.add(
            Episode(
                {"third_person": img, "state": rng.normal(size=(T, 7)).astype(np.float32)},
                act,
                np.zeros(T, np.float32),
                np.zeros(T, bool),
                f"task {e % 2}",
                e,
            )
        )
    w.close()
    return Dataset(root)


def test_action_bins_decode_to_the_nearest_bin_centre():
    cfg = load_config(None, TINY)
    p = build_policy(cfg.actor.model, SPECS, 4, True, "token_level")
    a = torch.tensor([[[-1.0, -0.3, 0.0, 0.999], [0.5, 1.0, -0.999, 0.2]]])
    back = p._decode_actions(p.action_bins(a))
    assert (back - a).abs().max() < 2.0 / 255 + 1e-6
    p.set_action_statistics({"q01": [-2.0, -2.0, -2.0, 0.0], "q99": [2.0, 2.0, 2.0, 1.0]})
    b = torch.tensor([[[-2.0, 1.0, 0.5, 0.25], [2.0, 0.0, -1.0, 1.0]]])
    assert (p._decode_actions(p.action_bins(b)) - b).abs().max() < 4.0 / 255 + 1e-6


def test_chunks_repeat_the_last_action_past_the_end(tmp_path):
    d = _dataset(tmp_path / "d", episodes=1, T=3)
    obs, actions, instr = chunk_samples(d, 2)
    assert actions.shape == (3, 2, 4) and obs["third_person"].shape == (3, 64, 64, 3) and instr == ["task 0"] * 3
    np.testing.assert_array_equal(actions[2, 0], actions[2, 1])


@pytest.mark.parametrize("proprio", [False, True], ids=["image", "image+proprio"])
def test_sft_lowers_the_loss_and_writes_a_loadable_model(tmp_path, proprio):
    torch.manual_seed(0)
    d = _dataset(tmp_path / "d")
    TINY_ = [*TINY, f"actor.model.use_proprio={str(proprio).lower()}"]
    cfg = load_config(None, [*TINY_, "sft.max_steps=80", "sft.batch_size=12", "sft.lr=1e-3"])
    trainer = SFTTrainer(build_view(SftView, cfg), d, tmp_path / "out", log=lambda s: None)
    summary = trainer.train()
    assert summary["final_loss"] < 0.5 * summary["first_loss"], summary
    path = trainer.save(summary)
    assert json.loads((path / "sft_summary.json").read_text())["steps"] == 80
    stats = json.loads((path / "dataset_statistics.json").read_text())
    assert set(stats) == {"Toy-v0"}
    # use_proprio: the state's statistics of the demonstrations go with the model (OpenVLA-OFT's "proprio")
    assert ("proprio" in stats["Toy-v0"]) == proprio
    if proprio:
        assert stats["Toy-v0"]["proprio"]["q01"] == d.observation_statistics("state")["q01"]
        with pytest.raises(KeyError, match="has no observation 'joints'"):
            d.observation_statistics("joints")
    rl_cfg = load_config(None, [*TINY_, f"actor.model.model_path={path}", "actor.model.unnorm_key=Toy-v0"])
    loaded = build_policy(rl_cfg.actor.model, SPECS, 4, True, "token_level")
    obs = {"third_person": torch.from_numpy(d.episode(1).observations["third_person"][:2]), "state": torch.zeros(2, 7)}
    want = trainer.policy.act(obs, True, ["task 1"] * 2).actions
    got = loaded.act(obs, True, ["task 1"] * 2).actions
    torch.testing.assert_close(got, want)
    assert (got[..., 0] > 0.5).all(), got  # it learned the demonstrated direction for this image


def test_pi0_flow_matching_sft_round_trips_through_model_path(tmp_path):
    torch.manual_seed(0)
    d = _dataset(tmp_path / "d", episodes=2, T=4)
    args = [
        "actor.model.model_type=openpi",
        "actor.model.num_action_chunks=2",
        "algorithm.logprob_type=chunk_level",
        "env.train.max_steps_per_rollout_epoch=16",
        "actor.micro_batch_size=64",
        "actor.global_batch_size=128",
    ]
    cfg = load_config(None, [*args, "sft.max_steps=25", "sft.batch_size=8", "sft.lr=1e-3"])
    trainer = SFTTrainer(build_view(SftView, cfg), d, tmp_path / "out", log=lambda s: None)
    summary = trainer.train()
    assert summary["final_loss"] < summary["first_loss"], summary
    path = trainer.save(summary)
    loaded = build_policy(
        load_config(None, [*args, f"actor.model.model_path={path}"]).actor.model, SPECS, 4, True, "chunk_level"
    )
    obs = {
        "third_person": torch.from_numpy(d.episode(0).observations["third_person"][:2]),
        "state": torch.from_numpy(d.episode(0).observations["state"][:2]),
    }
    torch.testing.assert_close(
        loaded.act(obs, True, ["task 0"] * 2).actions, trainer.policy.act(obs, True, ["task 0"] * 2).actions
    )


def test_random_shift_moves_each_image_by_at_most_the_shift_and_leaves_the_rest(tmp_path):
    d = _dataset(tmp_path / "d", episodes=2, T=4)
    cfg = load_config(None, [*TINY, "sft.image_shift=3"])
    trainer = SFTTrainer(build_view(SftView, cfg), d, tmp_path / "out", log=lambda s: None)
    img = np.zeros((16, 64, 64, 3), np.uint8)
    img[:, 30, 30] = 255  # one bright pixel per image, away from the edges
    state = np.arange(16 * 7, dtype=np.float32).reshape(16, 7)
    out = trainer.augment({"third_person": img, "state": state})
    assert out["third_person"].shape == img.shape and out["third_person"].dtype == np.uint8
    assert out["state"] is state  # only images are shifted
    where = [np.argwhere(out["third_person"][i, :, :, 0] == 255) for i in range(16)]
    assert all(len(w) == 1 for w in where)  # the pixel moved, it was not blurred or lost
    offsets = np.array([w[0] - [30, 30] for w in where])
    assert np.abs(offsets).max() <= 3 and len({tuple(o) for o in offsets}) > 1  # drawn per sample, within the shift
    off = SFTTrainer(build_view(SftView, load_config(None, TINY)), d, tmp_path / "out2", log=lambda s: None)
    assert off.augment({"third_person": img})["third_person"] is img  # sft.image_shift 0: untouched
    with pytest.raises(ValueError, match="sft.image_shift"):
        load_config(None, [*TINY, "sft.image_shift=-1"])


# A dataset written by lerobot itself (LeRobotDataset.create / add_frame / save_episode / finalize, in lerobot's own
# environment): the image tells which way to move, as in _dataset above.
LEROBOT_MAKES = r"""
import json, pathlib, numpy as np, torch
torch.set_num_threads(1)
from lerobot.datasets.lerobot_dataset import LeRobotDataset
def make(root, image_dtype):
    features = {
        "observation.images.front": {"dtype": image_dtype, "shape": (64, 64, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (7,), "names": [f"joint_{i}" for i in range(7)]},
        "action": {"dtype": "float32", "shape": (4,), "names": ["x", "y", "z", "gripper"]},
    }
    ds = LeRobotDataset.create("someone/toy", fps=10, features=features, root=root, use_videos=image_dtype == "video")
    rng = np.random.default_rng(0)
    for e in range(4):
        for t in range(6):
            img = np.full((64, 64, 3), 60, np.uint8)
            img[:, :32] = 200 if e % 2 else 60
            img[t, :, 2] = 255  # which frame this is, for the image-feature copy
            ds.add_frame({"observation.images.front": img, "observation.state": rng.normal(size=7).astype(np.float32),
                          "action": np.array([1.0 if e % 2 else -1.0, 0.5, -0.5, 0.0], np.float32),
                          "task": f"task {e % 2}"})
        ds.save_episode()
    ds.finalize()
    return {"frames": ds.meta.total_frames, "episodes": ds.meta.total_episodes}
print(json.dumps({"video": make(ROOT, "video"), "image": make(ROOT + "_images", "image")}))
"""


@pytest.fixture(scope="module")
def lerobot_dataset(tmp_path_factory):
    """lerobot's toy dataset with its camera as video (the path), and the same with it as PNG images (path_images)."""
    from tests.simenv import run_lerobot

    root = tmp_path_factory.mktemp("lerobot") / "toy"
    made = run_lerobot(LEROBOT_MAKES.replace("ROOT", repr(str(root))))
    assert made == {"video": {"frames": 24, "episodes": 4}, "image": {"frames": 24, "episodes": 4}}
    return root


def test_lerobots_image_features_read_exactly(lerobot_dataset):
    d = Dataset(lerobot_dataset.with_name("toy_images"))
    assert d.features["observation.images.front"]["dtype"] == "image"
    assert d.observation_features["front"] == {"dtype": "uint8", "shape": [64, 64, 3]}
    ep = d.episode(3)
    want = np.full((6, 64, 64, 3), 60, np.uint8)
    want[:, :, :32] = 200
    for t in range(6):
        want[t, t, :, 2] = 255
    np.testing.assert_array_equal(ep.observations["front"], want)  # PNG: lossless
    video = Dataset(lerobot_dataset).episode(3)
    np.testing.assert_array_equal(video.observations["state"], ep.observations["state"])
    np.testing.assert_array_equal(video.actions, ep.actions)


SFT_CLI = [
    "--config",
    "pandapickcube_vision_sft_openvla_oft_tiny",
    "actor.model.vla.vision_layers=1",
    "actor.model.vla.llm_layers=1",
    "actor.model.num_action_chunks=2",
    "sft.max_steps=60",
    "sft.batch_size=12",
    "sft.lr=1e-3",
    "cluster.learner_num_threads=1",
]
KEYS = "sft.dataset_keys={wrist: observation.images.front, state: observation.state, action: action}"


def test_a_dataset_lerobot_writes_trains_with_sft_through_the_key_map(tmp_path, lerobot_dataset, capsys):
    from services.learner.sft import main

    d = Dataset(lerobot_dataset, {"wrist": "observation.images.front", "state": "observation.state"})
    assert len(d) == 4 and d.action_dim == 4 and d.meta["env_id"] == "toy"
    assert d.observation_features == {
        "wrist": {"dtype": "uint8", "shape": [64, 64, 3]},
        "state": {"dtype": "float32", "shape": [7]},
    }
    ep = d.episode(1)
    assert ep.instruction == "task 1" and ep.length == 6 and (ep.actions[:, 0] == 1.0).all()
    assert np.abs(ep.observations["wrist"][:, :, :32].astype(int) - 200).mean() < 4  # lerobot's video, decoded
    assert np.abs(ep.observations["wrist"][:, :, 40:].astype(int) - 60).mean() < 4
    torch.manual_seed(0)
    code = main([*SFT_CLI, f"sft.dataset_path={lerobot_dataset}", f"sft.output_path={tmp_path / 'out'}", KEYS])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "sft: openvla_oft on 4 episodes (24 samples)" in out.out
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["final_loss"] < 0.5 * summary["first_loss"], summary
    stats = json.loads((tmp_path / "out" / "dataset_statistics.json").read_text())
    assert set(stats) == {"toy"}  # named after the dataset (no rlfleet env id in it)
    # a key the map names that the dataset lacks: one clear line naming it and the dataset's features
    code = main([*SFT_CLI, f"sft.dataset_path={lerobot_dataset}", "sft.dataset_keys={wrist: observation.images.top}"])
    err = capsys.readouterr().err
    assert (
        code == 1
        and "'wrist' is mapped to the feature 'observation.images.top' (sft.dataset_keys), which the "
        "dataset does not have; its features: action, episode_index, frame_index, index, observation.images.front, "
        "observation.state, task_index, timestamp"
        in err
    ), err


def _fill_dataset_cache(hf_home, dataset, repo="someone/toy-demos"):
    """The hub cache's own layout for a dataset repo: datasets--org--name/{refs/main, snapshots/<commit>/...}."""
    import shutil

    org, name = repo.split("/")
    root = hf_home / "hub" / f"datasets--{org}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(dataset, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


def test_a_hub_dataset_id_reads_from_the_offline_cache(tmp_path, monkeypatch):
    from services.learner.sft import open_dataset

    _dataset(tmp_path / "d")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no folder someone/toy-demos here: the id is looked up in the cache
    snapshot = _fill_dataset_cache(tmp_path / "hf", tmp_path / "d")
    d = open_dataset(load_config(None, [*TINY, "sft.dataset_path=someone/toy-demos"]))
    assert d.root == snapshot and len(d) == 3 and d.meta["env_id"] == "Toy-v0"
    keyed = open_dataset(
        load_config(
            None,
            [
                *TINY,
                "sft.dataset_path=someone/toy-demos",
                "sft.dataset_keys={third_person: observation.images.third_person}",
            ],
        )
    )
    assert set(keyed.observation_features) == {"third_person"}
    with pytest.raises(
        FileNotFoundError,
        match=r"sft.dataset_path: hub dataset 'someone/missing' is not in the hub "
        r"cache .*HF_HUB_OFFLINE is set.*hf download someone/missing "
        r"--repo-type dataset",
    ):
        open_dataset(load_config(None, [*TINY, "sft.dataset_path=someone/missing"]))


def test_sft_names_what_is_wrong_with_the_dataset_folder(tmp_path, capsys):
    from services.learner.sft import main

    (tmp_path / "empty").mkdir()
    assert main([*SFT_CLI, f"sft.dataset_path={tmp_path / 'empty'}"]) == 1
    assert "no meta/info.json - not a (complete) LeRobot dataset" in capsys.readouterr().err
    old = tmp_path / "old"
    (old / "meta").mkdir(parents=True)
    (old / "meta" / "episodes.jsonl").write_text("{}\n")
    (old / "meta" / "info.json").write_text(json.dumps({"format": "rlfleet-episodes", "version": 1}))
    assert main([*SFT_CLI, f"sft.dataset_path={old}"]) == 1
    assert "re-collect it with `coordinatorctl collect-demos CONFIG`" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="sft.dataset_keys"):
        load_config(None, ["sft.dataset_keys={wrist: 3}"])


def test_rlfleet_writes_the_files_and_fields_lerobot_writes(tmp_path, lerobot_dataset):
    """The same features written by rlfleet and by lerobot (the fixture): the same files, info.json keys, feature
    entries and parquet columns; rlfleet adds only its own (next.reward / next.success, rlfleet/*, "rlfleet")."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    w = DatasetWriter(tmp_path / "ours", env_id="Toy-v0", simulator="gym", fps=10, source="test")
    for e in range(4):
        w.add(
            Episode(
                {"front": np.full((6, 64, 64, 3), 60, np.uint8), "state": rng.normal(size=(6, 7)).astype(np.float32)},
                np.zeros((6, 4), np.float32),
                np.zeros(6, np.float32),
                np.zeros(6, bool),
                f"task {e % 2}",
            )
        )
    w.close()
    ours, theirs = tmp_path / "ours", lerobot_dataset
    tree = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert tree(ours) == tree(theirs)
    info = {r: json.loads((r / "meta" / "info.json").read_text()) for r in (ours, theirs)}
    assert set(info[ours]) == set(info[theirs]) | {"rlfleet"}
    for key in (
        "codebase_version",
        "chunks_size",
        "data_files_size_in_mb",
        "video_files_size_in_mb",
        "fps",
        "splits",
        "data_path",
        "video_path",
        "total_episodes",
        "total_frames",
        "total_tasks",
    ):
        assert info[ours][key] == info[theirs][key], key
    f_ours, f_theirs = info[ours]["features"], info[theirs]["features"]
    assert set(f_ours) == set(f_theirs) | {"next.reward", "next.success"}
    for name, ft in f_theirs.items():
        assert (f_ours[name]["dtype"], f_ours[name]["shape"]) == (ft["dtype"], ft["shape"]), name
    assert f_ours["observation.images.front"]["info"] == f_theirs["observation.images.front"]["info"]
    columns = lambda path: pq.read_schema(path).names  # noqa: E731
    data = "data/chunk-000/file-000.parquet"
    assert set(columns(ours / data)) == set(columns(theirs / data)) | {"next.reward", "next.success"}
    assert (
        pq.read_schema(ours / data).field("observation.state").type
        == pq.read_schema(theirs / data).field("observation.state").type
    )
    episodes = "meta/episodes/chunk-000/file-000.parquet"
    extra = {c for c in columns(ours / episodes) if c.startswith(("rlfleet/", "stats/next."))}
    assert set(columns(ours / episodes)) - extra == set(columns(theirs / episodes))
    assert set(columns(ours / "meta/tasks.parquet")) == set(columns(theirs / "meta/tasks.parquet"))
    stats = {r: json.loads((r / "meta" / "stats.json").read_text()) for r in (ours, theirs)}
    assert set(stats[ours]) == set(stats[theirs]) | {"next.reward", "next.success"}
    assert set(stats[ours]["observation.images.front"]) == set(stats[theirs]["observation.images.front"])
    assert (
        np.asarray(stats[ours]["observation.images.front"]["mean"]).shape
        == np.asarray(stats[theirs]["observation.images.front"]["mean"]).shape
        == (3, 1, 1)
    )
