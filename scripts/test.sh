#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: unit tests, real gRPC servers on loopback, real MuJoCo,
# end-to-end coordinator runs with faults. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export MUJOCO_GL=${MUJOCO_GL:-egl}
exec .venv/bin/python -m pytest -q "$@"
