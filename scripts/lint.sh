#!/usr/bin/env bash
# Lint and format check (ruff, configured in pyproject.toml): seconds. Installs what it needs (scripts/install.sh).
# To put a change in order: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[lint] ruff: clean"
