"""``python -m rlfleet.wire.torchrun <torchrun's arguments>``: torchrun's agent bound to the coordinator that started it.

A drop-in for ``python -m torch.distributed.run`` (same arguments; it runs ``torch.distributed.run.main`` in this
process), which the local launcher starts for a learner of several ranks. The agent is torch's code, so what a
service does for itself at start is done here first:

- PR_SET_PDEATHSIG to the coordinator (``rlfleet.wire.service.die_with_parent``, RLFLEET_PARENT_PID): a coordinator
  killed with -9 takes the agent with it, and the agent (SIGTERM) stops its ranks;
- RLFLEET_PARENT_PID becomes this process's pid for the ranks it starts: each rank's ``die_with_parent`` binds it
  to its real parent, so a killed agent takes its ranks with it too;
- the CPU cores the launcher placed the learner on (RLFLEET_CPU_CORES), which the ranks inherit;
- the exit code of the first rank that failed becomes the agent's (torchrun's own is 1), so a learner that could
  not start (``rlfleet.wire.service.CANNOT_START``) is reported as such by the coordinator.
"""

from __future__ import annotations

import os
import sys

from rlfleet.wire.service import PARENT_PID_ENV, die_with_parent, pin_to_placed_cores


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    if os.environ.get(PARENT_PID_ENV):
        os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks' parent is this agent
    pin_to_placed_cores()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(
            f"rlfleet.wire.torchrun: rank {rank} exited with code {failure.exitcode}; the group ended",
            file=sys.stderr,
            flush=True,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # SIGTERM/SIGINT: the ranks were stopped with it
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
