"""Shared test fixtures: small configs and real gRPC servers on loopback, started in this process."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch

from rlfleet.config import load_config

torch.set_num_threads(1)

# the inference-server placement (the default's rollout: auto acts in the env servers on a machine without GPUs):
# the tests of the inference server's path pin it; the collocated cases override it (rollout=env)
INFERENCE_SERVER = "cluster.component_placement={'env,rollout,actor': all}"

SMALL = [
    "env.train.total_num_envs=8",
    "env.train.max_steps_per_rollout_epoch=16",
    "env.eval.total_num_envs=4",
    "env.eval.num_episodes=4",
    "actor.micro_batch_size=64",
    "actor.global_batch_size=128",
    "algorithm.update_epoch=2",
    "actor.model.hidden_dims=[64,64]",
    INFERENCE_SERVER,
]


def small_config(*overrides: str):
    return load_config(None, [*SMALL, *overrides])


@pytest.fixture(autouse=True)
def _scheduling_stays_as_it_was():
    """No test may leave the test process with another scheduling policy: SVT-AV1 (the dataset writer's encoder)
    switches its caller to SCHED_FIFO 99 when run as root, and a real-time test process whose threads busy-wait
    starves every other process on a 2-core machine (a suite that never ends). Put back, and the test named."""
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    yield
    after = os.sched_getscheduler(0), os.sched_getparam(0)
    if after != before:
        os.sched_setscheduler(0, *before)
        pytest.fail(
            f"the test process's scheduling changed from policy {before[0]} (priority {before[1].sched_priority}) "
            f"to policy {after[0]} (priority {after[1].sched_priority}); put back"
        )


@pytest.fixture
def cfg():
    return small_config()


class Fleet:
    """One env server, one inference server and a learner, each a real gRPC server on loopback."""

    def __init__(self, cfg, run_dir, external_env: str | None = None):
        from services.env import server as env_server
        from services.inference import server as inf_server
        from services.learner import server as learner_server

        self.cfg = cfg
        self.inf_server, self.inf_addr, self.engine, _ = inf_server.serve(cfg, "127.0.0.1:0")
        self.learner_server, self.learner_addr, self.learner, _ = learner_server.serve(cfg, "127.0.0.1:0", str(run_dir))
        self.env_server, self.env_addr, self.worker, self.env_runtime = env_server.serve(
            cfg, "127.0.0.1:0", external_env=external_env
        )

    def close(self):
        for s in (self.env_server, self.inf_server, self.learner_server):
            s.stop(0)
        self.engine.stop()
        self.worker.close()
        self.learner.close()


@pytest.fixture
def fleet(cfg, tmp_path):
    f = Fleet(cfg, tmp_path / "run")
    yield f
    f.close()


# scripts/test.sh runs the suite on two pytest-xdist workers (-n 2 --dist loadgroup). The tests that start fleets of
# processes (the coordinator's end-to-end runs, learner rank groups, the benchmarks' runs) or count what the whole
# host holds (/dev/shm, /proc) run one at a time within one of two groups of about equal length (CI's durations,
# 2026-11-27: ~25 minutes each); loadgroup orders the work by size, so the two groups start first, one on each worker,
# and the tests of one process (or of servers in this process) fill in around them. One group used to hold them all:
# its worker ran for 50 minutes while the other sat idle after 17. Without xdist the marks do nothing.
ONE_AT_A_TIME = (
    "tests/services/coordinator/",
    "tests/benchmarks/",
    "tests/services/learner/test_rank_group.py",
    "tests/rlfleet/test_shm.py",
    "tests/gpu/",
)
# of those, the group "fleet-a" (the rest: "fleet-b"); the host-counting tests (shared memory) are together in it
FLEET_A = tuple(
    f"tests/services/coordinator/{name}.py"
    for name in (
        "test_end_to_end",
        "test_shared_memory_e2e",
        "test_security",
        "test_early_stop",
        "test_collocated_e2e",
        "test_learner_group_e2e",
        "test_loggers_e2e",
        "test_tls",
        "test_telemetry",
    )
) + ("tests/rlfleet/test_shm.py",)


def _uses_a_module_fixture(item) -> bool:
    """Whether the test takes a module-scoped fixture (e.g. test_vllm_backend's one run of every check in the vLLM
    environment, ~50 s): its module's tests then run on one worker, so the fixture runs once, not once per worker."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope == "module" for group in defs for d in group)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into each test's group
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(ONE_AT_A_TIME):
            item.add_marker(pytest.mark.xdist_group("fleet-a" if item.nodeid.startswith(FLEET_A) else "fleet-b"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
