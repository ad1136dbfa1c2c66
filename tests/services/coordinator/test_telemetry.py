"""OpenTelemetry across the fleet: one epoch is one connected trace over the four roles; metrics are exported."""

import json
import subprocess

import pytest

from rlfleet.wire import tracing
from tests.services.coordinator.test_end_to_end import CTL, TINY

pytestmark = pytest.mark.slow


def test_one_epoch_is_one_trace_across_coordinator_env_inference_and_learner(tmp_path):
    out = subprocess.run(
        [
            *CTL,
            "start",
            *TINY,
            f"runner.logger.log_path={tmp_path}",
            "runner.experiment_name=tel",
            "runner.max_epochs=3",
            "runner.val_check_interval=0",
            "telemetry.metrics_interval_s=0.5",
            "telemetry.step_spans=true",  # off by default (docs/benchmarks.md: ~6% of the default run's epoch)
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "tel"
    spans = tracing.load_spans(run)
    trace = tracing.epoch_trace(spans, 1)
    roles = {s["resource"]["attributes"]["service.name"] for s in trace}
    assert roles == {"rlfleet-coordinator", "rlfleet-env", "rlfleet-inference", "rlfleet-learner"}
    ids = {s["context"]["span_id"] for s in trace}
    roots = [s for s in trace if s["parent_id"] not in ids]
    assert [r["name"] for r in roots] == ["epoch"]  # connected: every other span hangs under the epoch
    names = {s["name"] for s in trace}
    assert {
        "collect",
        "rlfleet.v1.RolloutService/Collect",
        "env.step",
        "act",
        "act_batch",
        "push_rollout",
        "rlfleet.v1.LearnerService/PushRollout",
        "train",
        "ppo_update",
        "publish_weights",
        "rlfleet.v1.InferenceService/UpdateWeights",
    } <= names
    # metrics through the OTel metrics API
    exported = [json.loads(line) for line in (run / "traces" / "metrics_env_0.jsonl").read_text().splitlines()]
    metric_names = {
        m["name"]
        for doc in exported
        for rm in doc["resource_metrics"]
        for sm in rm["scope_metrics"]
        for m in sm["metrics"]
    }
    assert {"rlfleet.env.steps", "rlfleet.env.step_latency", "rlfleet.env.act_wait"} <= metric_names
    shown = subprocess.run([*CTL, "traces", str(run), "--epoch", "1"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "epoch [coordinator-0]" in shown.stdout, shown.stderr
    assert "rlfleet.v1.InferenceService/UpdateWeights [inference-0]" in shown.stdout
