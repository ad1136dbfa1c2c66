#!/usr/bin/env bash
# End to end with Docker: generate the compose deployment of a run with `coordinatorctl deploy compose`, build the
# rlfleet image from deploy/Dockerfile, run it with docker-compose, watch it with `coordinatorctl status`, and
# print the run's result and timings. Opt-in (not part of CI: a fresh machine spends ~15 minutes building).
#
#   sudo bash benchmarks/compose_e2e.sh [key=value ...]     # overrides for the run (default: the embedded config)
#
# On a normal machine with a Docker daemon and registry access it uses python:3.11-slim-bookworm and PyTorch's CPU
# wheel index. On a machine without a registry (this project's dev machine; ../shared/design.md section 10) set
# RLFLEET_OFFLINE_BASE=1: it installs docker.io/docker-compose/debootstrap, starts its own dockerd, builds a Debian
# base with debootstrap, copies the host's CA certificates in, and serves the host's local wheels to the build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-deploy/generated/compose-e2e}
TAG=e2e
t_start=$(date +%s)
say() { echo "[compose-e2e $(( $(date +%s) - t_start ))s] $*"; }

if [ "${RLFLEET_OFFLINE_BASE:-0}" = 1 ]; then
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
    say "apt-get install docker.io docker-compose debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
  fi
  export DOCKER_HOST=unix:///run/rlfleet-docker.sock
  if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (log /tmp/rlfleet-dockerd.log)"
    mkdir -p /var/lib/rlfleet-docker /run/rlfleet-docker
    nohup dockerd --storage-driver=overlay2 --iptables=false --ip6tables=false --bridge=none \
      --data-root /var/lib/rlfleet-docker --exec-root /run/rlfleet-docker -H "$DOCKER_HOST" \
      >/tmp/rlfleet-dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  export DOCKER_BUILDKIT=0
  BASE=rlfleet-base/python:3.11-bookworm
  if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    if ! docker image inspect rlfleet-base/debian:bookworm >/dev/null 2>&1; then
      say "debootstrap a Debian bookworm base (a few minutes)"
      rootfs=$(mktemp -d)
      mirror=$(grep -h -m1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}')
      debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/tmp/rlfleet-debootstrap.log
      tar -C "$rootfs" -c . | docker import - rlfleet-base/debian:bookworm >/dev/null
      rm -rf "$rootfs"
    fi
    say "building the Python base image"
    ctx=$(mktemp -d)
    cp /usr/local/share/ca-certificates/*.crt "$ctx/" 2>/dev/null || true
    cat >"$ctx/Dockerfile" <<'EOF'
FROM rlfleet-base/debian:bookworm
COPY *.crt /usr/local/share/ca-certificates/
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
 && update-ca-certificates && rm -rf /var/lib/apt/lists/*
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
EOF
    touch "$ctx/none.crt"
    docker build --network host -q -t "$BASE" "$ctx" >/dev/null
    rm -rf "$ctx"
  fi
  # the host's wheels (torch CPU) served to the build on loopback
  find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
  if [ -n "$find_links" ]; then
    python3 -m http.server 8765 --bind 127.0.0.1 --directory "$find_links" >/dev/null 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    WHEELS=http://127.0.0.1:8765/
  fi
  [ -n "${WHEELS:-}" ] || { echo "no local wheel folder (pip find-links) to serve torch's CPU wheel from" >&2; exit 1; }
  # PyTorch's wheel index is not reachable here: torch comes from the served folder
  BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE" --build-arg "PIP_FIND_LINKS=$WHEELS" --build-arg "TORCH_INDEX_URL=")
else
  BUILD_ARGS=()
fi

say "coordinatorctl deploy compose -> $OUT"
rm -rf "$OUT"
.venv/bin/coordinatorctl deploy compose "runner.experiment_name=compose_e2e" "cluster.num_env_servers=2" \
  "runner.early_stop_success_rate=0.95" "runner.early_stop_evals=1" "$@" --out "$OUT" --tag "$TAG" >/dev/null

say "docker build rlfleet:$TAG (deploy/Dockerfile, target rlfleet)"
t0=$(date +%s)
docker build --network host -q -f deploy/Dockerfile --target rlfleet -t "rlfleet:$TAG" "${BUILD_ARGS[@]}" . >/dev/null
build_s=$(( $(date +%s) - t0 ))
say "image built in ${build_s}s ($(docker image inspect "rlfleet:$TAG" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}'))"

cd "$OUT"
token=$(sed -n 's/^RLFLEET_RUN_TOKEN=//p' rlfleet.env)
say "docker-compose up (logs: $OUT/compose.log)"
t0=$(date +%s)
# No --abort-on-container-exit: the run is over when the coordinator exits, and then every service leaves by itself
# (its heartbeats say so). Aborting on the first exit (an env server) would SIGTERM the coordinator and the learner's
# ranks while they finish. Anything still up GRACE_S after the coordinator exited is stopped (its exit code below).
docker-compose up --no-build >compose.log 2>&1 &
up=$!
GRACE_S=${GRACE_S:-60}
coord="" coord_done=""
# coordinatorctl status against the deployment, from the host, with the run credential
seen=0
while kill -0 $up 2>/dev/null; do
  sleep 10
  if RLFLEET_RUN_TOKEN=$token "$ROOT/.venv/bin/coordinatorctl" status --address 127.0.0.1:50051 >status.txt 2>&1; then
    [ $seen = 0 ] && { say "coordinatorctl status --address 127.0.0.1:50051:"; cat status.txt; }
    seen=1
  fi
  [ -n "$coord" ] || coord=$(docker-compose ps -q coordinator 2>/dev/null || true)
  if [ -n "$coord" ] && [ "$(docker inspect -f '{{.State.Status}}' "$coord" 2>/dev/null)" = exited ]; then
    coord_done=${coord_done:-$(date +%s)}
    if [ $(( $(date +%s) - coord_done )) -ge "$GRACE_S" ]; then
      say "services still up ${GRACE_S}s after the coordinator exited: stopping them"
      docker-compose stop -t 10 >/dev/null 2>&1 || true
    fi
  fi
done
wait $up || true
run_s=$(( $(date +%s) - t0 ))
[ -n "$coord" ] || coord=$(docker-compose ps -q coordinator 2>/dev/null || true)
code=$( { [ -n "$coord" ] && docker inspect -f '{{.State.ExitCode}}' "$coord"; } || echo 1)
say "compose run finished in ${run_s}s; containers' exit codes:"
for id in $(docker-compose ps -q); do docker inspect -f '  {{.Name}} {{.State.ExitCode}}' "$id" | sed 's#  /#  #'; done
docker-compose down -v >/dev/null 2>&1 || true
grep -E "final evaluation|epochs,|eval @" compose.log | sed 's/^/  /' | tail -8
"$ROOT/.venv/bin/python" - "$PWD/runs/compose_e2e" <<'EOF'
import json, pathlib, sys

import yaml

run = pathlib.Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
cluster = yaml.safe_load((run / "config.yaml").read_text())["cluster"]
# the learner's rank count as it reported it (train/learner_ranks); else the config's (CPU ranks)
ranks = s.get("last_train_metrics", {}).get("train/learner_ranks")
if ranks is None and (run / "metrics.jsonl").exists():
    for line in (run / "metrics.jsonl").read_text().splitlines():
        ranks = json.loads(line).get("train/learner_ranks", ranks)
ranks = int(ranks if ranks is not None else cluster["learner_world_size"])
print("| deployment | learner ranks | eval success_once | epochs | env steps | train wall (s) |")
print("|---|---|---|---|---|---|")
print(f"| compose, {cluster['num_env_servers']} env servers | {ranks} | {s['final_eval']['eval/success_once']:.0%} | "
      f"{s['epochs']} | {s['env_steps']} | {s['train_wall_time_s']:.0f} |")
EOF
[ $seen = 1 ] || { echo "coordinatorctl status never answered"; exit 1; }
exit $code
