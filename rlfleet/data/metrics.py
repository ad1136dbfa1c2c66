"""Run metrics: every record goes to ``metrics.jsonl``; to the logger backends (TensorBoard, W&B, SwanLab:
:mod:`rlfleet.data.loggers`) that ``runner.logger.logger_backends`` names.

A resumed run (``--resume``) continues from its last checkpoint, so the epochs the killed run logged after that
checkpoint are trained and logged again: :meth:`MetricsLogger.resume_at` drops them first (``metrics.jsonl`` is
rewritten without records past the checkpoint's step, TensorBoard purges its events past it), so that readers of
the run's metrics see each step once. W&B and SwanLab continue their run of the first start (see
:mod:`rlfleet.data.loggers`).

A backend that fails (cannot open, or raises while logging) is turned off with a warning: logging never stops a run.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import time

from rlfleet.data.loggers import LoggerOptions, finite, open_backends
from rlfleet.untrusted import json_lines

# what a metric name may be when it comes from a peer (LogMetrics, Train's extra_metrics): slash-separated
# segments of letters, digits, '_', '.', '-' (a segment never starts with '.', so no '..'), as RLinf names them
METRIC_NAME = re.compile(r"[A-Za-z0-9_][\w.\-]*(/[A-Za-z0-9_][\w.\-]*)*")
MAX_METRIC_NAME = 200
MAX_METRICS_PER_RECORD = 4096
MAX_STEP = 2**48  # far beyond any run's env steps or epochs, far below what a float64 counts exactly


def check_record(step: int, metrics: dict[str, float], field: str = "metrics") -> None:
    """A record of metrics a peer sends (LogMetrics, Train's extra_metrics): ``step`` in [0, 2^48], at most
    4096 metrics, each name a metric name (``eval/success_once``: no empty name, no path out of a folder such as
    ``../../etc/x``, no spaces or control characters), each value finite. Else ValueError naming the first bad one."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step: {step} is outside [0, 2^48]")
    if len(metrics) > MAX_METRICS_PER_RECORD:
        raise ValueError(f"{field}: {len(metrics)} metrics; at most {MAX_METRICS_PER_RECORD} per record")
    for name, value in metrics.items():
        if len(name) > MAX_METRIC_NAME or not METRIC_NAME.fullmatch(name):
            raise ValueError(
                f"{field}: {name[:80]!r} is not a metric name (slash-separated segments of letters, "
                f"digits, '_', '.', '-', none starting with '.', at most {MAX_METRIC_NAME} characters)"
            )
        if not math.isfinite(value):
            raise ValueError(f"{field}['{name}']: {value} is not a finite number")


def _step_of(line: str) -> int | float | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None  # a line cut short by a crash
    return record.get("step") if isinstance(record, dict) else None


class MetricsLogger:
    def __init__(self, run_dir: str | pathlib.Path, backends=("tensorboard",), options: LoggerOptions | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.jsonl = open(self.path, "a", buffering=1)
        self.backends = open_backends(backends, self.run_dir, options or LoggerOptions())

    def _each(self, what: str, *args) -> None:
        """``backend.what(*args)`` on every backend; one that raises is turned off (a warning), the rest go on."""
        for backend in list(self.backends):
            try:
                getattr(backend, what)(*args)
            except Exception as exc:  # noqa: BLE001 -- a logger never stops training
                self.backends.remove(backend)
                print(
                    f"learner: warning: logger backend {backend.name} is off for the rest of the run: {what} "
                    f"failed: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )

    def resume_at(self, step: int) -> int:
        """The run continues after ``step`` (its checkpoint's): drop every record logged past it (and lines cut
        short by the crash); -> the number of records dropped."""
        self.jsonl.close()
        lines = self.path.read_text(errors="replace").splitlines() if self.path.exists() else []
        keep = []
        for line in lines:
            s = _step_of(line)
            if isinstance(s, (int, float)) and s <= step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)  # whole or not at all: a crash here leaves the old file
        self.jsonl = open(self.path, "a", buffering=1)
        self._each("resume_at", step)
        return len(lines) - len(keep)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        record = {
            "step": step,
            "wall_time": time.time(),
            **{k: (v if math.isfinite(v) else None) for k, v in clean.items()},
        }
        self.jsonl.write(json.dumps(record) + "\n")
        self._each("log", step, finite(clean))

    def close(self) -> None:
        self.jsonl.close()
        self._each("close")
        self.backends = []


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """Every record of a run's ``metrics.jsonl`` (a folder: its file), read line by line (rlfleet.untrusted)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        return []
    return list(json_lines(path))
