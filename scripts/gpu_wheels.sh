#!/usr/bin/env bash
# What scripts/gpu_fleet.sh brings to a GPU machine that reaches no network (issue 34; shared/design.md section 13):
#   .whl/   Python 3.12 manylinux x86_64 wheels of scripts/gpu_requirements.txt (what the run imports that the
#           machine's python3 lacks), plus .whl/extra/gymnasium_robotics_franka_assets.tar.gz (the Franka meshes the
#           Panda envs read, cut out of gymnasium-robotics' 26 MB wheel)
#   .gl/    Debian's GL loader packages (libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 libvulkan1), which
#           MuJoCo's EGL rendering on the GPU needs there (/work/.library/device/README.md)
# Both are git-ignored; the device tool's `carry` takes them. Then it prints what a command would carry (the working
# tree too: at most 64 MiB) and dry-runs the install for Python 3.12 (pip --dry-run against .whl and a stand-in for
# the machine's own packages), and, where a python3.12 is at hand (PYTHON312, or pyenv's), installs for real into a
# throwaway venv the way the wrapper does and imports and renders what the run needs.
#
#   bash scripts/gpu_wheels.sh        # here, once (pip's package sources and apt-get); KEEP=1 keeps a filled .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
REQ=scripts/gpu_requirements.txt
WHL=.whl
GL=.gl
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
LIMIT=$((64 * 1024 * 1024))

pins() { sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQ" | grep -v '^$'; }
nodeps() { grep 'no-deps' "$REQ" | sed -e 's/#.*//' -e 's/[[:space:]]//g'; }
resolved() { grep -v 'no-deps' "$REQ" | sed -e 's/#.*//' -e 's/[[:space:]]//g' | grep -v '^$'; }
quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2); }  # this machine's pip config names absent folders

# --- wheels ------------------------------------------------------------------------------------------------------
if [ -z "${KEEP:-}" ] || [ ! -d "$WHL" ]; then
  rm -rf "$WHL"
  mkdir -p "$WHL/extra"
  quiet "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WHL" $(pins)
  # the Franka meshes of gymnasium-robotics (its license with them), laid out as the package has them
  tmp=$(mktemp -d)
  quiet "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" gymnasium-robotics==1.4.2
  "$PY" - "$tmp"/gymnasium_robotics-*.whl "$WHL/extra/gymnasium_robotics_franka_assets.tar.gz" <<'EOF'
import io, sys, tarfile, zipfile
src, dst = sys.argv[1], sys.argv[2]
keep = ("gymnasium_robotics/envs/assets/kitchen_franka/franka_assets/", "gymnasium_robotics-1.4.2.dist-info/licenses/")
with zipfile.ZipFile(src) as z, tarfile.open(dst, "w:gz") as t:
    for name in sorted(z.namelist()):
        if name.startswith(keep) and not name.endswith("/"):
            data = z.read(name)
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            t.addfile(info, io.BytesIO(data))
EOF
  rm -rf "$tmp"
fi
n=$(ls "$WHL"/*.whl | wc -l)
[ "$n" -eq "$(pins | wc -l)" ] || { echo "gpu_wheels: $n wheels in $WHL for $(pins | wc -l) pins" >&2; exit 1; }

# --- GL loader packages (as /work/.library/device/README.md says) ------------------------------------------------
if [ ! -d "$GL" ] || [ "$(ls "$GL"/*.deb 2>/dev/null | wc -l)" -lt 7 ]; then
  mkdir -p "$GL" /tmp/amd64/partial
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
  apt-get "${o[@]}" update -qq
  (cd "$GL" && apt-get "${o[@]}" download -qq 2>&1 libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi

# --- what a command carries --------------------------------------------------------------------------------------
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl=$(du -sb "$WHL" | cut -f1)
gl=$(du -sb "$GL" | cut -f1)
total=$((tree + whl + gl))
printf 'gpu_wheels: %s %.1f MiB (%d wheels), %s %.1f MiB, working tree %.1f MiB: %.1f MiB of the 64 MiB a command takes\n' \
  "$WHL" "$(echo "$whl / 1048576" | bc -l)" "$n" "$GL" "$(echo "$gl / 1048576" | bc -l)" \
  "$(echo "$tree / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
[ "$total" -le "$LIMIT" ] || { echo "gpu_wheels: over the 64 MiB a command may carry" >&2; exit 1; }

# --- dry run: does pip resolve the wheels for Python 3.12, with the machine's own packages? ----------------------
# stand-ins for what the machine already has (KINDS.md) and these wheels need: fetched for the check, not carried
standin=$(mktemp -d)
quiet "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$standin" numpy pyyaml cloudpickle
"$PY" -m pip install -q --dry-run --no-index --find-links "$WHL" --find-links "$standin" "${PLAT[@]}" \
  --target /tmp/gpu_wheels_dry --report "$standin/report.json" -r <(resolved)
"$PY" -m pip install -q --dry-run --no-index --no-deps --find-links "$WHL" "${PLAT[@]}" --target /tmp/gpu_wheels_dry \
  $(nodeps)
"$PY" - "$standin/report.json" "$WHL" <<'EOF'
import json, os, sys
report, whl = json.load(open(sys.argv[1])), sys.argv[2]
got = {i["metadata"]["name"].lower(): os.path.basename(i["download_info"]["url"]) for i in report["install"]}
carried = {f for f in os.listdir(whl) if f.endswith(".whl")}
outside = {n: f for n, f in got.items() if f not in carried}
assert set(outside) <= {"numpy", "pyyaml", "cloudpickle"}, f"resolved from outside {whl}: {outside}"
print(f"gpu_wheels: pip resolves {len(got) - len(outside)} carried wheels for Python 3.12 "
      f"(+ the machine's own {', '.join(sorted(outside)) or 'nothing'})")
EOF

# --- and for real, where a python3.12 is at hand: the wrapper's install, then the run's imports and one render ------
py312=${PYTHON312:-}
[ -n "$py312" ] || py312=$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)
if [ -n "$py312" ] && [ -x "$py312" ]; then
  fake=$(mktemp -d)
  # "the machine": a venv holding the stand-ins (the GPU machine's python3 is itself a venv: /opt/torch/.venv)
  "$py312" -m venv "$fake/machine"
  "$fake/machine/bin/python" -m pip install -q --no-index --find-links "$standin" numpy pyyaml cloudpickle
  GPU_VENV="$fake/venv" PYTHON="$fake/machine/bin/python" bash scripts/gpu_fleet.sh --install-only
  MUJOCO_GL=${MUJOCO_GL:-egl} "$fake/venv/bin/python" - <<'EOF'
import os, sys
sys.path.insert(0, os.getcwd())
import cryptography, google.protobuf, grpc, grpc_health.v1.health, grpc_reflection.v1alpha.reflection  # noqa: F401
import gymnasium, mujoco, numpy as np, omegaconf, opentelemetry.sdk.trace  # noqa: F401
import rlfleet.v1.env_pb2_grpc, rlfleet.v1.inference_pb2_grpc  # noqa: F401  (the generated code's version checks)
from rlfleet.wire import auth
from services.env.vec_env import VecEnv
auth.parse_credential(auth.issue(auth.new_token(), "env", 0))  # Ed25519, as every service's credential
env = VecEnv("PandaPickCubeVision-v0", 2, max_episode_steps=48, init_params={"image_size": 64}, seed=0)
obs = env.reset(seeds=[0, 1])
env.step(None, np.zeros((2, 4), np.float32))
print(f"gpu_wheels: Python {sys.version.split()[0]} with the carried wheels: imports, generated code and a "
      f"PandaPickCubeVision-v0 render ({obs['wrist'].shape}, mean {obs['wrist'].mean():.1f}) ok")
EOF
  rm -rf "$fake"
else
  echo "gpu_wheels: no python3.12 here (set PYTHON312): the real install was not tried"
fi
rm -rf "$standin" /tmp/gpu_wheels_dry
