"""Collocated acting end to end (issue 37, ``cluster.component_placement.rollout: env``): each env server acts
with the policy in its own process and takes the learner's weights itself; no inference server is started. The
run learns the same numbers as with an inference server for the same seed (the same noise keys, the same padded
batches), `coordinatorctl status` lists no inference server, and only the learner may update an env server's
weights. The fault tests (kill -9 of an env server or of the learner) run for this placement in
test_end_to_end.py (ids collocated-*)."""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest

from rlfleet.v1 import coordinator_pb2, inference_pb2, inference_pb2_grpc
from rlfleet.wire import channels, tracing
from tests.services.coordinator.test_end_to_end import (
    COLLOCATED,
    CTL,
    _learning_record,
    credential,
    finish,
    read_metrics,
    start,
    wait_epoch,
)

pytestmark = pytest.mark.slow


def test_collocated_run_learns_what_the_inference_server_run_learns(tmp_path):
    args = ["runner.max_epochs=3", "runner.val_check_interval=3", "runner.seed=5"]
    code, out = finish(start(tmp_path, *args, *COLLOCATED, name="col"))
    assert code == 0, out
    assert "starting 1 env server(s), acting with the policy themselves (rollout: env), 0 inference server(s)" in out
    logs = sorted(p.name for p in (tmp_path / "col" / "logs").iterdir())
    assert not [n for n in logs if n.startswith("inference")], logs
    col = read_metrics(tmp_path / "col")
    assert [r["train/weights_version"] for r in col if "train/weights_version" in r] == [1, 2, 3]
    # epochs 1 and 2 went out before the update before them (the env servers waited for its weights), each still in
    # a trace of its own
    spans = tracing.load_spans(tmp_path / "col")

    def when(name, epoch, end):
        return [s["end_time" if end else "start_time"] for s in spans if s["name"] == name and epoch_of(s) == epoch]

    for e in (1, 2):
        assert max(when("collect", e, end=False)) < min(when("train", e - 1, end=True))
        collects = [s for s in tracing.epoch_trace(spans, e) if s["name"] == "collect"]
        assert len(collects) == 1 and epoch_of(collects[0]) == e
    code, out = finish(start(tmp_path, *args, "rollout.pipeline_stage_num=1", name="inf"))
    assert code == 0, out
    # the same numbers, all but the Act wire's bytes (there is no Act wire)
    assert [r.pop("wire/act_bytes") for r in _learning_record(col) if "wire/act_bytes" in r] == [0.0] * 3
    inf = read_metrics(tmp_path / "inf")
    assert min(r["wire/act_bytes"] for r in inf if "wire/act_bytes" in r) > 0

    def record(records):
        return [{k: v for k, v in r.items() if k != "wire/act_bytes"} for r in _learning_record(records)]

    assert record(col) == record(inf)  # the same bits, sent ahead or not


def epoch_of(span) -> int | None:
    return span["attributes"].get("rlfleet.epoch")


def test_collocated_status_and_who_may_update_weights(tmp_path):
    proc = start(tmp_path, "runner.max_epochs=1000", *COLLOCATED, name="colstatus")
    run = tmp_path / "colstatus"
    try:
        st = wait_epoch(run, 2, proc)
        assert sorted(coordinator_pb2.Role.Name(s.role) for s in st.services) == ["ENV", "LEARNER"]
        env = [s for s in st.services if s.role == coordinator_pb2.ENV][0]
        with channels.channel(env.address) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            info = stub.Describe(
                inference_pb2.DescribeInferenceRequest(), timeout=5, metadata=credential(run, to="inference")
            )
            assert info.model_type == "mlp" and info.weights_version >= 1 and info.num_parameters > 0
            with pytest.raises(grpc.RpcError) as err:  # the operator's credential may not change the policy
                stub.UpdateWeights(
                    iter([inference_pb2.WeightsChunk(version=2**30)]),
                    timeout=5,
                    metadata=credential(run, to="inference"),
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "accepted only from learner" in err.value.details()
        status = subprocess.run([*CTL, "status", str(run)], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        lines = [ln.strip() for ln in status.stdout.splitlines()]
        assert [ln.split()[0] for ln in lines if ln.startswith(("env[", "learner[", "inference["))] == [
            "env[0]",
            "learner[0]",
        ], status.stdout
        assert "the inference wait" not in status.stdout, status.stdout  # the bottleneck line's name: acting
    finally:
        subprocess.run([*CTL, "stop", str(run)], capture_output=True, text=True, timeout=30)
    code, out = finish(proc)
    assert code == 0, out
    assert json.loads((run / "summary.json").read_text())["epochs"] >= 2
