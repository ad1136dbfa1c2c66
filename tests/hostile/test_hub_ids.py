"""Hub ids that lie: a revision that is no git ref (``../../../etc``, ``main/../..``, ``a..b``) is refused by name
before the hub cache is read; a cache whose ``refs/<branch>`` file or snapshot folder points out of the cache is
refused; a real hub cache (snapshot files linked to ``blobs/``, as huggingface_hub writes it) still loads, at any
valid revision (a branch, a tag, ``refs/pr/N``, a commit), and a snapshot file linked out of the repo folder is
refused."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.policies.hub import check_revision, parse_hub_id, resolve_model_path
from rlfleet.untrusted import BadFile, OutsideRoot
from rlfleet.wire.spaces import TensorSpace

SPECS = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
TINY = [
    "actor.model.model_type=openvla_oft",
    "actor.model.vla.image_size=32",
    "actor.model.num_action_chunks=2",
    "actor.model.vla.vision_layers=1",
    "actor.model.vla.llm_layers=1",
    "env.train.max_steps_per_rollout_epoch=32",
    "actor.global_batch_size=256",
    "actor.micro_batch_size=256",
]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"


def _cfg(*overrides):
    return load_config(None, [*TINY, *overrides])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny OpenVLA-OFT saved in rlfleet's layout (save_pretrained, what model_path loads)."""
    torch.manual_seed(0)
    policy = build_policy(_cfg().actor.model, SPECS, 4, True, "token_level")
    path = tmp_path_factory.mktemp("saved") / "model"
    policy.save_pretrained(path)
    return path, policy.state_dict()


def hub_cache(hf_home, saved, repo="tiny-org/tiny-oft", commit=COMMIT, refs=("main",)):
    """The hub cache as huggingface_hub writes it: models--org--name/blobs/<sha256> holding the files,
    snapshots/<commit>/<file> a relative symbolic link to its blob, refs/<revision> naming the commit."""
    org, name = repo.split("/")
    repo_dir = hf_home / "hub" / f"models--{org}--{name}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    for src in sorted(p for p in saved.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / src.relative_to(saved)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir, snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no folder named like the ids here
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "revision",
    [
        "../../../etc",
        "main/../..",
        "a..b",
        "..",
        ".hidden",
        "main.lock",
        "a//b",
        "/main",
        "main/",
        "@",
        "main@{1}",
        "main~1",
        "a b",
        "a:b",
        "a\\b",
        "x.",
        "a\nb",
        "",
    ],
)
def test_revisions_that_are_no_git_refs_are_refused_by_name(revision, offline_hub, saved):
    hub_cache(offline_hub, saved[0])
    (offline_hub / "hub" / "etc").mkdir()  # what ../../../etc would reach from refs/
    with pytest.raises(BadFile) as err:
        resolve_model_path(f"tiny-org/tiny-oft@{revision}")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("actor.model.model_path: tiny-org/tiny-oft: revision: expected a git ref")
    assert repr(revision)[:60] in msg
    with pytest.raises(BadFile, match=r"^sft.dataset_path: someone/demos: revision"):
        resolve_model_path(f"someone/demos@{revision}", key="sft.dataset_path", repo_type="dataset")


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", COMMIT, "release/2024-06_rc1"])
def test_valid_revisions_resolve_in_a_real_hub_cache(revision, offline_hub, saved):
    repo_dir, snapshot = hub_cache(offline_hub, saved[0], refs=("main", "v1.0", "refs/pr/1", "release/2024-06_rc1"))
    assert check_revision(revision) == revision and parse_hub_id(f"a/b@{revision}") == ("a/b", revision)
    assert resolve_model_path(f"tiny-org/tiny-oft@{revision}") == str(snapshot)


def test_a_model_in_a_real_hub_cache_loads_through_its_blob_links(offline_hub, saved):
    """The snapshot's files are links into blobs/, outside the snapshot folder but inside the repo's: allowed."""
    path, state = saved
    _, snapshot = hub_cache(offline_hub, path, refs=("main", "refs/pr/1"))
    assert os.path.islink(snapshot / "model.safetensors")
    torch.manual_seed(1)  # a different fresh init: the weights must come from the cache
    loaded = build_policy(
        _cfg("actor.model.model_path=tiny-org/tiny-oft@refs/pr/1").actor.model, SPECS, 4, True, "token_level"
    )
    got = loaded.state_dict()
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_a_ref_naming_a_folder_outside_the_cache_is_refused(offline_hub, saved, tmp_path):
    """refs/main of the cache names the commit folder; one that climbs out (to a model that would load) is refused."""
    repo_dir, _ = hub_cache(offline_hub, saved[0])
    outside = tmp_path / "outside"
    shutil.copytree(saved[0], outside)
    (repo_dir / "refs" / "main").write_text(os.path.relpath(outside, repo_dir / "snapshots"))
    with pytest.raises(OutsideRoot) as err:
        resolve_model_path("tiny-org/tiny-oft")
    assert "\n" not in str(err.value) and "snapshot of 'tiny-org/tiny-oft'" in str(err.value)
    with pytest.raises(OutsideRoot):
        build_policy(_cfg("actor.model.model_path=tiny-org/tiny-oft").actor.model, SPECS, 4, True, "token_level")


def test_a_snapshot_folder_linked_out_of_the_cache_is_refused(offline_hub, saved, tmp_path):
    repo_dir, snapshot = hub_cache(offline_hub, saved[0])
    outside = tmp_path / "outside"
    shutil.copytree(saved[0], outside)
    (repo_dir / "refs" / "main").write_text(OTHER)
    os.symlink(outside, repo_dir / "snapshots" / OTHER)
    with pytest.raises(OutsideRoot, match="through a symbolic link"):
        resolve_model_path("tiny-org/tiny-oft")
    assert resolve_model_path(f"tiny-org/tiny-oft@{COMMIT}") == str(snapshot)  # the real commit still resolves


def test_a_snapshot_file_linked_out_of_the_repo_folder_is_refused(offline_hub, saved, tmp_path):
    """A link into blobs/ is the cache's layout; one to a file elsewhere (that would load) is not."""
    _, snapshot = hub_cache(offline_hub, saved[0])
    outside = tmp_path / "outside"
    shutil.copytree(saved[0], outside)
    (snapshot / "model.safetensors").unlink()
    os.symlink(outside / "model.safetensors", snapshot / "model.safetensors")
    with pytest.raises(OutsideRoot) as err:
        build_policy(_cfg("actor.model.model_path=tiny-org/tiny-oft").actor.model, SPECS, 4, True, "token_level")
    assert "model.safetensors" in str(err.value) and "through a symbolic link" in str(err.value)
