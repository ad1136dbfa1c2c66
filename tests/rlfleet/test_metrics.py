"""metrics.jsonl across a resume: each step once (rlfleet/data/metrics.py)."""

import json

from rlfleet.data.metrics import MetricsLogger, read_metrics


def test_resume_drops_the_records_logged_after_the_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path, backends=("tensorboard",))
    for step in range(1, 6):
        log.log(step, {"train/loss": float(step)})
    log.log(4, {"eval/success_once": 0.5})  # an evaluation logged at a step past the checkpoint
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # the kill cut the last line short

    resumed = MetricsLogger(tmp_path, backends=("tensorboard",))
    assert resumed.resume_at(3) == 4  # steps 4, 5, the eval at 4 and the cut line
    for step in range(4, 7):  # the resumed run trains and logs those epochs again
        resumed.log(step, {"train/loss": 10.0 * step})
    resumed.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["train/loss"] for r in records] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_resume_without_a_metrics_file_starts_one(tmp_path):
    log = MetricsLogger(tmp_path / "fresh", backends=())
    (tmp_path / "fresh" / "metrics.jsonl").unlink()
    assert log.resume_at(7) == 0
    log.log(8, {"x": 1.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "fresh")] == [8]
