#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit tests, real gRPC servers on loopback, real MuJoCo,
# end-to-end coordinator runs with faults. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export MUJOCO_GL=${MUJOCO_GL:-egl}
# The simulators' Debian packages (Mesa EGL/Vulkan) go in before any test loads a GL library: upgrading them under a
# running test process breaks its next MuJoCo context (EGL_BAD_MATCH). Not fatal here: the tests name what is missing.
.venv/bin/python -m rlfleet.simulators.environments system-packages all || echo "[test] some simulator system packages are missing (see above)"
# bytecode for every module the tests' processes may import (seconds once compiled; scripts/bytecode.py)
.venv/bin/python scripts/bytecode.py --all || echo "[test] bytecode not compiled ahead; processes compile what they import"
# two workers: each runs one of two groups of fleet tests one at a time, the rest around them (tests/conftest.py); -n 0 (or
# -p no:xdist) runs everything in this process, one test at a time
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
