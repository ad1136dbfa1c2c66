"""Logger backends (rlfleet/data/loggers.py) with the real wandb and swanlab packages in their offline modes: the
files they write are read back; unknown names, missing packages and failing backends."""

import json
import math
import struct
import sys
import time

import pytest

from rlfleet.config import ConfigError, load_config
from rlfleet.data import loggers
from rlfleet.data.loggers import LoggerOptions
from rlfleet.data.metrics import MetricsLogger, read_metrics

STEPS = {
    1: {"train/loss": 0.5, "train/success": 0.25},
    2: {"train/loss": 0.4, "train/success": 0.5},
    3: {"train/loss": 0.3, "train/success": 0.75, "eval/nan": math.nan},
}


def _log_steps(log: MetricsLogger, steps=STEPS) -> None:
    for step, metrics in steps.items():
        log.log(step, metrics)


def _leveldb_records(path, ident: bytes):
    """The records of a LevelDB-log file (W&B's and SwanLab's run files): a 7-byte file header, then 32 KiB
    blocks of records, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[: len(ident)] == ident, data[:8]
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block's padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            chunks = chunk
        elif kind == 3:
            chunks += chunk
        elif kind == 4:
            yield chunks + chunk


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    from wandb.proto import wandb_internal_pb2

    out = {}
    for raw in _leveldb_records(run_file, b":W&B"):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                (item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item
            }
            out[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def _swanlab_scalars(run_file) -> dict[int, dict[str, float]]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    out: dict[int, dict[str, float]] = {}
    for raw in _leveldb_records(run_file, b":SWL"):
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar":
            out.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    return out


def _finite(steps=STEPS):
    return {s: {k: v for k, v in m.items() if math.isfinite(v)} for s, m in steps.items()}


def _settled(read, timeout_s: float = 20.0):
    """W&B's service may still be writing an offline run's file when ``close`` returns (seen under load): read it
    until it holds records, or until the timeout (then the last read, for the assertion to show)."""
    deadline = time.time() + timeout_s
    value = read()
    while not value and time.time() < deadline:
        time.sleep(0.2)
        value = read()
    return value


def test_tensorboard_events_hold_every_scalar_of_every_step_and_a_resume_purges_the_later_ones(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, ("tensorboard",))
    _log_steps(log)
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/success"]  # non-finite values stay out
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.4), (3, 0.3)]
    assert [e.step for e in events.Scalars("train/success")] == [1, 2, 3]

    # a resumed run is a later process: its events file is named after a later second. In one second of one process
    # the files sort by a counter (as text: "10" before "9"), which put the resumed file first in a full suite
    time.sleep(1.1)
    resumed = MetricsLogger(tmp_path, ("tensorboard",))
    resumed.resume_at(1)
    resumed.log(2, {"train/loss": 4.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 4.0)]


def test_wandb_offline_run_holds_the_logged_values_and_a_restart_continues_its_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # runner.logger.wandb_mode null: W&B's own setting decides
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    log = MetricsLogger(run_dir, ("tensorboard", "wandb"), LoggerOptions(project_name="p", experiment_name="exp"))
    assert [b.name for b in log.backends] == ["tensorboard", "wandb"]
    _log_steps(log)
    log.close()
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (first,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")  # in the run folder
    assert _settled(lambda: _wandb_history(first)) == _finite()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]

    # W&B names an offline run's folder by its start time to the second: a restart (which takes seconds in a real
    # run) within the same second would reuse the first start's folder
    time.sleep(1.05 - time.time() % 1.0)
    resumed = MetricsLogger(run_dir, ("wandb",), LoggerOptions(project_name="p", experiment_name="exp"))
    resumed.resume_at(2)
    resumed.log(3, {"train/loss": 0.25})
    resumed.log(4, {"train/loss": 0.2})
    resumed.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id  # the same W&B run (id) continues
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 2  # offline: one folder per start, both of the run id (`wandb sync` uploads them)
    second = next(path for path in runs if path != first)
    assert _settled(lambda: _wandb_history(second)) == {3: {"train/loss": 0.25}, 4: {"train/loss": 0.2}}
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["offline", "local"])
def test_swanlab_run_holds_the_logged_values_and_a_restart_continues_its_id(tmp_path, mode):
    pytest.importorskip("swanlab")
    run_dir = tmp_path / "run"
    options = LoggerOptions(project_name="p", experiment_name="exp", swanlab_mode=mode)
    log = MetricsLogger(run_dir, ("swanlab",), options)
    assert [b.name for b in log.backends] == ["swanlab"]
    _log_steps(log)
    log.close()
    run_id = (run_dir / "swanlab_run_id").read_text().strip()
    (first,) = (run_dir / "swanlog").glob(f"run-*-{run_id}/run-{run_id}.swanlab")
    assert _swanlab_scalars(first) == _finite()

    resumed = MetricsLogger(run_dir, ("swanlab",), options)
    resumed.resume_at(2)
    resumed.log(3, {"train/loss": 0.25})
    resumed.close()
    assert (run_dir / "swanlab_run_id").read_text().strip() == run_id
    runs = sorted((run_dir / "swanlog").glob(f"run-*-{run_id}/run-{run_id}.swanlab"))
    assert len(runs) == 2
    second = next(path for path in runs if path != first)
    assert _swanlab_scalars(second) == {3: {"train/loss": 0.25}}


def test_logger_backend_names_and_modes_are_checked_with_did_you_mean():
    cfg = load_config(
        None,
        [
            "runner.logger.logger_backends=[tensorboard,wandb,swanlab]",
            "runner.logger.wandb_mode=offline",
            "runner.logger.swanlab_mode=local",
        ],
    )
    assert list(cfg.runner.logger.logger_backends) == ["tensorboard", "wandb", "swanlab"]
    assert list(load_config(None).runner.logger.logger_backends) == ["tensorboard"]  # the default stays
    with pytest.raises(
        ConfigError,
        match=r"'runner.logger.logger_backends': unknown logger backend 'wandbb'; "
        r"did you mean 'wandb'\?",
    ):
        load_config(None, ["runner.logger.logger_backends=[wandb,wandbb]"])
    with pytest.raises(ConfigError, match=r"'runner.logger.wandb_mode': 'ofline' is not one of online, offline"):
        load_config(None, ["runner.logger.wandb_mode=ofline"])
    with pytest.raises(ConfigError, match=r"did you mean 'runner.logger.swanlab_mode'"):
        load_config(None, ["runner.logger.swanlab_mod=offline"])


def test_pip_commands_are_exact_and_pinned():
    py = "/x/bin/python"
    assert loggers.pip_commands(["tensorboard"], py) == []
    assert loggers.pip_commands(["wandb"], py) == [[py, "-m", "pip", "install", "wandb==0.31.0"]]
    (first, deps) = loggers.pip_commands(["swanlab", "swanlab"], py)
    assert first == [py, "-m", "pip", "install", "--no-deps", "swanlab==0.10.3"]
    assert deps[:4] == [py, "-m", "pip", "install"] and not any("protobuf" in d for d in deps)


def test_start_with_a_logger_package_missing_fails_in_seconds_naming_the_pip_command(tmp_path, monkeypatch, capsys):
    from services.coordinator import cli

    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a)
    )
    started = time.monotonic()
    code = cli.main(
        ["start", "runner.logger.logger_backends=[tensorboard,swanlab]", f"runner.logger.log_path={tmp_path}"]
    )
    assert code == 2 and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "'runner.logger.logger_backends': swanlab not installed" in err
    assert f"{sys.executable} -m pip install --no-deps swanlab==0.10.3 && " in err


def test_a_backend_that_cannot_open_or_log_is_turned_off_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError, as where it is not installed
    log = MetricsLogger(tmp_path, ("wandb", "tensorboard"), LoggerOptions())
    assert [b.name for b in log.backends] == ["tensorboard"]
    assert "logger backend wandb is off for this run" in capsys.readouterr().err

    def broken(step, scalars):
        raise OSError("disk full")

    monkeypatch.setattr(log.backends[0], "log", broken)
    log.log(1, {"x": 1.0})
    log.log(2, {"x": 2.0})
    log.close()
    assert log.backends == []
    assert "tensorboard is off for the rest of the run: log failed: OSError: disk full" in capsys.readouterr().err
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_deploy_builds_the_main_image_with_the_named_logger_packages():
    from services.coordinator import deploy

    cfg = load_config(None, ["runner.logger.logger_backends=[tensorboard,wandb,swanlab]"])
    assert deploy.images(cfg)["rlfleet:cpu"]["args"]["LOGGERS"] == "wandb swanlab"
    assert "LOGGERS" not in deploy.images(load_config(None))["rlfleet:cpu"]["args"]
