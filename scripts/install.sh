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
  echo "[install] torch 2.13.0 (CPU) + rlfleet[test] + swanlab into .venv"
  log=.venv/install.log
  t0=$SECONDS
  # uv (on PyPI; rlfleet depends on it anyway) installs the same pins from pip's configured sources ~8x faster than
  # pip (20 s against 60 s from a cold cache here); pip does it when uv cannot. torch pinned in the same command, or a
  # dependency could pull a multi-GB CUDA build; swanlab (the tests' offline logger) without its protobuf<7 pin, by the
  # command the coordinator names when a config asks for it
  install_uv() {
    .venv/bin/python -m pip install -q "uv>=0.5" && mapfile -t sources < <(.venv/bin/python -m rlfleet.simulators.environments uv-sources) && \
      VIRTUAL_ENV= .venv/bin/uv pip install --python .venv/bin/python "${sources[@]}" "torch==2.13.0" -e ".[test]"
  }
  install_pip() {
    .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install "torch==2.13.0" -e ".[test]"
  }
  exec 3>&1
  if ! { { install_uv || { echo "[install] uv failed (see $log); pip instead (a minute or more)" >&3; install_pip; }; } && \
         .venv/bin/python -m rlfleet.data.loggers install swanlab; } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "[install] failed; full log: $log" >&2
    exit 1
  fi
  # bytecode for what the services import: with PYTHONDONTWRITEBYTECODE set (as on this project's machines) nothing
  # else writes it, and every process would compile torch from source (~2.5 s more per service start; scripts/bytecode.py)
  .venv/bin/python scripts/bytecode.py >>"$log" 2>&1 || echo "[install] warning: no bytecode compiled ahead (see $log)" >&2
  rm -f .venv/.rlfleet-installed-*
  touch "$stamp"
  echo "[install] done in $((SECONDS - t0)) s (log: $log)"
fi
