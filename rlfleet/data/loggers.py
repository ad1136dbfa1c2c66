"""Logger backends: where a run's scalars go besides ``metrics.jsonl`` (RLinf's ``runner.logger.logger_backends``).

One class per backend, chosen by name from :data:`LOGGER_BACKENDS` (:func:`logger_backend`; an unknown name says
"did you mean"). Each writes into the run folder: TensorBoard to ``tensorboard/``, W&B to ``wandb/``, SwanLab to
``swanlog/``. wandb and swanlab are optional packages: :func:`missing` names the ones this environment lacks and
:func:`pip_commands` the exact commands that install them (``python -m rlfleet.data.loggers install NAME ...`` runs
them). swanlab declares ``protobuf<7`` while rlfleet's generated gRPC code needs protobuf 7, so it is installed
without its dependencies and then its dependencies except protobuf (it runs on protobuf 7).

Resume: W&B and SwanLab runs keep the id of their first start in the run folder (``wandb_run_id``,
``swanlab_run_id``) and a resumed rlfleet run continues that run (``resume="allow"``).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rlfleet.registry import lookup

WANDB_REQUIREMENT = "wandb==0.31.0"
SWANLAB_REQUIREMENT = "swanlab==0.10.3"
# swanlab 0.10.3's own requirements (its wheel's metadata) less protobuf<7, installed after it with --no-deps.
SWANLAB_DEPENDENCIES = (
    "click",
    "nvidia-ml-py",
    "orjson",
    "platformdirs>=4.2.0",
    "psutil>=5.0.0",
    "pwinput>=1.0.3",
    "pydantic-settings>=2.8.1",
    "pydantic~=2.0",
    "pyecharts>=2.0.0",
    "pyroaring>=1.0.0,<1.0.4",
    "pyyaml",
    "requests>=2.28.0",
    "rich>=13.6.0",
    "setuptools",
    "urllib3>=1.26.0",
    "watchdog",
    "wrapt>=1.17.0",
)


@dataclass(frozen=True)
class LoggerOptions:
    """What the backends need of the run's configuration (``runner.logger`` and ``runner.experiment_name``)."""

    project_name: str = "rlfleet"
    experiment_name: str = "run"
    wandb_mode: str | None = None  # None: $WANDB_MODE, else online
    swanlab_mode: str | None = None  # None: $SWANLAB_MODE, else online

    @classmethod
    def from_runner(cls, runner) -> "LoggerOptions":
        lg = runner.logger
        return cls(
            project_name=str(lg.project_name),
            experiment_name=str(runner.experiment_name),
            wandb_mode=lg.wandb_mode,
            swanlab_mode=lg.swanlab_mode,
        )


class LoggerBackend:
    """One destination of the run's scalars. ``log`` gets only finite values; ``resume_at(step)``: the run
    continues after ``step`` (the killed run may have logged later steps, which are logged again)."""

    name = ""
    folder = ""  # its files in the run folder
    module: str | None = None  # the optional package it imports; None: one of rlfleet's own
    pip: tuple[tuple[str, ...], ...] = ()  # `pip install` arguments that install it, one command each
    mode_key: str | None = None  # its runner.logger key of modes
    modes: tuple[str, ...] = ()

    def __init__(self, run_dir: pathlib.Path, options: LoggerOptions):
        self.run_dir = pathlib.Path(run_dir)
        self.options = options

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def resume_at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardBackend(LoggerBackend):
    """Event files in ``<run>/tensorboard``; on resume the events past the checkpoint are purged."""

    name = "tensorboard"
    folder = "tensorboard"

    def __init__(self, run_dir, options):
        super().__init__(run_dir, options)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / self.folder))
        self._flushed = 0.0  # time.monotonic() of the last flush

    FLUSH_INTERVAL_S = 1.0  # what TensorBoard shows of a live run is at most this old

    def log(self, step, scalars):
        """One event of every scalar (``add_scalar`` per key made an event each: 49 keys took 3-5 ms of each
        epoch's Train call, one event 0.5 ms), flushed at most once a second."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)
        now = time.monotonic()
        if now - self._flushed >= self.FLUSH_INTERVAL_S:
            self.writer.flush()
            self._flushed = now

    def resume_at(self, step):
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()  # events at steps > ``step`` are purged when the new writer first writes
        self.writer = SummaryWriter(str(self.run_dir / self.folder), purge_step=step + 1)

    def close(self):
        self.writer.close()


class _RunIdBackend(LoggerBackend):
    """A hosted tracker's run, continued across restarts of the rlfleet run by the id kept in the run folder."""

    def _stored_id(self) -> str | None:
        path = self.run_dir / f"{self.name}_run_id"
        return (path.read_text().strip() or None) if path.exists() else None

    def _store_id(self, run_id: str) -> None:
        (self.run_dir / f"{self.name}_run_id").write_text(f"{run_id}\n")


class WandbBackend(_RunIdBackend):
    """Weights & Biases: a run named ``runner.experiment_name`` in project ``runner.logger.project_name``, its
    files in ``<run>/wandb``. A step W&B already holds (a resumed online run, whose killed part logged past the
    checkpoint) is not logged again: W&B keeps one value per step and refuses earlier steps."""

    name = "wandb"
    folder = "wandb"  # (wandb's own name, under dir=<run>)
    module = "wandb"
    pip = ((WANDB_REQUIREMENT,),)
    mode_key = "wandb_mode"
    modes = ("online", "offline", "disabled")

    def __init__(self, run_dir, options):
        super().__init__(run_dir, options)
        import wandb

        run_id = self._stored_id()
        self.run = wandb.init(
            project=options.project_name,
            name=options.experiment_name,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            mode=options.wandb_mode,
            reinit="create_new",
        )
        if run_id is None:
            self._store_id(self.run.id)
        self.held = int(self.run.step or 0)  # the next step W&B accepts (0 for a new or offline run)

    def log(self, step, scalars):
        if step >= self.held:
            self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


class SwanlabBackend(_RunIdBackend):
    """SwanLab: an experiment named ``runner.experiment_name`` in project ``runner.logger.project_name``, its files
    in ``<run>/swanlog`` (offline mode: ``swanlab sync <folder>`` uploads it later)."""

    name = "swanlab"
    folder = "swanlog"
    module = "swanlab"
    pip = (("--no-deps", SWANLAB_REQUIREMENT), SWANLAB_DEPENDENCIES)
    mode_key = "swanlab_mode"
    modes = ("online", "offline", "local", "disabled")

    def __init__(self, run_dir, options):
        super().__init__(run_dir, options)
        import swanlab

        run_id = self._stored_id()
        self.run = swanlab.init(
            project=options.project_name,
            name=options.experiment_name,
            log_dir=str(self.run_dir / self.folder),
            mode=options.swanlab_mode,
            id=run_id,
            resume="allow" if run_id else None,
            reinit=True,
        )
        if run_id is None and self.run.id:
            self._store_id(self.run.id)

    def log(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


LOGGER_BACKENDS: dict[str, type[LoggerBackend]] = {
    cls.name: cls for cls in (TensorBoardBackend, WandbBackend, SwanlabBackend)
}
# runner.logger's mode keys -> their modes (null = the backend's own default)
LOGGER_MODES = {cls.mode_key: cls.modes for cls in LOGGER_BACKENDS.values() if cls.mode_key}


def logger_backend(name: str) -> type[LoggerBackend]:
    """The backend class named ``name``; :class:`rlfleet.registry.UnknownName` (with did-you-mean) otherwise."""
    return lookup(LOGGER_BACKENDS, name, "logger backend")


def missing(names: Iterable[str]) -> list[str]:
    """The named backends whose package this Python environment lacks (checked without importing it)."""
    out = []
    for name in dict.fromkeys(names):
        module = logger_backend(name).module
        if module and importlib.util.find_spec(module) is None:
            out.append(name)
    return out


def pip_commands(names: Iterable[str], python: str | None = None) -> list[list[str]]:
    """The commands that install the named backends' packages into ``python``'s environment (this one's)."""
    python = python or sys.executable
    return [
        [python, "-m", "pip", "install", *args] for name in dict.fromkeys(names) for args in logger_backend(name).pip
    ]


def install_hint(names: Iterable[str], python: str | None = None) -> str:
    """The commands of :func:`pip_commands` as one shell line."""
    return " && ".join(shlex.join(cmd) for cmd in pip_commands(names, python))


def install(names: Iterable[str]) -> None:
    """Run :func:`pip_commands` (``python -m rlfleet.data.loggers install NAME ...``), saying each."""
    for cmd in pip_commands(names):
        print(f"[loggers] {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)


def open_backends(names: Iterable[str], run_dir: pathlib.Path, options: LoggerOptions) -> list[LoggerBackend]:
    """The named backends, opened; one that cannot open (a package missing where the learner runs, no login for
    an online mode, no network) is left out with a warning: the run goes on without it."""
    out = []
    for name in dict.fromkeys(names):
        try:
            out.append(logger_backend(name)(run_dir, options))
        except Exception as exc:  # noqa: BLE001 -- a logger never stops training
            hint = f" (install: {install_hint([name])})" if name in LOGGER_BACKENDS and missing([name]) else ""
            print(
                f"learner: warning: logger backend {name} is off for this run: {exc}{hint}", file=sys.stderr, flush=True
            )
    return out


def finite(scalars: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if math.isfinite(v)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "install":
        print(
            f"usage: python -m rlfleet.data.loggers install NAME ...  ({', '.join(LOGGER_BACKENDS)})", file=sys.stderr
        )
        return 2
    try:
        names = [logger_backend(name).name for name in argv[1:]]
    except KeyError as exc:
        print(f"rlfleet.data.loggers: {exc}", file=sys.stderr)
        return 2
    install(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
