"""What a run tells its user and leaves behind: console lines, the counts that survive --resume
(coordinator_state.json), and the end-of-run summary (summary.json, learning curve)."""

from __future__ import annotations

import json
import math
import os
import pathlib

from rlfleet.algorithms import get_algorithm
from rlfleet.config.views import CoordinatorView
from rlfleet.data.intervals import rate_of
from rlfleet.untrusted import BadFile, check_count, read_json
from services.coordinator.bottleneck import WINDOW, BottleneckWindow, FleetShape


def per_simulator(ev: dict) -> str:
    """' (libero 10.0% [3.5, 25.6], metaworld 50.0% [...])' in a run over several simulators, else ''."""

    def rate(k, v):
        n = ev.get(k.replace("/success_once", "/num_episodes"))
        return rate_of(v, int(n)) if n else f"{v:.1%}"

    per = [
        f"{k.split('/')[1]} {rate(k, v)}" for k, v in ev.items() if k.endswith("/success_once") and k.count("/") == 2
    ]
    return f" ({', '.join(per)})" if per else ""


def eval_line(ev: dict) -> str:
    """One evaluation's result for the console, its success rate with the 95% (Wilson) interval: one 100-episode
    evaluation moves about +-5 points by chance alone."""
    n = int(ev["eval/num_episodes"])
    return (
        f"success_once {rate_of(ev['eval/success_once'], n)} return {ev['eval/return']:.2f} over "
        f"{n} episodes" + per_simulator(ev)
    )


def learned(history: list[dict], rate: float | None, evals: int) -> str | None:
    """Why the run stops early, or None: the last ``evals`` evaluations of ``history`` (the run's, in order; it
    survives --resume in coordinator_state.json) all reached ``rate`` (runner.early_stop_success_rate, None: off;
    runner.early_stop_evals)."""
    if rate is None:
        return None
    row: list[float] = []
    for e in reversed(history):
        v = e.get("eval/success_once")
        if v is None or not v >= rate:
            break
        row.append(v)
    if len(row) < evals:
        return None
    got = ", ".join(f"{v:.1%}" for v in reversed(row[:evals]))
    in_a_row = f"{evals} evaluations in a row" if evals > 1 else "1 evaluation"
    return f"eval success_once >= {rate * 100:g}% on {in_a_row} ({got}; runner.early_stop_success_rate)"


class RunReport:
    def __init__(self, view: CoordinatorView | None, run_dir: pathlib.Path, quiet: bool = False):
        self.view, self.run_dir, self.quiet = view, run_dir, quiet
        self.eval_history: list[dict] = []
        self.prior_restarts: dict[str, int] = {}  # from the run's earlier parts (--resume)
        self._env_seen: dict[str, float] = {}  # latest env/* metrics, for progress lines
        self.bottleneck = BottleneckWindow()  # the last epochs' timings -> which part limits the run
        self._said_bottleneck: tuple[str, int] | None = None  # (part, epoch) last printed on the console

    def say(self, text: str, verbose: bool = False) -> None:
        if not self.quiet and not (verbose and os.environ.get("RLFLEET_VERBOSE", "0") == "0"):
            print(text, flush=True)

    def say_summary(self, text: str) -> None:
        """The run's summary: printed under --quiet too (it is what --quiet keeps)."""
        print(text, flush=True)

    # --- counts that survive --resume ------------------------------------------------------------------------
    def save_state(self, lost_episodes: int, restarts: dict[str, int]) -> None:
        state = {"lost_episodes": lost_episodes, "restarts": restarts, "eval_history": self.eval_history}
        tmp = self.run_dir / "coordinator_state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.run_dir / "coordinator_state.json")

    def load_state(self, resumed_step: int | None = None) -> int:
        """Restore the eval history and restart counts of a resumed run; -> its lost-episode count.
        ``resumed_step``: the step the run resumes from (its checkpoint's epoch + 1); evaluations of later steps
        were of a policy that the resumed run trains again, and are dropped (as ``metrics.jsonl`` drops them).
        The file is read as untrusted (rlfleet.untrusted): a bad one is a BadFile naming the field."""
        path = self.run_dir / "coordinator_state.json"
        if not self.view.resume_dir or not path.exists():
            return 0
        state = read_json(path, root=self.run_dir, what="coordinator state")
        history, restarts, lost = (
            state.get("eval_history", []),
            state.get("restarts", {}),
            state.get("lost_episodes", 0),
        )
        if not isinstance(history, list) or not all(
            isinstance(e, dict)
            and isinstance(e.get("step"), int)
            and not isinstance(e["step"], bool)
            and all(isinstance(v, (int, float, type(None))) and not isinstance(v, bool) for v in e.values())
            for e in history
        ):
            raise BadFile(path, "eval_history", "a list of {step: int, metric: number, ...}")
        if not isinstance(restarts, dict) or not all(isinstance(v, int) and v >= 0 for v in restarts.values()):
            raise BadFile(path, "restarts", "a map of service role to a non-negative count", repr(restarts)[:80])
        check_count("lost_episodes", lost, 2**62, source=path)
        self.eval_history = [e for e in history if resumed_step is None or e["step"] <= resumed_step]
        self.prior_restarts = {str(k): int(v) for k, v in restarts.items()}
        return int(lost)

    # --- console ----------------------------------------------------------------------------------------------
    def progress_line(self, epoch: int, m: dict[str, float], env_steps: int, elapsed: float, lost: int) -> str:
        # env/* exist only for epochs in which episodes ended: show the latest known values
        self._env_seen = {**self._env_seen, **{k: v for k, v in m.items() if k.startswith("env/")}}
        m = {**self._env_seen, **m}

        def f(key, fmt):
            v = m.get(key)
            return format(v, fmt) if v is not None and math.isfinite(v) else "-"

        budget = self.view.max_env_steps
        return (
            f"epoch {epoch + 1:4d} | steps {env_steps / 1000:7.1f}k"
            + (f"/{budget / 1000:.0f}k" if budget else "")
            + f" | {f('rollout/env_steps_per_s', '5.0f')} env steps/s | {elapsed:5.0f}s"
            f" | success_once {f('env/success_once', '.2f')} | return {f('env/return', '6.2f')}"
            + "".join(
                f" | {label} {f(key, fmt)}" for label, key, fmt in get_algorithm(self.view.algorithm_name).progress
            )
            + (f" | lost {lost}" if lost else "")
        )

    # --- the bottleneck (services/coordinator/bottleneck.py) ---------------------------------------------------
    def note_epoch(self, epoch: int, metrics: dict[str, float], shape: FleetShape) -> str | None:
        """Add an epoch's metrics to the bottleneck window; -> a console line when the verdict is worth saying:
        once the window is full, then only when the limiting part changes, at most once per window of epochs
        (the console stays quiet otherwise; `coordinatorctl status` always has the current line)."""
        d = self.bottleneck.add(metrics, shape)
        if not d.line or not self.bottleneck.full:
            return None
        said = self._said_bottleneck
        if said is not None and (said[0] == d.part or epoch - said[1] < WINDOW):
            return None
        self._said_bottleneck = (d.part, epoch)
        return f"  bottleneck: {d.line}"

    @property
    def bottleneck_line(self) -> str:
        return self.bottleneck.diagnosis.line

    # --- end of run -------------------------------------------------------------------------------------------
    def write_summary(
        self,
        *,
        env_id: str,
        epochs: int,
        env_steps: int,
        train_time: float,
        stop_why: str,
        final: dict | None,
        ckpt: str,
        lost_episodes: int,
        restarts: dict[str, int],
        last_metrics: dict[str, float],
    ) -> dict:
        from services.coordinator.plots import plot_learning_curve

        try:
            curve = plot_learning_curve(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - a plot never costs the run its summary
            self.say(f"  ! learning curve not drawn: {type(exc).__name__}: {exc}")
            curve = None
        summary = {
            "experiment_name": self.view.experiment_name,
            "run_dir": str(self.run_dir),
            "env_id": env_id,
            "epochs": epochs,
            "env_steps": env_steps,
            "train_wall_time_s": round(train_time, 2),
            "stop_reason": stop_why,
            "final_eval": dict(final or {}),
            "initial_eval": next((e for e in self.eval_history if e["step"] == 0), None),
            "eval_history": self.eval_history,
            "lost_episodes": lost_episodes,
            "restarts": restarts,
            "last_train_metrics": {k: v for k, v in last_metrics.items() if math.isfinite(v)},
            "checkpoint": ckpt,
            "learning_curve": str(curve) if curve else None,
            # over the last epochs of this run (part of it when resumed); null before any epoch's timings
            "bottleneck": self.bottleneck_line or None,
            "bottleneck_detail": self.bottleneck.diagnosis.as_dict() if self.bottleneck_line else None,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.say_summary("")
        self.say_summary("=" * 72)
        if final:
            n = int(final["eval/num_episodes"])
            self.say_summary(
                f"final evaluation: success_once {rate_of(final['eval/success_once'], n)} "
                f"({n} seeded episodes, 95% interval), return {final['eval/return']:.2f}" + per_simulator(final)
            )
        else:
            self.say_summary("no final evaluation (run stopped early)")
        self.say_summary(f"{epochs} epochs, {env_steps} env steps, {train_time:.0f}s of training")
        if self.bottleneck_line:
            d = self.bottleneck.diagnosis
            self.say_summary(f"bottleneck (last {d.epochs} epoch{'s' if d.epochs != 1 else ''}): {d.line}")
        from rlfleet.data.loggers import logger_backend

        folders = "".join(f"{logger_backend(name).folder}/, " for name in dict.fromkeys(self.view.logger_backends))
        self.say_summary(
            f"run files: {self.run_dir}  (summary.json, metrics.jsonl, {folders}checkpoints/, "
            f"learning_curve.png, config.yaml, logs/)"
        )
        if ckpt:
            self.say_summary(f"last checkpoint: {ckpt}")
        self.say_summary("=" * 72)
        return summary
