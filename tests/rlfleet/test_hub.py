"""``actor.model.model_path`` as a hub id (org/name[@revision]): resolved from the Hugging Face hub cache by
huggingface_hub (HF_HOME, HF_HUB_OFFLINE=1), with a clear error for an id that is not there; a folder as before."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlfleet.config import ConfigError, load_config
from rlfleet.policies import build_policy
from rlfleet.policies.hub import parse_hub_id, resolve_model_path
from rlfleet.wire.spaces import TensorSpace

SPECS = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cfg(*overrides):
    return load_config(
        None,
        [
            "actor.model.model_type=openvla_oft",
            "actor.model.vla.image_size=32",
            "actor.model.num_action_chunks=2",
            "env.train.max_steps_per_rollout_epoch=32",
            "actor.global_batch_size=256",
            "actor.micro_batch_size=256",
            *overrides,
        ],
    )


def _fill_cache(hf_home, saved, repo="tiny-org/tiny-oft"):
    """The hub cache's own layout: models--org--name/{refs/main, snapshots/<commit>/...} (blobs as plain files)."""
    org, name = repo.split("/")
    root = hf_home / "hub" / f"models--{org}--{name}"
    shutil.copytree(saved, root / "snapshots" / COMMIT)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    return root / "snapshots" / COMMIT


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_parse_hub_id():
    assert parse_hub_id("openvla/openvla-7b") == ("openvla/openvla-7b", None)
    assert parse_hub_id("moojink/openvla-7b-oft-finetuned-libero-spatial@main") == (
        "moojink/openvla-7b-oft-finetuned-libero-spatial",
        "main",
    )
    for not_an_id in ("/abs/folder", "runs/x/sft_model", "./a/b", "../a/b", "name"):
        assert parse_hub_id(not_an_id) is None


def test_a_hub_id_builds_the_policy_from_the_offline_cache(tmp_path, offline_hub):
    cfg = _cfg()
    torch.manual_seed(0)
    trained = build_policy(cfg.actor.model, SPECS, 4, True, "token_level")
    trained.save_pretrained(tmp_path / "released")  # the layout model_path loads (what export writes)
    snapshot = _fill_cache(offline_hub, tmp_path / "released")
    from huggingface_hub import snapshot_download  # huggingface_hub itself finds it, offline

    assert snapshot_download("tiny-org/tiny-oft", cache_dir=str(offline_hub / "hub"), local_files_only=True) == str(
        snapshot
    )
    assert resolve_model_path("tiny-org/tiny-oft") == str(snapshot)
    assert resolve_model_path(f"tiny-org/tiny-oft@{COMMIT}") == str(snapshot)
    assert resolve_model_path(str(tmp_path / "released")) == str(tmp_path / "released")  # a folder: as today
    torch.manual_seed(1)  # a different fresh init: the weights must come from the cache
    loaded = build_policy(_cfg("actor.model.model_path=tiny-org/tiny-oft").actor.model, SPECS, 4, True, "token_level")
    want, got = trained.state_dict(), loaded.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_a_missing_hub_id_names_the_id_and_the_cache(offline_hub):
    cache = offline_hub / "hub"
    with pytest.raises(FileNotFoundError) as err:
        build_policy(_cfg("actor.model.model_path=nobody/no-such-vla").actor.model, SPECS, 4, True, "token_level")
    msg = str(err.value)
    assert "actor.model.model_path" in msg and "'nobody/no-such-vla'" in msg and str(cache) in msg
    assert "hf download nobody/no-such-vla" in msg
    with pytest.raises(FileNotFoundError, match="no-such-vla' at revision v2 is not in the hub cache"):
        resolve_model_path("nobody/no-such-vla@v2")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model_path("/definitely/not/here")
    from services.coordinator.preflight import preflight_model  # what `coordinatorctl start` checks first

    with pytest.raises(ConfigError, match=r"^'actor.model.model_path': hub model 'nobody/no-such-vla'"):
        preflight_model(_cfg("actor.model.model_path=nobody/no-such-vla"))


def test_start_with_an_unresolvable_hub_id_fails_in_seconds(offline_hub, tmp_path):
    """`coordinatorctl start` (and `eval` of a hub id) refuse an id that is not in the offline cache before any
    service starts: one config error naming the id and the cache, exit code 2."""
    import os
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.coordinator.cli",
            "start",
            "pandapickcube_vision_ppo_openvla_tiny",
            "actor.model.model_path=nobody/no-such-vla",
            f"runner.logger.log_path={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "config error: 'actor.model.model_path': hub model 'nobody/no-such-vla'" in proc.stderr
    assert str(offline_hub / "hub") in proc.stderr and time.monotonic() - t0 < 60
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.log"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.coordinator.cli",
            "eval",
            "nobody/no-such-vla",
            "--config",
            "pandapickcube_vision_ppo_openvla_tiny",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 2 and "hub model 'nobody/no-such-vla' is not in the hub cache" in proc.stderr, proc.stderr
