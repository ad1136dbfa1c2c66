"""Which part of the fleet limits a run, in one line: a pure function of recent epochs' metrics and the fleet's shape.

    diagnose([metrics of the last epochs], FleetShape(...)) -> Diagnosis(part, line, shares, epochs)

No I/O, no services: the coordinator feeds it each epoch's metrics (``BottleneckWindow``), ``coordinatorctl status``
and the run summary show its line, and tests drive it with hand-made metric sets.

The accounting (what each time measures and what it overlaps)
------------------------------------------------------------------
Per epoch, the coordinator and the learner log (seconds, one epoch):

``time/step``        the coordinator's wall time of the epoch: from asking for its rollout to the learner's Train
                     reply (``time/rollout`` + ``time/train_rpc`` + microseconds of its own). Evaluations are outside.
``time/rollout``     how long the coordinator waited for the epoch's rollouts: every env server's Collect RPC, i.e. the
                     slowest server's collection *and* its PushRollout to the learner. In async mode (below) only the
                     part not hidden behind the previous epoch's training.
``time/env``         on the env server that stepped longest, the time inside ``env.step`` (the rollout loop is one
                     thread: stages step one after the other, so this never overlaps its own waits).
``time/inference_wait``  on the env server that waited longest, the time blocked for actions (the inference server's
                     queue, batching and forward pass, the gRPC round trip and the decoding of the reply). With S
                     pipeline stages the wait for one stage's actions is spent while the others' are computed, so
                     more stages make it shorter; the envs' stepping and this wait never overlap each other.
``time/train_rpc``   the learner's Train RPC: ``time/train`` (batch build + PPO/GRPO update) + ``time/weight_sync``
                     (publishing the new weights to every inference server) + logging and checkpoints.
``time/wire/act_s``  (when the services report it) on the slowest env server, the CPU seconds its Act path spent
                     building/serialising requests and parsing/decoding replies. Some of it runs on gRPC's threads
                     (serialising a request as the stream sends it) and replies are decoded inside
                     ``time/inference_wait``, so it may overlap the wait and even the stepping: the rest below is
                     clamped at 0, and the wire's share is an upper bound on what removing it would save.
``time/wire/rollout_s``  the PushRollout's encode on the env server (inside the Collect RPC) + decode on the learner
                     (inside it too when the learner decodes as the stream arrives, else inside ``time/train``).
``time/wire/weights_s``  the learner's serialisation of a publish (inside ``time/weight_sync``).
``wire/{act,rollout,weights}_bytes`` and ``wire/*_shm_bytes``: the bytes per epoch, and those through shared memory.

So on one env server a collection is exactly ``env + inference wait + its own work`` (bookkeeping, request encoding,
the push), and the *rest* ``time/rollout - env - wait - wire`` is what no timer names (clamped at 0: with several env
servers ``time/env`` and ``time/inference_wait`` may come from different servers).

**Synchronous** (``algorithm.max_staleness=0``): collection and training take turns, nothing overlaps:
``time/step = time/rollout + time/train_rpc``, and every part below is a share of the epoch that would be saved
if it went to zero. The env servers idle during ``time/train_rpc``, the learner during ``time/rollout``. With
collocated acting the next epoch's Collect is sent before the learner trains, and each env server starts stepping
as soon as the new weights land (it waits for them): that epoch's ``time/rollout`` counts from the Train reply, so
the coordinator's own bookkeeping between epochs falls inside it, overlapped by the stepping.

**Asynchronous** (``algorithm.max_staleness=N >= 1``): collection of epoch k+1 starts as soon as epoch k's rollouts
are in (before k trains), and up to N collections queue on each env server, so collection overlaps training.
``time/rollout`` is then only the learner's wait for data. When the learner waits little (under
``ASYNC_HIDDEN`` of the epoch), collection is hidden behind training and the learner limits; otherwise the env
servers collect back to back and one collection spans one epoch (``time/step``), which is the base of the rollout's
shares. (``rollout/env_steps_per_s`` = steps / ``time/rollout`` counts only the unhidden part in async mode.)

**Pipeline stages** change no formula: they move time from ``time/inference_wait`` into overlap (one stage steps
while another's actions are computed). With one stage, env stepping and inference alternate, so a large wait
there is first cured by a second stage; with two or more, a large wait means the inference side cannot keep up.

The verdict
-----------
Metrics are averaged over the last ``WINDOW`` epochs, leaving out the slowest of them (from three on), each key over
the epochs that have it; the run's first epoch, with its warm-up, counts only while it is the only one. Whole epochs
are averaged, so the parts still add up; one slow epoch (a checkpoint, a neighbour's burst) cannot flip the verdict.
Then:

1. Async, and the learner waits for data less than ``ASYNC_HIDDEN`` of the epoch: **the learner** limits.
2. Otherwise the candidates are, as shares of the epoch: env stepping, the inference wait, the wire (Act + rollout
   push; only when reported), the rest of the rollout, and in sync mode the learner (update + weight sync). The
   largest limits if it takes at least ``DOMINANT`` of the epoch and leads the next by ``MARGIN``; else the run is
   **balanced** (the line lists the parts; in sync mode with a learner of ``RUNNER_UP`` or more it suggests async).
   The runner-up is named when it takes at least ``RUNNER_UP`` too.
3. The advice follows the part and the shape: env stepping -> more env servers (with one stage and a real wait,
   or a second stage); inference wait with one stage -> a second stage, with more -> more inference servers (or a
   larger ``rollout.max_batch_size`` when it is below the rows in flight); wire -> one host (shared memory) or more
   stages; the learner in sync mode -> ``algorithm.max_staleness=1``; in async mode -> a faster update.
Metrics without the wire's names (services older than them) leave the wire out: its time then sits in the rest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

WINDOW = 5  # epochs averaged
DOMINANT = 0.30  # a part limits the run when it is the largest and takes at least this share of the epoch
MARGIN = 0.05  # ... and leads the next part by at least this share of the epoch (else: balanced)
RUNNER_UP = 0.20  # a second part worth naming
ASYNC_HIDDEN = 0.15  # async: the learner waits for data less than this share of the epoch -> the learner limits
STAGE_WAIT = 0.15  # one stage: a wait this large (share of the rollout) is worth a second stage
WIRE_KEYS = ("time/wire/act_s", "time/wire/rollout_s")


@dataclass(frozen=True)
class FleetShape:
    """What the advice depends on: the run's servers, stages and async depth."""

    env_servers: int = 1
    inference_servers: int = 1
    stages: int = 1  # rollout.pipeline_stage_num
    max_staleness: int = 0  # algorithm.max_staleness (0: synchronous)
    max_batch_size: int | None = None  # rollout.max_batch_size
    rows_in_flight: int | None = None  # every train env of every env server (env.train.total_num_envs)
    act_rounds: int | None = None  # Act requests per stage per epoch (max_steps_per_rollout_epoch / action chunk)
    collocated: bool = False  # cluster.component_placement.rollout: env (the env servers act; no inference server)
    train_envs: int | None = None  # env.train.total_num_envs (a count of env servers must divide it)
    eval_envs: int | None = None  # env.eval.total_num_envs (likewise)
    host_cores: int | None = None  # cores of the one host every service runs on (local launcher); None: unknown

    def env_server_advice(self) -> str:
        """What to do when env stepping limits: more env servers, unless they already fill the host's cores."""
        more = self.more_env_servers()
        if self.host_cores and self.env_servers >= self.host_cores:
            return (
                f"the {self.env_servers} env servers already fill this host's {self.host_cores} cores: more cores "
                f"or hosts would take more ({more})"
            )
        return f"add env servers ({more})"

    def more_env_servers(self) -> str:
        """The override that adds env servers: the next count that splits the train envs evenly, with an eval env
        count it splits too where the configured one does not (64 train and 50 eval envs on 2 servers: 4, with
        env.eval.total_num_envs=52)."""
        n = self.env_servers + 1
        if self.train_envs:
            while n < self.train_envs and self.train_envs % n:
                n += 1
            if self.train_envs % n:
                return f"cluster.num_env_servers={self.env_servers + 1} with more train envs (env.train.total_num_envs)"
        advice = f"cluster.num_env_servers={n}"
        if self.eval_envs and self.eval_envs % n:
            advice += f" env.eval.total_num_envs={-(-self.eval_envs // n) * n}"
        return advice

    @classmethod
    def from_config(
        cls,
        cfg,
        env_servers: int | None = None,
        inference_servers: int | None = None,
        host_cores: int | None = None,
    ) -> FleetShape:
        """From a run config; ``env_servers``/``inference_servers``: the counts now (after `coordinatorctl scale`);
        ``host_cores``: the cores of the host all services share (the local launcher's), None when unknown."""

        def get(path: str, default):
            node = cfg
            for part in path.split("."):
                try:
                    node = node[part]
                except (KeyError, TypeError, AttributeError):
                    return default
            return default if node is None else node

        configured = max(1, int(get("cluster.num_env_servers", 1)))
        envs = int(env_servers or configured)
        per_server = int(get("env.train.total_num_envs", 0)) // configured
        chunk = max(1, int(get("actor.model.num_action_chunks", 1)))
        steps = int(get("env.train.max_steps_per_rollout_epoch", 0)) // chunk
        batch = get("rollout.max_batch_size", None)
        placement = get("cluster.component_placement", {})
        items = placement.items() if hasattr(placement, "items") else []
        collocated = any(str(v).strip() == "env" and "rollout" in str(k).replace(" ", "").split(",") for k, v in items)
        return cls(
            env_servers=envs,
            inference_servers=int(inference_servers or get("cluster.num_inference_servers", 1)),
            stages=int(get("rollout.pipeline_stage_num", 1)),
            max_staleness=int(get("algorithm.max_staleness", 0)),
            max_batch_size=int(batch) if batch else None,
            rows_in_flight=per_server * envs or None,
            act_rounds=steps or None,
            collocated=collocated,
            train_envs=int(get("env.train.total_num_envs", 0)) or None,
            eval_envs=int(get("env.eval.total_num_envs", 0)) or None,
            host_cores=host_cores,
        )


@dataclass
class Diagnosis:
    part: str  # env, inference, wire, rest, learner, balanced, unknown
    line: str  # the one line ('' when there is nothing to say yet)
    shares: dict[str, float] = field(default_factory=dict)  # of the epoch; rollout_* of the rollout
    epochs: int = 0  # how many epochs were averaged

    def as_dict(self) -> dict:
        return {
            "part": self.part,
            "line": self.line,
            "epochs": self.epochs,
            "shares": {k: round(v, 4) for k, v in self.shares.items()},
        }


def mean_metrics(window: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each key's mean over the epochs that have a finite, non-negative value for it; from three epochs on, the
    slowest one (largest ``time/step``) is left out, so one slow epoch does not move the shares. Whole epochs are
    averaged (not each key's median), so the parts of an epoch still add up to it."""
    epochs = list(window)
    if len(epochs) >= 3:
        slowest = max(range(len(epochs)), key=lambda i: _finite(epochs[i].get("time/step")))
        epochs = epochs[:slowest] + epochs[slowest + 1 :]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m in epochs:
        for k, v in m.items():
            if (
                (k.startswith(("time/", "wire/")) or k == "train/weight_sync_bytes")
                and isinstance(v, (int, float))
                and math.isfinite(v)
                and v >= 0
            ):
                sums[k] = sums.get(k, 0.0) + float(v)
                counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def _finite(v) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else -1.0


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def diagnose(window: Sequence[Mapping[str, float]], shape: FleetShape) -> Diagnosis:
    """The bottleneck of the epochs in ``window`` (oldest first; all of it is averaged: pass the recent ones)."""
    m = mean_metrics(window)
    n = len(window)
    R, E, W = m.get("time/rollout"), m.get("time/env"), m.get("time/inference_wait")
    L = m.get("time/train_rpc")
    if L is None and "time/train" in m:
        L = m["time/train"] + m.get("time/weight_sync", 0.0)
    T = m.get("time/step")
    if T is None and R is not None and L is not None:
        T = R + L
    if None in (R, E, W, L, T) or T <= 0:
        return Diagnosis("unknown", "", epochs=n)
    update, sync = m.get("time/train", L), m.get("time/weight_sync", 0.0)
    has_wire = any(k in m for k in WIRE_KEYS)
    wire = sum(m.get(k, 0.0) for k in WIRE_KEYS)
    asynchronous = shape.max_staleness >= 1
    # the collection's span: the Collect RPC in sync mode; in async mode collections run back to back when they
    # limit, so one spans the epoch (and when they do not, the learner's verdict needs no split of it)
    C = max(T if asynchronous else R, 1e-9)
    rest = max(0.0, R - E - W - wire) if not asynchronous else max(0.0, C - E - W - wire)
    shares = {
        "learner": min(1.0, L / T),
        "learner_update": min(1.0, update / T),
        "weight_sync": min(1.0, sync / T),
        "learner_waits_for_data": min(1.0, R / T),
        "env": min(1.0, E / T),
        "inference_wait": min(1.0, W / T),
        "rest": min(1.0, rest / T),
        "rollout_env": min(1.0, E / C),
        "rollout_inference_wait": min(1.0, W / C),
        "rollout_rest": min(1.0, rest / C),
    }
    if not asynchronous:
        shares["rollout"] = min(1.0, R / T)
    if has_wire:
        shares.update({"wire": min(1.0, wire / T), "rollout_wire": min(1.0, wire / C)})
    if "time/wire/weights_s" in m:
        shares["wire_weights"] = min(1.0, m["time/wire/weights_s"] / T)

    def done(part: str, line: str) -> Diagnosis:
        return Diagnosis(part, line, shares, n)

    learner_detail = f"update {_pct(shares['learner_update'])}, weight sync {_pct(shares['weight_sync'])}"
    if asynchronous and shares["learner_waits_for_data"] < ASYNC_HIDDEN:
        return done("learner", _learner_async(shares, learner_detail, m))

    names = {
        "env": "env stepping",
        "inference": "acting in the env servers" if shape.collocated else "the inference wait",
        "wire": "the wire",
        "rest": "the rollout's other work",
        "learner": "the learner",
    }
    cands = {"env": shares["env"], "inference": shares["inference_wait"], "rest": shares["rest"]}
    if has_wire:
        cands["wire"] = shares["wire"]
    if not asynchronous:
        cands["learner"] = shares["learner"]
    ranked = sorted(cands.items(), key=lambda kv: -kv[1])
    (part, top), (second, runner) = ranked[0], ranked[1]
    wait_note = (
        f" (the learner waits {_pct(shares['learner_waits_for_data'])} of the epoch for it)" if asynchronous else ""
    )
    if top < DOMINANT or top - runner < MARGIN:
        listed = ", ".join(f"{names[k]} {_pct(v)}" for k, v in ranked if v >= 0.05)
        if asynchronous:
            hint = f"; the learner waits {_pct(shares['learner_waits_for_data'])} of it for data"
        elif shares["learner"] >= RUNNER_UP:
            hint = f": algorithm.max_staleness=1 would overlap the learner's {_pct(shares['learner'])} with collection"
        else:
            hint = ""
        return done("balanced", f"no single part limits: {listed} of the epoch{hint}")
    then = f"; next: {names[second]} ({_pct(runner)} of the epoch)" if runner >= RUNNER_UP else ""

    def of_rollout(key: str) -> str:  # 'X% of the rollout (Y% of the epoch)'; in async mode the two are one
        return f"{_pct(shares['rollout_' + key])} of the rollout" + (
            "" if asynchronous else f" ({_pct(shares[key])} of the epoch)"
        )

    if part == "learner":
        return done(
            "learner",
            f"the learner takes {_pct(top)} of the epoch ({learner_detail}) while the env "
            f"servers idle: with algorithm.max_staleness=1 collection overlaps it" + then,
        )
    if part == "env" and shape.collocated:  # no inference server, no stages: only more env servers help
        advice = shape.env_server_advice()
        return done("env", f"env stepping takes {of_rollout('env')}{wait_note}: {advice}" + then)
    if part == "inference" and shape.collocated:
        return done(
            "inference",
            f"env servers spend {of_rollout('inference_wait')} acting with the policy in their own process "
            f"(rollout: env){wait_note}: a policy this costly batches better on inference servers (drop "
            f"cluster.component_placement.rollout: env)" + then,
        )
    if part == "env":
        advice = shape.env_server_advice()
        if shape.stages == 1 and shares["rollout_inference_wait"] >= STAGE_WAIT:
            advice += (
                f" or a stage (rollout.pipeline_stage_num=2: their "
                f"{_pct(shares['rollout_inference_wait'])} wait would overlap stepping)"
            )
        return done(
            "env",
            f"env stepping takes {of_rollout('env')} and the inference server waits on it{wait_note}: {advice}" + then,
        )
    if part == "inference":
        head = f"env servers wait {of_rollout('inference_wait')}"
        if shape.stages == 1:
            return done(
                "inference",
                f"{head} for actions with one pipeline stage{wait_note}: "
                f"rollout.pipeline_stage_num=2 lets one env group step while another waits" + then,
            )
        advice = f"add inference servers (cluster.num_inference_servers={shape.inference_servers + 1})"
        if shape.max_batch_size and shape.rows_in_flight and shape.max_batch_size < shape.rows_in_flight:
            advice += (
                f", or raise rollout.max_batch_size (now {shape.max_batch_size}, {shape.rows_in_flight} rows in flight)"
            )
        return done("inference", f"{head} on the inference server{wait_note}: {advice}" + then)
    if part == "wire":
        detail = _wire_detail(m, shape)
        return done(
            "wire",
            f"the wire takes {of_rollout('wire')}"
            + (f" ({detail})" if detail else "")
            + f"{wait_note}: "
            + _wire_advice(m)
            + then,
        )
    return done(
        "rest",
        f"the env servers' own work (request encoding, rollout bookkeeping, the push to the "
        f"learner) takes {of_rollout('rest')}{wait_note}: `coordinatorctl traces RUN_DIR` shows "
        f"where" + ("" if has_wire else " (no time/wire/* reported to split it)") + then,
    )


def _learner_async(shares: dict, detail: str, m: dict) -> str:
    waits = _pct(shares["learner_waits_for_data"])
    if shares["weight_sync"] > shares["learner_update"]:
        size = m.get("wire/weights_bytes", m.get("train/weight_sync_bytes"))
        ser = f", {_pct(shares['wire_weights'])} serialising" if "wire_weights" in shares else ""
        return (
            f"the learner limits: publishing weights takes {_pct(shares['weight_sync'])} of the epoch"
            + (f" ({_mb(size)}{ser})" if size else "")
            + f" and it waits only {waits} for data: publish "
            f"fewer bytes (LoRA adapters) or run the learner on the inference servers' host (shared memory)"
        )
    return (
        f"the learner limits: it takes {_pct(shares['learner'])} of the epoch ({detail}) and waits only "
        f"{waits} for data, the collection hidden behind it: a faster update (fewer algorithm.update_epoch, "
        f"more learner ranks or a GPU); more env servers or staleness will not help"
    )


def _wire_detail(m: dict, shape: FleetShape) -> str:
    parts = []
    act = m.get("wire/act_bytes")
    if act:
        per = f"{_mb(act / shape.act_rounds)}/step" if shape.act_rounds else f"{_mb(act)}/epoch"
        parts.append(f"Act {per}")
    roll = m.get("wire/rollout_bytes")
    if roll:
        parts.append(f"rollout push {_mb(roll)}")
    return ", ".join(parts)


def _wire_advice(m: dict) -> str:
    shm = sum(v for k, v in m.items() if k.startswith("wire/") and k.endswith("_shm_bytes"))
    if shm > 0:  # the one-host path is in use already
        return f"shared memory carries {_mb(shm)}/epoch already: add pipeline stages so more of it overlaps stepping"
    return "run env and inference servers on one host (shared memory) or add pipeline stages"


class BottleneckWindow:
    """The last ``size`` epochs' metrics and their diagnosis; the run's first epoch (warm-up: connections, first
    forward passes, allocator growth) counts only until a later one arrives."""

    def __init__(self, size: int = WINDOW):
        self.size = size
        self._epochs: deque = deque(maxlen=size)
        self._first: dict | None = None
        self.diagnosis = Diagnosis("unknown", "")

    def add(self, metrics: Mapping[str, float], shape: FleetShape) -> Diagnosis:
        if self._first is None and not self._epochs:
            self._first = dict(metrics)
        else:
            self._epochs.append(dict(metrics))
        window = list(self._epochs) or [self._first]
        self.diagnosis = diagnose(window, shape)
        return self.diagnosis

    @property
    def full(self) -> bool:
        return len(self._epochs) >= self.size
