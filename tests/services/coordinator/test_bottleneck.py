"""The bottleneck line (services/coordinator/bottleneck.py): the pure function on hand-made epochs for each verdict,
sync and async, with one stage and with several; the averaging window; metrics without the wire's names; the
console's cadence and the summary (RunReport); the Status RPC's field."""

from __future__ import annotations

import math

import pytest

from services.coordinator.bottleneck import ASYNC_HIDDEN, WINDOW, BottleneckWindow, FleetShape, diagnose, mean_metrics
from services.coordinator.report import RunReport


def epoch(step=1.0, rollout=0.8, env=0.5, wait=0.1, train=0.15, sync=0.03, rpc=None, **extra):
    """One epoch's time/* metrics (seconds); ``extra``: more keys, '__' for '/' (wire__act_bytes)."""
    m = {
        "time/step": step,
        "time/rollout": rollout,
        "time/env": env,
        "time/inference_wait": wait,
        "time/train": train,
        "time/weight_sync": sync,
        "time/train_rpc": rpc if rpc is not None else train + sync + 0.01,
    }
    m.update({k.replace("__", "/"): v for k, v in extra.items()})
    return m


SYNC2 = FleetShape(
    env_servers=1, inference_servers=1, stages=2, max_staleness=0, max_batch_size=256, rows_in_flight=64, act_rounds=16
)
SYNC1 = FleetShape(
    env_servers=1, inference_servers=1, stages=1, max_staleness=0, max_batch_size=256, rows_in_flight=64, act_rounds=16
)
ASYNC = FleetShape(
    env_servers=2, inference_servers=1, stages=2, max_staleness=1, max_batch_size=256, rows_in_flight=64, act_rounds=16
)


# --- sync ---------------------------------------------------------------------------------------------------------
def test_sync_env_stepping_limits_add_env_servers():
    d = diagnose([epoch(env=0.6, wait=0.1)], SYNC2)
    assert d.part == "env"
    assert d.line.startswith("env stepping takes 75% of the rollout (60% of the epoch)")
    assert "add env servers (cluster.num_env_servers=2)" in d.line
    assert "pipeline_stage_num" not in d.line  # two stages already
    # the serial accounting: the parts of a sync epoch add up to it
    s = d.shares
    assert s["env"] + s["inference_wait"] + s["rest"] + s["learner"] == pytest.approx(1.0, abs=0.02)
    assert s["rollout"] + s["learner"] == pytest.approx(1.0, abs=0.02)


def test_sync_env_stepping_with_one_stage_and_a_real_wait_suggests_a_stage_too():
    d = diagnose([epoch(env=0.5, wait=0.25)], SYNC1)
    assert d.part == "env"
    assert "add env servers (cluster.num_env_servers=2) or a stage (rollout.pipeline_stage_num=2" in d.line
    assert "31% wait" in d.line  # 0.25 of the 0.8 s rollout


def test_sync_inference_wait_with_one_stage_asks_for_a_second_stage():
    d = diagnose([epoch(env=0.2, wait=0.55)], SYNC1)
    assert d.part == "inference"
    assert d.line.startswith("env servers wait 69% of the rollout (55% of the epoch) for actions with one pipeline")
    assert "rollout.pipeline_stage_num=2" in d.line and "num_inference_servers" not in d.line


def test_sync_inference_wait_with_stages_asks_for_inference_servers_and_batch_size_only_when_capped():
    d = diagnose([epoch(env=0.2, wait=0.55)], SYNC2)
    assert d.part == "inference"
    assert "on the inference server: add inference servers (cluster.num_inference_servers=2)" in d.line
    assert "max_batch_size" not in d.line  # 256 rows per batch > the 64 rows in flight
    capped = FleetShape(env_servers=4, inference_servers=2, stages=2, max_batch_size=64, rows_in_flight=256)
    d = diagnose([epoch(env=0.2, wait=0.55)], capped)
    assert "cluster.num_inference_servers=3" in d.line
    assert "raise rollout.max_batch_size (now 64, 256 rows in flight)" in d.line


def test_sync_learner_limits_suggests_async():
    d = diagnose([epoch(rollout=0.4, env=0.3, wait=0.05, train=0.5, sync=0.08, rpc=0.6)], SYNC2)
    assert d.part == "learner"
    assert d.line.startswith("the learner takes 60% of the epoch (update 50%, weight sync 8%)")
    assert "with algorithm.max_staleness=1 collection overlaps it" in d.line
    assert "; next: env stepping (30% of the epoch)" in d.line


def test_balanced_when_no_part_dominates():
    d = diagnose([epoch(rollout=0.75, env=0.28, wait=0.25, rpc=0.25)], SYNC2)
    assert d.part == "balanced"
    assert d.line == (
        "no single part limits: env stepping 28%, the inference wait 25%, the learner 25%, the "
        "rollout's other work 22% of the epoch: algorithm.max_staleness=1 would overlap the learner's "
        "25% with collection"
    )
    # the largest part must also lead the next by MARGIN: 36% against 33% is a tie, not a verdict
    d = diagnose([epoch(rollout=0.85, env=0.36, wait=0.33, rpc=0.15)], SYNC2)
    assert d.part == "balanced" and d.line.endswith("of the epoch")  # a learner of 15%: no async hint
    d = diagnose([epoch(rollout=0.8, env=0.36, wait=0.3, rpc=0.2)], ASYNC)
    assert d.part == "balanced" and d.line.endswith("; the learner waits 80% of it for data")


def test_unattributed_rollout_time_is_named_as_such():
    d = diagnose([epoch(env=0.2, wait=0.1)], SYNC2)  # 0.5 s of the 0.8 s rollout in no timer
    assert d.part == "rest"
    assert (
        "own work (request encoding, rollout bookkeeping, the push to the learner) takes 63% of the rollout" in d.line
    )
    assert "no time/wire/* reported" in d.line


# --- async --------------------------------------------------------------------------------------------------------
def test_async_learner_limits_when_collection_hides_behind_it():
    d = diagnose([epoch(rollout=0.05, env=0.4, wait=0.1, train=0.85, sync=0.05, rpc=0.95)], ASYNC)
    assert d.part == "learner"
    assert d.line.startswith(
        "the learner limits: it takes 95% of the epoch (update 85%, weight sync 5%) and waits only 5% for data"
    )
    assert "max_staleness=1" not in d.line and "more env servers or staleness will not help" in d.line


def test_async_learner_publishing_weights_limits():
    d = diagnose(
        [
            epoch(
                rollout=0.02,
                env=0.3,
                wait=0.1,
                train=0.3,
                sync=0.6,
                rpc=0.95,
                train__weight_sync_bytes=390e6,
                time__wire__weights_s=0.2,
            )
        ],
        ASYNC,
    )
    assert d.part == "learner"
    assert "publishing weights takes 60% of the epoch (390.0 MB, 20% serialising)" in d.line


def test_async_collection_limits_shares_are_of_the_epoch_the_collection_spans():
    # the learner waits 50% of the epoch for data: the env servers collect back to back, one collection per epoch
    d = diagnose([epoch(rollout=0.5, env=0.7, wait=0.1, rpc=0.5)], ASYNC)
    assert d.part == "env"
    assert d.line.startswith(
        "env stepping takes 70% of the rollout and the inference server waits on it (the "
        "learner waits 50% of the epoch for it): add env servers (cluster.num_env_servers=3)"
    )
    assert "learner" not in d.line.split(":")[1]  # the learner is hidden behind collection: not a candidate


def test_async_threshold_is_the_learners_wait():
    just_under = epoch(rollout=(ASYNC_HIDDEN - 0.01), env=0.6, wait=0.1, rpc=0.85)
    just_over = epoch(rollout=(ASYNC_HIDDEN + 0.05), env=0.6, wait=0.1, rpc=0.8)
    assert diagnose([just_under], ASYNC).part == "learner"
    assert diagnose([just_over], ASYNC).part == "env"


def test_async_inference_wait_with_one_stage():
    shape = FleetShape(stages=1, max_staleness=2)
    d = diagnose([epoch(rollout=0.6, env=0.3, wait=0.6, rpc=0.4)], shape)
    assert d.part == "inference" and "rollout.pipeline_stage_num=2" in d.line


# --- the wire -----------------------------------------------------------------------------------------------------
WIRE = dict(
    time__wire__act_s=0.3,
    time__wire__rollout_s=0.08,
    wire__act_bytes=19.3e6 * 16,
    wire__rollout_bytes=1.2e9,
    wire__weights_bytes=30e6,
    time__wire__weights_s=0.01,
)


def test_wire_limits_with_bytes_per_step():
    d = diagnose([epoch(env=0.22, wait=0.2, **WIRE)], SYNC2)
    assert d.part == "wire"
    assert d.line.startswith(
        "the wire takes 48% of the rollout (38% of the epoch) (Act 19.3 MB/step, rollout push 1.20 GB)"
    )
    assert "run env and inference servers on one host (shared memory) or add pipeline stages" in d.line
    assert d.shares["rollout_wire"] == pytest.approx(0.475)


def test_wire_through_shared_memory_already_asks_for_stages():
    d = diagnose([epoch(env=0.22, wait=0.2, wire__act_shm_bytes=300e6, **WIRE)], SYNC2)
    assert d.part == "wire" and "shared memory carries 300.0 MB/epoch already: add pipeline stages" in d.line


def test_wire_times_without_bytes_and_absent_wire_metrics():
    d = diagnose([epoch(env=0.22, wait=0.2, time__wire__act_s=0.3, time__wire__rollout_s=0.08)], SYNC2)
    assert d.part == "wire" and d.line.startswith("the wire takes 48% of the rollout (38% of the epoch):")
    # older services: no wire keys at all -> no wire share, its time stays in the rest
    d = diagnose([epoch(env=0.5, wait=0.1)], SYNC2)
    assert "wire" not in d.shares and d.part == "env"
    # a window where only some epochs carry them (a peer upgraded mid-run): the ones that have them are averaged
    mixed = [epoch(env=0.22, wait=0.2), epoch(env=0.22, wait=0.2, **WIRE)]
    assert diagnose(mixed, SYNC2).shares["rollout_wire"] == pytest.approx(0.475)


# --- averaging, robustness ----------------------------------------------------------------------------------------
def test_one_slow_epoch_does_not_flip_the_verdict():
    env_bound = epoch(env=0.6, wait=0.1)
    slow_learner = epoch(step=3.0, rollout=0.8, env=0.6, wait=0.1, train=2.0, rpc=2.2)
    window = BottleneckWindow()
    for _ in range(WINDOW - 1):
        assert window.add(env_bound, SYNC2).part == "env"
    assert window.add(slow_learner, SYNC2).part == "env"
    assert diagnose([slow_learner], SYNC2).part == "learner"  # alone it would


def test_the_first_epoch_counts_only_until_a_later_one_arrives():
    window = BottleneckWindow()
    warmup = epoch(step=5.0, rollout=1.0, env=0.6, wait=0.1, rpc=4.0)  # connections, first forward passes
    assert window.add(warmup, SYNC2).part == "learner" and window.diagnosis.epochs == 1
    assert window.add(epoch(env=0.6, wait=0.1), SYNC2).part == "env" and window.diagnosis.epochs == 1
    for _ in range(WINDOW + 3):
        window.add(epoch(env=0.6, wait=0.1), SYNC2)
    assert window.full and window.diagnosis.epochs == WINDOW


def test_missing_or_bad_timings_say_nothing_rather_than_guess():
    assert diagnose([], SYNC2).line == ""
    assert diagnose([{"env/return": 1.0}], SYNC2).part == "unknown"
    no_env = {k: v for k, v in epoch().items() if k != "time/env"}
    assert diagnose([no_env], SYNC2).line == ""
    # non-finite and negative values are left out of the mean, not propagated
    bad = dict(epoch(env=0.6), **{"time/inference_wait": math.nan})
    assert mean_metrics([bad, epoch(env=0.6, wait=0.1)])["time/inference_wait"] == pytest.approx(0.1)
    assert diagnose([bad, epoch(env=0.6, wait=0.1)], SYNC2).part == "env"
    # no time/step or time/train_rpc (an older learner): rebuilt from the parts
    old = {"time/rollout": 0.8, "time/env": 0.6, "time/inference_wait": 0.1, "time/train": 0.2}
    assert diagnose([old], SYNC2).part == "env"


def test_shape_from_config_follows_scaling():
    from tests.conftest import small_config

    cfg = small_config("cluster.num_env_servers=2", "rollout.pipeline_stage_num=1", "algorithm.max_staleness=1")
    shape = FleetShape.from_config(cfg)
    assert (shape.env_servers, shape.stages, shape.max_staleness) == (2, 1, 1)
    per_server = cfg.env.train.total_num_envs // 2
    assert shape.rows_in_flight == 2 * per_server
    scaled = FleetShape.from_config(cfg, env_servers=3)
    assert scaled.env_servers == 3 and scaled.rows_in_flight == 3 * per_server


# --- the console and the summary ----------------------------------------------------------------------------------
def test_console_says_the_verdict_once_the_window_fills_then_only_when_it_changes(tmp_path):
    report = RunReport(None, tmp_path, quiet=True)
    said = []
    env_bound, learner_bound = epoch(env=0.6, wait=0.1), epoch(rollout=0.3, env=0.2, wait=0.05, rpc=0.7)
    for e in range(30):
        m = env_bound if e < 15 else learner_bound
        line = report.note_epoch(e, m, SYNC2)
        if line:
            said.append((e, line))
    # the first once a window is full after the warm-up epoch; then each change, at most one per window: at 16 the
    # four averaged epochs (the slowest of five left out) are half and half (balanced); the learner's verdict of
    # epoch 17 on waits until 21
    assert [e for e, _ in said] == [WINDOW, 16, 16 + WINDOW]
    assert [line.split(":")[1].split()[0] for _, line in said] == ["env", "no", "the"]
    assert report.bottleneck_line.startswith("the learner takes")


def test_summary_carries_the_line(tmp_path):
    from rlfleet.config.views import coordinator_view
    from tests.conftest import small_config

    report = RunReport(coordinator_view(small_config()), tmp_path, quiet=True)
    summary = report.write_summary(
        env_id="x",
        epochs=0,
        env_steps=0,
        train_time=0.0,
        stop_why="test",
        final=None,
        ckpt="",
        lost_episodes=0,
        restarts={},
        last_metrics={},
    )
    assert summary["bottleneck"] is None  # no epoch: nothing to say
    for e in range(3):
        report.note_epoch(e, epoch(env=0.6, wait=0.1), SYNC2)
    summary = report.write_summary(
        env_id="x",
        epochs=3,
        env_steps=0,
        train_time=0.0,
        stop_why="test",
        final=None,
        ckpt="",
        lost_episodes=0,
        restarts={},
        last_metrics={},
    )
    assert summary["bottleneck"].startswith("env stepping takes 75% of the rollout")
    assert summary["bottleneck_detail"]["part"] == "env" and summary["bottleneck_detail"]["epochs"] == 2
    assert 0 < summary["bottleneck_detail"]["shares"]["env"] <= 1


def test_collocated_acting_never_asks_for_stages_or_inference_servers():
    """cluster.component_placement.rollout: env (issue 37): no inference server and one stage (more are refused),
    so the advice is more env servers, or the inference-server placement for a policy that costly."""
    shape = FleetShape.from_config(
        {"cluster": {"component_placement": {"rollout": "env"}}, "rollout": {"pipeline_stage_num": 1}}
    )
    assert (
        shape.collocated
        and not FleetShape.from_config({"cluster": {"component_placement": {"env,rollout": 0}}}).collocated
    )
    d = diagnose([epoch(env=0.5, wait=0.25)], shape)
    assert d.part == "env" and "add env servers (cluster.num_env_servers=2)" in d.line
    assert "pipeline_stage_num" not in d.line and "inference server" not in d.line
    d = diagnose([epoch(env=0.2, wait=0.55)], shape)
    assert d.part == "inference" and "acting with the policy in their own process" in d.line
    assert "pipeline_stage_num" not in d.line and "num_inference_servers" not in d.line
    d = diagnose([epoch(env=0.3, wait=0.25, train=0.2)], shape)
    assert d.part == "balanced" and "acting in the env servers" in d.line and "inference" not in d.line


def test_the_advice_to_add_env_servers_names_a_count_the_config_accepts():
    """A count that does not split the envs evenly is refused at start: the advice names one that does."""
    from rlfleet.config import load_config

    shape = FleetShape.from_config(load_config(None, []))  # 64 train, 50 eval envs on 2 collocated env servers
    assert shape.more_env_servers() == "cluster.num_env_servers=4 env.eval.total_num_envs=52"
    advice = shape.more_env_servers().split()
    assert load_config(None, advice).cluster.num_env_servers == 4
    assert FleetShape(env_servers=1, train_envs=8, eval_envs=4).more_env_servers() == "cluster.num_env_servers=2"
    assert "more train envs" in FleetShape(env_servers=3, train_envs=3).more_env_servers()
    full = FleetShape.from_config(load_config(None, []), host_cores=2)  # the default run on this 2-core machine
    d = diagnose([epoch(env=0.5, wait=0.05)], full)
    assert d.part == "env" and "the 2 env servers already fill this host's 2 cores" in d.line, d.line
    assert "cluster.num_env_servers=4" in d.line  # where more cores are
    d = diagnose([epoch(env=0.5, wait=0.05)], FleetShape.from_config(load_config(None, []), host_cores=16))
    assert "add env servers (cluster.num_env_servers=4 env.eval.total_num_envs=52)" in d.line, d.line
