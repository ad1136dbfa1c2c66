"""Run metrics: every record goes to ``metrics.jsonl``; TensorBoard when configured."""

from __future__ import annotations

import json
import math
import pathlib
import time


class MetricsLogger:
    def __init__(self, run_dir: str | pathlib.Path, backends=("tensorboard",)):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        record = {"step": step, "wall_time": time.time(),
                  **{k: (v if math.isfinite(v) else None) for k, v in clean.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(record, dict):
            out.append(record)
    return out
