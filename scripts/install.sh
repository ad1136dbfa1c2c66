#!/usr/bin/env bash
# Installs everything rlfleet needs on a fresh Debian/Ubuntu machine into ./.venv (idempotent, fast when done).
#   - Debian GL libraries for headless MuJoCo rendering (EGL), when missing and we are root
#   - a virtualenv with torch 2.13.0 (CPU wheel) and rlfleet (editable) with its test extras (wandb), and swanlab
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
need_gl=0
ldconfig -p 2>/dev/null | grep -q 'libEGL.so.1' || need_gl=1
ls /usr/lib/*/dri/swrast_dri.so >/dev/null 2>&1 || ls /usr/lib/*/dri/*swrast* >/dev/null 2>&1 || need_gl=1
if [ "$need_gl" = 1 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[install] apt-get: EGL/Mesa libraries for headless MuJoCo rendering"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri >/dev/null
  else
    echo "[install] warning: EGL/Mesa libraries missing (apt-get install libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri);" \
         "the vision env will not render" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv"
  "$PY" -m venv .venv
fi
stamp=".venv/.rlfleet-installed-$(cat pyproject.toml rlfleet/data/loggers.py | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[install] pip: torch 2.13.0 (CPU) + rlfleet[test] + swanlab (a few minutes on a fresh machine)"
  log=.venv/install.log
  # torch pinned in the same command, or a dependency could pull a multi-GB CUDA build; swanlab (the tests' offline
  # logger) without its protobuf<7 pin, by the command the coordinator names when a config asks for it
  if ! { .venv/bin/python -m pip install --upgrade pip && \
         .venv/bin/python -m pip install "torch==2.13.0" -e ".[test]" && \
         .venv/bin/python -m rlfleet.data.loggers install swanlab; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "[install] pip failed; full log: $log" >&2
    exit 1
  fi
  rm -f .venv/.rlfleet-installed-*
  touch "$stamp"
fi
