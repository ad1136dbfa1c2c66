#!/usr/bin/env bash
# The GPU run of issue 34 in one command on a GPU machine with no network (the device tool's machines: 16 cores, one
# H100 or H200, python3 = /opt/torch/.venv with CUDA torch; docs/benchmarks.md#the-fleet-on-a-gpu-machine):
#
#   bash scripts/gpu_fleet.sh                                 # every part, about 9 minutes in all
#   PARTS=pi0-fleet TOTAL_S=230 bash scripts/gpu_fleet.sh     # a later call on the still-warm machine
#   bash scripts/gpu_fleet.sh --install-only                  # only the install (scripts/gpu_wheels.sh's check)
#
# Needs .whl/ and .gl/ from scripts/gpu_wheels.sh (carried: `carry: [".whl", ".gl"]`). It unpacks the GL loader
# packages (as root), makes a venv that sees the machine's own packages (the machine's python3 is itself a venv,
# so --system-site-packages alone would not see its torch: a .pth adds its site-packages), installs the carried
# wheels into it with pip --no-index --find-links .whl, sets MUJOCO_GL=egl and runs benchmarks/gpu_fleet.py with the
# seconds left of TOTAL_S (default 535: the command ends inside 9 minutes; each part has its own hard deadline).
# Results: $OUT/gpu_fleet.json, $OUT/gpu_fleet.md, and this command's whole output in $OUT/gpu_fleet.log.
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
INSTALL_ONLY=
[ "${1:-}" = "--install-only" ] && { INSTALL_ONLY=1; shift; }
OUT=${OUT:-$PWD/gpu_fleet_out}
mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-535}
PY=${PYTHON:-python3}
VENV=${GPU_VENV:-/tmp/gpu_fleet_venv}
REQ=scripts/gpu_requirements.txt
say() { echo "[gpu_fleet.sh $(($(date +%s) - T0))s] $*"; }
if [ -z "$INSTALL_ONLY" ] && [ -z "${GPU_FLEET_TEED:-}" ]; then  # the whole output into $OUT/gpu_fleet.log as well
  GPU_FLEET_TEED=1 bash "$0" "$@" 2>&1 | tee -a "$OUT/gpu_fleet.log"
  exit "${PIPESTATUS[0]}"
fi

# --- GL: Debian's loader packages, unpacked over / (the device README's recipe; root only) ------------------------
# only where a GPU driver is (GL_UNPACK=1 forces it): unpacked over / they replace this machine's own GL libraries
if [ -z "$INSTALL_ONLY" ] && [ -d .gl ] && [ "$(id -u)" = 0 ] \
   && { [ "${GL_UNPACK:-}" = 1 ] || command -v nvidia-smi >/dev/null; }; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  say "unpacked $(ls .gl/*.deb | wc -l) GL packages"
fi
if [ -z "$INSTALL_ONLY" ] && [ ! -e /usr/share/glvnd/egl_vendor.d/10_nvidia.json ] \
   && [ -e /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ]; then
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  say "EGL vendor file: $__EGL_VENDOR_LIBRARY_FILENAMES"
fi
export MUJOCO_GL=egl PYTHONUNBUFFERED=1

# --- the venv: the machine's packages + the carried wheels ----------------------------------------------------------
CHECK='import mujoco, gymnasium, omegaconf, opentelemetry.sdk.trace, cryptography, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, google.protobuf, rlfleet.v1.env_pb2_grpc'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  say "venv $VENV already holds the carried packages"
else
  [ -d .whl ] || { say "no .whl/ here: run scripts/gpu_wheels.sh first and carry .whl"; exit 2; }
  rm -rf "$VENV"
  "$PY" -m venv --system-site-packages "$VENV" 2>/dev/null || "$PY" -m venv --system-site-packages --without-pip "$VENV" \
    || { say "cannot make a venv with $PY"; exit 2; }
  purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # the machine's python3 is a venv itself: its site-packages (torch, transformers, ...) after the new venv's own
  "$PY" - "$purelib/_gpu_machine.pth" <<'EOF'
import os, sys
dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
  if "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then pip=("$VENV/bin/python" -m pip)
  else pip=("$PY" -m pip --python "$VENV/bin/python"); fi
  nodeps=$(grep 'no-deps' "$REQ" | sed -e 's/#.*//' -e 's/[[:space:]]//g')
  resolved=$(mktemp)
  grep -v 'no-deps' "$REQ" | sed -e 's/#.*//' -e 's/[[:space:]]//g' | grep -v '^$' > "$resolved"
  "${pip[@]}" install -q --disable-pip-version-check --no-index --find-links .whl --no-compile --no-deps $nodeps \
    || { say "pip could not install $nodeps"; exit 2; }
  if ! "${pip[@]}" install -q --disable-pip-version-check --no-index --find-links .whl --no-compile -r "$resolved"; then
    say "pip's resolver refused (above); installing every carried wheel without dependencies instead"
    "${pip[@]}" install -q --disable-pip-version-check --no-index --no-deps --no-compile .whl/*.whl || exit 2
  fi
  tar -xzf .whl/extra/gymnasium_robotics_franka_assets.tar.gz -C "$purelib"  # Franka meshes (franka_assets_dir)
  "$VENV/bin/python" -c "$CHECK" || { say "the venv cannot import what the run needs (above)"; exit 2; }
  say "venv $VENV: carried wheels installed over $PY's packages"
fi
[ -n "$INSTALL_ONLY" ] && exit 0

# --- what the machine is, then the run ----------------------------------------------------------------------------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
"$VENV/bin/python" -c 'import sys, torch, transformers, peft, grpc, google.protobuf as pb, mujoco
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers {transformers.__version__}, peft {peft.__version__}, grpcio {grpc.__version__}, protobuf {pb.__version__}, mujoco {mujoco.__version__}")'
left=$((TOTAL_S - ($(date +%s) - T0)))
budget=$((left - 15))  # the script's own margin: its last part's results are written as it ends
say "benchmarks/gpu_fleet.py with ${budget}s (parts: ${PARTS:-all})"
timeout -k 5 $((left - 5)) "$VENV/bin/python" -m benchmarks.gpu_fleet --out "$OUT" --budget-s "$budget" \
  ${PARTS:+--parts "$PARTS"} "$@"
code=$?
say "done (exit $code)"
exit $code
