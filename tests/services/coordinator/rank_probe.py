"""A stand-in for a learner rank in tests of the torchrun launch path (test_learner_ranks.py).

``python -m tests.services.coordinator.rank_probe <the learner's arguments>`` binds itself to its parent as a service
does, writes what it sees to <run-dir>/rank_<RANK>.json and waits to be killed; with RANK_PROBE_EXIT=N, rank 1
exits with code N instead. ``launcher(run_dir)``: a local launcher whose learner (2 CPU ranks) runs this module
through the launcher's own command."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

CPU_RANKS = ["cluster.learner_world_size=2"]


def launcher(run_dir: pathlib.Path, token: str | None = "t"):
    from rlfleet.config import load_config
    from services.coordinator.launcher import LocalLauncher

    out = LocalLauncher(load_config(None, CPU_RANKS), run_dir, run_dir / "config.yaml", "127.0.0.1:1", token)
    spec = out.specs[("learner", 0)]
    out.specs[("learner", 0)] = dataclasses.replace(spec, module=__spec__.name)  # the same command, this module
    return out


def main() -> None:
    from rlfleet.wire.service import die_with_parent, launched_pid

    die_with_parent()
    run_dir = pathlib.Path(sys.argv[sys.argv.index("--run-dir") + 1])
    seen = {
        key: os.environ.get(key)
        for key in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "TORCHELASTIC_RUN_ID",
            "CUDA_VISIBLE_DEVICES",
            "RLFLEET_PARENT_PID",
            "RLFLEET_RUN_TOKEN",
        )
    }
    seen.update(pid=os.getpid(), ppid=os.getppid(), launched_pid=launched_pid(), argv=sys.argv[1:])
    tmp = run_dir / f".rank_{seen['RANK']}.json"
    tmp.write_text(json.dumps(seen))
    tmp.rename(run_dir / f"rank_{seen['RANK']}.json")
    if os.environ.get("RANK_PROBE_EXIT") and seen["RANK"] == "1":
        sys.exit(int(os.environ["RANK_PROBE_EXIT"]))
    time.sleep(120)


if __name__ == "__main__":
    main()
