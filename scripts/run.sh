#!/usr/bin/env bash
# Install (if needed) and run the default job: `coordinatorctl start` = PPO on PandaPickCube-v0 with every
# service a local process. Extra arguments go to `coordinatorctl start` (a config and/or key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export MUJOCO_GL=${MUJOCO_GL:-egl}
exec .venv/bin/coordinatorctl start "$@"
