"""A run folder's config.yaml and coordinator_state.json, Register's config text, command-line overrides and
LogMetrics from a peer: each bad one is one named line, nothing it holds runs, and nothing outside the run folder
is read."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

import grpc
import pytest

from rlfleet.config import ConfigError, load_config, to_yaml
from rlfleet.errors import InvalidRequest
from rlfleet.v1 import learner_pb2, learner_pb2_grpc
from rlfleet.wire import channels

CTL = [sys.executable, "-m", "services.coordinator.cli"]
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)
)


@pytest.fixture
def run_folder(tmp_path):
    """A folder as --resume reads it first: the run's resolved config.yaml (what the coordinator writes)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None)))
    return run


def _marker_payload(marker) -> str:
    return f"runner: !!python/object/apply:os.system ['touch {marker}']\n"


@pytest.mark.parametrize(
    "case", ["parse error", "alias bomb", "python tag", "symlink out", "interpolation", "not a mapping", "too large"]
)
def test_resume_names_a_bad_config_yaml_and_runs_nothing(tmp_path, run_folder, case):
    marker = tmp_path / "MARKER"
    cfg = run_folder / "config.yaml"
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text(cfg.read_text())
    text = {
        "parse error": "runner: [1,\n",
        "alias bomb": BOMB,
        "python tag": _marker_payload(marker),
        "interpolation": "runner:\n  experiment_name: ${oc.env:HOME}\n",
        "not a mapping": "- 1\n- 2\n",
        "too large": "# " + "x" * (5 << 20) + "\n",
    }.get(case)
    if case == "symlink out":
        cfg.unlink()
        cfg.symlink_to(outside)
    else:
        cfg.write_text(text)
    t0 = time.monotonic()
    proc = subprocess.run([*CTL, "start", "--resume", str(run_folder)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert err and "Traceback" not in proc.stderr, proc.stderr
    expected = {
        "parse error": "line 2 column 1: expected valid YAML",
        "alias bomb": "without anchors or aliases",
        "python tag": "found the tag '!!python/object/apply:os.system'",
        "symlink out": "expected a path inside",
        "interpolation": "expected a resolved value",
        "not a mapping": "expected a mapping of config groups",
        "too large": "expected at most",
    }[case]
    assert expected in err[-1] and "config.yaml" in err[-1], err
    assert not marker.exists()
    print(f"--resume, config.yaml with {case}: named after {took:.1f}s")
    assert took < 30, took  # alone on this machine 0.4-0.5 s; room for the suite's other worker on the same cores
    assert not (run_folder / "checkpoints").exists() and not (run_folder / "logs").exists()


def test_a_users_own_config_may_interpolate_but_not_carry_tags(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("runner:\n  experiment_name: ${env.train.env_id}\n")
    assert load_config(mine).runner.experiment_name == "PandaPickCube-v0"
    mine.write_text(_marker_payload(tmp_path / "MARKER"))
    with pytest.raises(ConfigError, match="mine.yaml: line 1 column 9: expected plain YAML values"):
        load_config(mine)
    with pytest.raises(ConfigError, match="override 'runner.seed=!!python/name:os.system': line 1 column 4"):
        load_config(None, ["runner.seed=!!python/name:os.system"])
    assert not (tmp_path / "MARKER").exists()


def test_plain_yaml_reads_numbers_and_dates_as_omegaconf_does(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor:\n  optim:\n    lr: 1e-5\nrunner:\n  experiment_name: 2026-11-26\n")
    loaded = load_config(cfg, ["algorithm.gamma=9.5e-1"])
    assert loaded.actor.optim.lr == 1e-5 and loaded.algorithm.gamma == 0.95
    assert loaded.runner.experiment_name == "2026-11-26"


def test_register_refuses_config_text_with_aliases_or_tags():
    from services.coordinator.service_registry import config_difference

    cfg = load_config(None)
    assert config_difference(cfg, to_yaml(cfg)) == ""
    for text, why in ((BOMB, "without anchors or aliases"), ("runner: !!python/name:os.system\n", "no tags")):
        with pytest.raises(InvalidRequest, match=why):
            config_difference(cfg, text)


def test_coordinator_state_of_a_run_folder_is_checked(tmp_path):
    from rlfleet.config.views import coordinator_view
    from rlfleet.untrusted import BadFile
    from services.coordinator.report import RunReport

    cfg = load_config(None, [f"runner.resume_dir={tmp_path}"])
    report = RunReport(coordinator_view(cfg), tmp_path, quiet=True)
    state = tmp_path / "coordinator_state.json"
    state.write_text(
        json.dumps(
            {
                "lost_episodes": 3,
                "restarts": {"env[0]": 1},
                "eval_history": [{"step": 2, "eval/success_once": 0.5}, {"step": 4, "eval/success_once": 0.75}],
            }
        )
    )
    assert report.load_state(resumed_step=3) == 3
    assert [e["step"] for e in report.eval_history] == [2]  # the evaluation past the checkpoint is redone
    for body, field in (
        ('{"eval_history": [{"step": "2"}]}', "eval_history"),
        ('{"restarts": {"x": -1}}', "restarts"),
        ('{"lost_episodes": 1e400}', "lost_episodes"),
        ("[1]", "top level"),
        ("{", "line 1 column 2"),
        (b"\x80\x04\x95\x10", "coordinator state: expected valid UTF-8 JSON"),
    ):
        state.write_bytes(body if isinstance(body, bytes) else body.encode())
        with pytest.raises(BadFile, match=f"coordinator_state.json: {field}"):
            report.load_state()


@pytest.fixture
def learner_stub(cfg, tmp_path):
    from services.learner import server as learner_server

    server, address, learner, _ = learner_server.serve(cfg, "127.0.0.1:0", str(tmp_path / "run"))
    yield learner_pb2_grpc.LearnerServiceStub(channels.channel(address)), tmp_path / "run"
    server.stop(0)
    learner.close()


@pytest.mark.parametrize(
    "step, metrics, why",
    [
        (1, {"eval/x": math.nan}, "is not a finite number"),
        (1, {"eval/x": math.inf}, "is not a finite number"),
        (1, {"": 1.0}, "is not a metric name"),
        (1, {"../../etc/x": 1.0}, "is not a metric name"),
        (1, {"eval/../x": 1.0}, "is not a metric name"),
        (1, {"a b": 1.0}, "is not a metric name"),
        (1, {"x" * 300: 1.0}, "is not a metric name"),
        (-(2**62), {"eval/x": 1.0}, "outside"),
        (2**62, {"eval/x": 1.0}, "outside"),
        (1, {f"m/{i}": 1.0 for i in range(5000)}, "at most 4096"),
    ],
)
def test_log_metrics_refuses_what_is_not_a_metric(learner_stub, step, metrics, why):
    stub, run = learner_stub
    with pytest.raises(grpc.RpcError) as err:
        stub.LogMetrics(learner_pb2.LogMetricsRequest(step=step, metrics=metrics), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    stub.LogMetrics(learner_pb2.LogMetricsRequest(step=3, metrics={"eval/success_once": 0.5}), timeout=10)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("eval/success_once")) for r in records] == [(3, 0.5)]
    assert not list(run.parent.glob("etc*")) and shutil.disk_usage(run)
