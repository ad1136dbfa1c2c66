"""The whole fleet on one GPU machine (issue 34): real-size VLAs through every service, and how the fleet scales with cores.

    python -m benchmarks.gpu_fleet --out DIR [--budget-s 480] [--parts preflight,oft-fleet,oft-inproc,mlp,pi0-fleet]
    python -m benchmarks.gpu_fleet --cpu --out DIR      # the same parts with tiny models on the CPU (CI, the test suite)
    bash scripts/gpu_fleet.sh                           # on the GPU machine: the carried wheels, EGL, this, under $OUT

Parts, each in its own processes with a hard deadline (a part that overruns is killed and reported as such; the next
part still runs), in this order:

  preflight    the GPU (name, memory), the OpenGL renderer MuJoCo's EGL gives (vendor and renderer strings), and the
               raw simulator's env steps/s of the OFT part's envs (PandaPickCubeVision-v0, two cameras), one process
               and one per env server.
  oft-fleet    OpenVLA-OFT built from the real-size config's sizes (7.61B parameters with the value head; random
               weights, nothing is downloaded), bf16, LoRA rank 32, PPO, chunks of 8 actions, on PandaPickCubeVision-v0
               at 224 px with both cameras (third_person, wrist), through `coordinatorctl start`: 8 env servers on the
               machine's cores, the inference server and the learner sharing GPU 0 (RLinf's collocated placement,
               cluster.component_placement={'actor,rollout': 0}). Reported: env steps/s, each phase's `time/*` (the
               wire's `time/wire/*` where the run logs them), start-up, GPU memory per process and in all (nvidia-smi),
               the share of time the GPU is busy (nvidia-smi utilization.gpu, sampled every 250 ms), host memory per
               service (peak RSS) and the cores' busy share.
  oft-inproc   the same model and envs in one process, no gRPC (benchmarks/throughput.py's in-process loop: a
               RolloutWorker over all the envs and an InferenceEngine on the GPU): the design's limit on that machine.
  mlp          the default run (`bash scripts/run.sh`) with 8 env servers on the machine's cores, stopped at 95%
               evaluation success: env steps/s and time to 50/90/95% against the 2-core figures of README.md.
  pi0-fleet    π0 built from the real-size config's sizes (3.5B with the value head), bf16, full fine-tune, the same way
               as oft-fleet, when the budget has room for it (otherwise reported as skipped, with the time left).

--cpu runs every part with tiny models on the CPU (64 px, 2 env servers, 2 epochs per VLA part, a few MLP epochs, no
placement on GPUs), so that on a GPU machine only what is GPU-specific can fail. Results: DIR/gpu_fleet.json (every
number, per epoch), DIR/gpu_fleet.md (the tables) and DIR/gpu_fleet.log (this process's log with the tails of
failing services' logs). Run folders go to --work (a temporary folder by default), not to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MUJOCO_GL", "egl")

PARTS = ("preflight", "oft-fleet", "oft-inproc", "mlp", "pi0-fleet")
# seconds each part may take at most (GPU / --cpu), and the least a part needs to be started at all
CAPS = {
    "preflight": (40, 120),
    "oft-fleet": (320, 240),
    "oft-inproc": (80, 120),
    "mlp": (60, 150),
    "pi0-fleet": (240, 240),
}
MINIMUM = {"preflight": 20, "oft-fleet": 150, "oft-inproc": 40, "mlp": 40, "pi0-fleet": 150}
ENV_SERVERS = (8, 2)  # GPU / --cpu
MLP_EVAL_ENVS = 50  # the default run's env.eval.total_num_envs
EPOCHS = (4, 2)  # VLA fleet epochs (GPU / --cpu): the first carries the warm-up, the others are measured
# the 2-core CPU machine's figures of the default run (README.md, docs/benchmarks.md: seeds 1-12, sync)
TWO_CORES = {
    "to50_s": 18,
    "to50_steps": 59_000,
    "to90_s": 20,
    "to90_steps": 64_000,
    "to95_median_s": 22,
    "to95_worst_s": 27,
    "to95_median_steps": 67_000,
    "to95_worst_steps": 87_000,
    "env_steps_per_s": 3_542,
    "seed1_to95_steps": 36_000,
}
REAL = {"oft": "libero_spatial_grpo_openvla_oft", "pi0": "metaworld_mt50_ppo_pi0"}


def _pythonpath() -> str:
    """This checkout first, then whatever PYTHONPATH already holds (e.g. carried packages)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def log(msg: str) -> None:
    print(f"[gpu_fleet {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- configs ---------------------------------------------------------------------------------------------------
def _value(v) -> str:
    if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig":
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def real_sizes(family: str) -> list[str]:
    """The real-size config's architecture as overrides (actor.model.vla.* or actor.model.openpi.*)."""
    from rlfleet.config import load_config

    cfg = load_config(REAL[family])
    group = "vla" if family == "oft" else "openpi"
    sizes = dict(cfg.actor.model[group])
    if family == "oft":
        sizes["value_hidden_size"] = 1024  # the real-size OpenVLA configs' value head (PPO)
    return [f"actor.model.{group}.{k}={_value(v)}" for k, v in sizes.items()]


#: GPU memory (GiB) from which π0 is fine-tuned whole on the GPU it shares with the inference server: the estimate
#: is 66.6 GB for its learner (micro batches of 4; 66.1 GB measured on an H200) + 14.1 GB for the served copies,
#: more than an H100's ~78 GiB; below it the VLM is frozen and the action expert trains (actor.model.openpi.
#: train_expert_only: 18.8 GB + 14.1 GB)
PI0_FULL_GIB = 100


def vla_overrides(family: str, cpu: bool, fleet: bool, gpu_gib: float | None = None) -> list[str]:
    """PPO on PandaPickCubeVision-v0 with both cameras: the real-size model at 224 px (GPU) or the tiny one at 64 px
    (--cpu). ``fleet``: the fleet's placement and env servers; else one env server holding every env (in-process).
    ``gpu_gib``: the GPU's memory, which decides π0's fine-tune (:data:`PI0_FULL_GIB`)."""
    size = 64 if cpu else 224
    envs, steps = (8, 16) if cpu else (64, 16)
    servers = ENV_SERVERS[cpu] if fleet else 1
    out = [
        "env.train.env_id=PandaPickCubeVision-v0",
        "env.eval.env_id=PandaPickCubeVision-v0",
        f"env.train.init_params={{image_size: {size}}}",
        f"env.eval.init_params={{image_size: {size}}}",
        f"env.train.total_num_envs={envs}",
        "env.train.max_episode_steps=48",
        f"env.train.max_steps_per_rollout_epoch={steps}",
        "env.eval.max_episode_steps=48",
        f"env.eval.total_num_envs={servers}",
        f"env.eval.num_episodes={servers}",
        "algorithm.update_epoch=1",
        "actor.model.precision=bf16",
        "rollout.weights_precision=bf16",
        "actor.model.max_prompt_tokens=64",
        f"cluster.num_env_servers={servers}",
    ]
    if family == "oft":
        out += [
            "actor.model.model_type=openvla_oft",
            "actor.model.num_action_chunks=8",
            "actor.model.image_key=third_person",
            "actor.model.extra_image_keys=[wrist]",
            "actor.model.add_value_head=true",
            "actor.model.is_lora=true",
            "actor.model.lora_rank=32",
            "actor.model.gradient_checkpointing=true",
            "algorithm.logprob_type=token_level",
            "actor.optim.lr=2.0e-5",
            "actor.micro_batch_size=8",
            f"actor.global_batch_size={envs * steps // 8}",
        ]
    else:
        full = cpu or (gpu_gib or 0) >= PI0_FULL_GIB
        out += [
            "actor.model.model_type=openpi",
            "actor.model.num_action_chunks=8",
            "algorithm.logprob_type=chunk_level",
            "actor.optim.lr=1.0e-5",
            f"actor.micro_batch_size={8 if cpu else 4 if full else 16}",
            f"actor.global_batch_size={envs * steps // 8}",
        ]
        if not full:
            out.append("actor.model.openpi.train_expert_only=true")
    if not cpu:  # the real-size architecture first, so that the knobs above (train_expert_only) stay
        out = real_sizes(family) + out
    return out


def fleet_overrides(
    name: str, cpu: bool, log_path: pathlib.Path, budget_s: float, env_on_gpu: bool = False
) -> list[str]:
    """Run-control overrides of a fleet part: its folder, no evaluation before the end (the part is stopped after its
    last epoch's metrics, so neither the final evaluation nor the checkpoint costs its budget), GPU placement (env
    servers on no GPU, as RLinf's collocated `actor,rollout: 0`; ``env_on_gpu``: on GPU 0 too, where the preflight
    found that EGL renders only there)."""
    out = [
        f"runner.experiment_name={name}",
        f"runner.logger.log_path={log_path}",
        f"runner.max_wall_time_s={max(30, int(budget_s))}",
        "runner.save_interval=100000",
        "runner.val_check_interval=0",
        "runner.logger.logger_backends=[]",
        "cluster.rpc_timeout_s=900",
        "cluster.act_timeout_s=600",
        "cluster.startup_timeout_s=300",
        "cluster.heartbeat_timeout_s=120",
    ]
    if not cpu:  # the inference server and the learner share GPU 0; env servers render through EGL on it
        placement = "{'actor,rollout,env': 0}" if env_on_gpu else "{'actor,rollout': 0}"
        out += [
            "cluster.num_gpus_per_node=1",
            f"cluster.component_placement={placement}",
            "cluster.torch_num_threads=4",
        ]
    return out


def mlp_overrides(cpu: bool, log_path: pathlib.Path, budget_s: float) -> list[str]:
    out = [
        "runner.experiment_name=mlp",
        f"runner.logger.log_path={log_path}",
        "runner.seed=1",
        f"cluster.num_env_servers={ENV_SERVERS[cpu]}",
        "runner.early_stop_success_rate=0.95",
        "runner.early_stop_evals=1",
        f"runner.max_wall_time_s={max(20, int(budget_s) - 25)}",
        "runner.logger.logger_backends=[]",
    ]
    if cpu:  # a few epochs: the run's mechanics, not its learning
        out += [
            "runner.max_epochs=4",
            "runner.val_check_interval=2",
            "env.eval.num_episodes=8",
            "env.eval.total_num_envs=8",
        ]
    else:  # as benchmarks/time_to_success.py runs it: 100 seeded episodes every 5 epochs, on eval envs that the
        # env servers split evenly (the default's 50 over 8 servers would be refused: 56)
        servers = ENV_SERVERS[cpu]
        out += ["runner.val_check_interval=5", f"env.eval.total_num_envs={-(-MLP_EVAL_ENVS // servers) * servers}"]
    return out


# --- sampling: GPU (nvidia-smi), services' memory, the cores ----------------------------------------------------
class GpuSampler:
    """nvidia-smi's utilization.gpu and memory.used every 250 ms (one long-running nvidia-smi), and every second the
    memory each process holds on the GPU (--query-compute-apps). Nothing where nvidia-smi is absent."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), util %, memory.used MiB)
        self.apps: dict[int, float] = {}  # pid -> peak MiB
        self.available = bool(_which("nvidia-smi"))
        self._stop = threading.Event()
        self._proc = None

    def start(self) -> GpuSampler:
        if not self.available:
            return self
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._apps, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.time(), float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def _apps(self) -> None:
        while not self._stop.wait(1.0):
            for pid, mib in _gpu_processes():
                self.apps[pid] = max(self.apps.get(pid, 0.0), mib)

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def window(self, t0: float | None, t1: float | None) -> dict:
        """Mean GPU busy share and peak memory over [t0, t1] (time.time())."""
        if not self.available or t0 is None or t1 is None:
            return {}
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {}
        return {
            "gpu_busy": statistics.fmean(s[1] for s in got) / 100.0,
            "gpu_samples": len(got),
            "gpu_memory_peak_mib": max(s[2] for s in got),
        }

    def idle_memory(self) -> float | None:
        return self.samples[-1][2] if self.samples else None


def _gpu_processes() -> list[tuple[int, float]]:
    """(pid, MiB) of every process holding GPU memory: compute processes (--query-compute-apps) and, from
    `nvidia-smi -q -d PIDS`, graphics ones too (the env servers' EGL contexts)."""
    found: dict[int, float] = {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        for line in out.splitlines():
            try:
                pid, mib = (p.strip() for p in line.split(","))
                found[int(pid)] = float(mib)
            except ValueError:
                continue
        out = subprocess.run(["nvidia-smi", "-q", "-d", "PIDS"], capture_output=True, text=True, timeout=10).stdout
        pid = None
        for line in out.splitlines():
            key, _, value = (x.strip() for x in line.partition(":"))
            if key == "Process ID":
                pid = int(value) if value.isdigit() else None
            elif key == "Used GPU Memory" and pid is not None:
                mib = value.split()[0] if value else ""
                if mib.replace(".", "", 1).isdigit():
                    found[pid] = max(found.get(pid, 0.0), float(mib))
                pid = None
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return list(found.items())


def _gpu_memory_gib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split()
        return round(min(float(v) for v in out) / 1024, 1) if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _which(cmd: str) -> str | None:
    import shutil

    return shutil.which(cmd)


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            out.append(c)
            todo.append(c)
    return out


def _role(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for module, role in (
        ("services.learner.server", "learner"),
        ("services.inference.server", "inference"),
        ("services.env.server", "env"),
    ):
        if module in cmd:
            return role
    return None


def _peak_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


# --- a fleet part: coordinatorctl start, watched ----------------------------------------------------------------
def _metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def _kill_group(proc: subprocess.Popen, others: list[int] = ()) -> None:
    """SIGKILL to ``proc``'s process group and to ``others`` (the services: the local launcher starts each in a
    session of its own), then wait until they are gone, so the next part finds the GPU's memory free."""
    others = [*others, *_descendants(proc.pid)]
    for kill in [lambda: os.killpg(proc.pid, signal.SIGKILL)] + [
        (lambda p=p: os.kill(p, signal.SIGKILL)) for p in others
    ]:
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    t0 = time.time()
    while time.time() - t0 < 30 and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in others):
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _tail(path: pathlib.Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_fleet(
    name: str,
    cmd_overrides: list[str],
    work: pathlib.Path,
    deadline: float,
    gpu: GpuSampler,
    stop_after_epochs: int | None,
) -> dict:
    """`coordinatorctl start` with ``cmd_overrides`` (its own process group), watched until it ends, until
    ``stop_after_epochs`` epochs have logged their metrics (then the group is killed: the final evaluation and
    checkpoint are not measured), or until ``deadline`` (time.time(); killed, reported)."""
    part_dir = work / name
    if part_dir.exists():  # a run folder that exists would make the coordinator pick another name
        import shutil

        shutil.rmtree(part_dir)
    part_dir.mkdir(parents=True)
    run_dir = part_dir / name
    cmd = [sys.executable, "-m", "services.coordinator.cli", "start", *cmd_overrides]
    log(f"{name}: coordinatorctl start " + " ".join(cmd_overrides))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
    t_start = time.time()
    cpu0 = _cpu_times()
    out_path = part_dir / "coordinator.log"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    arrivals: dict[int, float] = {}
    status = ""
    rss: dict[int, tuple[str, float]] = {}
    roles: dict[int, str] = {}
    how = "ended by itself"
    cpu_first = None
    try:
        while True:
            alive = proc.poll() is None
            for pid in _descendants(proc.pid) if alive else []:
                role = roles.get(pid) or _role(pid)
                if role:
                    roles[pid] = role
                    peak = _peak_rss_mib(pid)
                    if peak is not None:
                        rss[pid] = (role, max(peak, rss.get(pid, (role, 0.0))[1]))
            for rec in _metrics(run_dir):
                if "time/rollout" in rec and rec.get("step") is not None and int(rec["step"]) not in arrivals:
                    arrivals[int(rec["step"])] = time.time()
                    if len(arrivals) == 1:
                        cpu_first = _cpu_times()
                    log(
                        f"{name}: epoch {int(rec['step'])} logged after {time.time() - t_start:.0f}s "
                        f"(rollout {rec.get('rollout/env_steps_per_s', 0):.1f} env steps/s, step "
                        f"{rec.get('time/step', 0):.2f}s)"
                    )
            if not alive:
                break
            if stop_after_epochs is not None and len(arrivals) >= stop_after_epochs:
                how = f"stopped after epoch {max(arrivals)}'s metrics (final evaluation and checkpoint not run)"
                status = _status(run_dir, env)
                break
            if time.time() >= deadline:
                how = f"killed at its deadline ({deadline - t_start:.0f}s) after {len(arrivals)} epoch(s)"
                break
            time.sleep(0.5)
    finally:
        cpu1 = _cpu_times()
        _kill_group(proc, list(roles))
    t_end = time.time()
    log(f"{name}: {how}; {t_end - t_start:.0f}s in all")
    text = _tail(out_path, 200_000)
    services_up = first_set = None
    for line in text.splitlines():
        up = re.search(r"services up in ([\d.]+)s(?: \(.*first weights set ([\d.]+)s\))?", line)
        if up:
            services_up = float(up.group(1))
            first_set = float(up.group(2)) if up.group(2) else None
    records = [r for r in _metrics(run_dir) if "time/rollout" in r]
    said = [
        line.split("bottleneck", 1)[1].lstrip(" :")
        for line in (status + "\n" + text).splitlines()
        if line.strip().startswith("bottleneck")
    ]
    said = [b.split("): ", 1)[1] if b.startswith("(") and "): " in b else b for b in said]  # "(last 3 epochs): ..."
    result = {
        "command": "coordinatorctl start " + " ".join(cmd_overrides),
        "how": how,
        "bottleneck": said[0] if said else None,
        "status": status,
        "wall_s": round(t_end - t_start, 1),
        "services_up_s": services_up,
        "first_weights_set_s": first_set,  # of services_up_s: the learner's first PublishWeights
        "first_epoch_logged_s": round(arrivals[min(arrivals)] - t_start, 1) if arrivals else None,
        "returncode": proc.returncode,
        "epochs": records,
        "epoch_logged_at_s": {str(k): round(v - t_start, 1) for k, v in sorted(arrivals.items())},
    }
    # the measured epochs: all but the first (its inference and update carry the warm-up), when there are two or more
    measured = records[1:] if len(records) >= 2 else records
    result["measured_epochs"] = [int(r["step"]) for r in measured]
    if measured:
        result.update(_summarise(records, measured))
    t0 = arrivals.get(min(arrivals)) if len(arrivals) >= 2 else None
    t1 = arrivals.get(max(arrivals)) if len(arrivals) >= 2 else None
    result["gpu_epochs"] = gpu.window(t0, t1)
    result["gpu_whole_part"] = gpu.window(t_start, t_end)
    result["gpu_memory_per_process_mib"] = _per_role(
        {pid: (roles.get(pid, "?"), mib) for pid, mib in gpu.apps.items() if pid in roles}
    )
    result["host_peak_rss_mib"] = _per_role(rss)
    if cpu_first is not None and t1 is not None:
        busy, total = cpu1[0] - cpu_first[0], cpu1[1] - cpu_first[1]
        result["cpu_busy_epochs"] = round(busy / total, 3) if total else None
    busy, total = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    result["cpu_busy_whole_part"] = round(busy / total, 3) if total else None
    if not records or proc.returncode not in (0, None, -9) and "stopped after" not in how:
        result["log_tail"] = _service_tails(part_dir, run_dir)
    elif len(records) < (stop_after_epochs or 0):
        result["log_tail"] = _service_tails(part_dir, run_dir)
    return result


def _status(run_dir: pathlib.Path, env: dict) -> str:
    """`coordinatorctl status RUN_DIR` of the running part (its bottleneck line among the rest), or ''."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "services.coordinator.cli", "status", str(run_dir)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _per_role(values: dict[int, tuple[str, float]]) -> dict:
    out: dict[str, dict] = {}
    for _pid, (role, mib) in values.items():
        d = out.setdefault(role, {"processes": 0, "max_mib": 0.0, "sum_mib": 0.0})
        d["processes"] += 1
        d["max_mib"] = round(max(d["max_mib"], mib), 1)
        d["sum_mib"] = round(d["sum_mib"] + mib, 1)
    return out


def _service_tails(part_dir: pathlib.Path, run_dir: pathlib.Path) -> dict:
    tails = {"coordinator": _tail(part_dir / "coordinator.log")}
    for path in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        tails[path.stem] = _tail(path, 1500)
    return tails


def _median(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def _summarise(records: list[dict], measured: list[dict]) -> dict:
    """Medians over the ``measured`` epochs: env steps/s of the rollout (`rollout/env_steps_per_s`: Collect on every
    env server, the rollout's trip to the learner included) and of the whole epoch (its env steps over `time/epoch` =
    `time/rollout` + `time/train` + `time/weight_sync`, the synchronous loop's epoch without the coordinator's few
    milliseconds), and every `time/*` key the run logged."""
    keys = sorted({k for r in measured for k in r if k.startswith("time/") and k != "time/elapsed"})
    times = {k: _median(measured, k) for k in keys}
    out: dict = {"rollout_env_steps_per_s": _median(measured, "rollout/env_steps_per_s"), "time_median_s": times}
    whole, sizes, epochs = [], [], []
    for r in measured:
        parts = [r.get(k) for k in ("time/rollout", "time/train", "time/weight_sync")]
        if all(isinstance(v, (int, float)) for v in parts) and isinstance(
            r.get("rollout/env_steps_per_s"), (int, float)
        ):
            steps = r["rollout/env_steps_per_s"] * r["time/rollout"]
            whole.append(steps / sum(parts))
            sizes.append(steps)
            epochs.append(sum(parts))
    if whole:
        out["epoch_env_steps_per_s"] = statistics.median(whole)
        out["env_steps_per_epoch"] = round(statistics.median(sizes))
        times["time/epoch"] = statistics.median(epochs)
    wire = {k: v for k, v in times.items() if k.startswith("time/wire/") and v is not None}
    if wire and times.get("time/epoch"):
        out["wire_share"] = sum(wire.values()) / times["time/epoch"]
    return out


# --- children: the preflight and the in-process loop, each in its own process --------------------------------------
def child_preflight(args) -> dict:
    """What the machine is: the GPU, versions, the OpenGL renderer an env server's MuJoCo gets, the raw simulator."""
    from rlfleet.config import load_config, to_yaml

    out: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda,
            }
    except Exception as exc:  # noqa: BLE001 - reported
        out["torch_error"] = repr(exc)
    versions = {}
    for mod in (
        "mujoco",
        "gymnasium",
        "transformers",
        "peft",
        "grpc",
        "google.protobuf",
        "omegaconf",
        "cryptography",
        "numpy",
    ):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported
            versions[mod] = f"import failed: {exc}"
    out["versions"] = versions
    out["mujoco_gl"] = os.environ.get("MUJOCO_GL")
    # rendering as an env server renders: its own process, CUDA_VISIBLE_DEVICES as the local launcher sets it for a
    # process placed on no GPU ('', the fleet parts' env servers), and, should that fail, on GPU 0
    for label, visible in (("render", ""), ("render_gpu0", "0")):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "PYTHONPATH": _pythonpath()}
        cmd = [sys.executable, "-m", "benchmarks.gpu_fleet", "--child", "render", "--child-out", "-"]
        if args.cpu:
            cmd.append("--cpu")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            out[label] = (
                json.loads(proc.stdout.strip().splitlines()[-1])
                if proc.returncode == 0
                else {"error": (proc.stdout + proc.stderr)[-1500:]}
            )
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
            out[label] = {"error": repr(exc)}
        if "error" not in out[label] or args.cpu:
            break
    rendered = out.get("render", {}) if "error" not in out.get("render", {}) else out.get("render_gpu0", {})
    out["gl_vendor"], out["gl_renderer"] = rendered.get("gl_vendor"), rendered.get("gl_renderer")
    out["first_render_s"] = rendered.get("first_render_s")
    out["env_on_gpu0"] = "error" in out.get("render", {}) and "error" not in out.get("render_gpu0", {"error": 1})
    # the raw simulator: one process per env server, each with an env server's envs, random actions
    cfg = load_config(None, vla_overrides("oft", args.cpu, fleet=True))
    n = ENV_SERVERS[args.cpu]
    per_server = cfg.env.train.total_num_envs // n
    cfg.env.train.total_num_envs = per_server
    steps = 24 if args.cpu else 48
    here = ROOT / "benchmarks" / "throughput.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0" if out["env_on_gpu0"] else "", "PYTHONPATH": _pythonpath()}
    for count in (1, n):
        procs = [
            subprocess.Popen(
                [sys.executable, str(here), "--raw", to_yaml(cfg), "--steps", str(steps)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(count)
        ]
        rates = []
        for p in procs:
            so, se = p.communicate(timeout=300)
            if p.returncode == 0:
                rates.append(float(json.loads(so.strip().splitlines()[-1])["rate"]))
            else:
                out.setdefault("raw_errors", []).append(se[-800:])
        out[f"raw_{count}_process{'es' if count > 1 else ''}"] = round(sum(rates), 1) if rates else None
    out["raw_envs_per_process"] = per_server
    return out


def child_render(args) -> dict:
    """One PandaPickCubeVision-v0 env of the OFT part (two cameras) reset and stepped here; the GL strings."""
    import numpy as np

    from rlfleet.config import load_config
    from services.env.backends import make_sim_backend

    tr = load_config(None, vla_overrides("oft", args.cpu, fleet=True)).env.train
    t0 = time.perf_counter()
    backend = make_sim_backend(tr.simulator_type, tr.env_id, 1, dict(tr.init_params))
    backend.reset(np.arange(1), [0], [None])
    out = {
        "first_render_s": round(time.perf_counter() - t0, 2),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        from OpenGL import GL

        out["gl_vendor"] = (GL.glGetString(GL.GL_VENDOR) or b"").decode()
        out["gl_renderer"] = (GL.glGetString(GL.GL_RENDERER) or b"").decode()
    except Exception as exc:  # noqa: BLE001 - the context may not be current in this thread
        out["gl_renderer"] = f"unknown ({type(exc).__name__})"
    backend.close()
    return out


def child_inproc(args) -> dict:
    """The OFT part's model and envs in one process, no gRPC (as benchmarks/throughput.py's in-process loop)."""
    import torch

    from rlfleet.config import load_config
    from rlfleet.policies import build_policy
    from rlfleet.wire.clients import LocalPolicyClient
    from rlfleet.wire.spaces import TensorSpace
    from services.env.server import build_worker
    from services.inference.server import build_engine

    torch.set_num_threads(1 if args.cpu else 4)
    dev = "cpu" if args.cpu else "cuda"
    cfg = load_config(None, vla_overrides(args.family, args.cpu, fleet=False) + ["rollout.pipeline_stage_num=1"])
    t0 = time.perf_counter()
    env, worker = build_worker(cfg, 0)
    specs = {k: TensorSpace(sp.shape, sp.dtype.name) for k, sp in env.observation_space.items()}
    adim = env.action_space.size
    engine = build_engine(cfg, dev)
    torch.manual_seed(cfg.runner.seed)
    with torch.device(dev):  # built where it acts (the learner builds on the CPU first; here that would cost minutes)
        model = build_policy(cfg.actor.model, specs, adim, cfg.algorithm.normalize_obs, cfg.algorithm.logprob_type)
        if cfg.rollout.weights_precision == "bf16":  # the served copies' dtype: half the memory of the source
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        engine.set_weights(0, model.state_dict(), obs_specs=specs, action_dim=adim)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t0
    policy = LocalPolicyClient(engine, 1, adim)
    # Collect counts policy steps (one chunk of actions each), as the coordinator asks for them
    T = cfg.env.train.max_steps_per_rollout_epoch // cfg.actor.model.num_action_chunks
    t0 = time.perf_counter()
    worker.collect(0, T, policy)  # warm-up
    warm_s = time.perf_counter() - t0
    if dev == "cuda":
        torch.cuda.synchronize()
    w0 = time.time()
    t0 = time.perf_counter()
    summaries = [worker.collect(e + 1, T, policy)[1] for e in range(args.epochs)]
    wall = time.perf_counter() - t0
    w1 = time.time()
    worker.close()
    steps = sum(s.env_steps for s in summaries)
    out = {
        "parameters": params,
        "envs": env.num_envs,
        "env_steps_per_epoch": steps / args.epochs,
        "epochs": args.epochs,
        "build_s": round(build_s, 1),
        "warmup_epoch_s": round(warm_s, 2),
        "env_steps_per_s": steps / wall,
        "epoch_s": round(wall / args.epochs, 3),
        "env_time_s": round(statistics.median(s.env_time_s for s in summaries), 3),
        "inference_time_s": round(statistics.median(s.inference_wait_s for s in summaries), 3),
        "window": [w0, w1],
        "device": dev,
    }
    if dev == "cuda":
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def run_child(kind: str, args, deadline: float, extra: list[str]) -> dict:
    """A child part in its own process group, killed at ``deadline``; -> its JSON result, or what went wrong."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-m", "benchmarks.gpu_fleet", "--child", kind, "--child-out", result_path, *extra]
    if args.cpu:
        cmd.append("--cpu")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        how = "ended by itself"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output = proc.stdout.read() if proc.stdout else ""
        how = f"killed at its deadline ({deadline - t0:.0f}s)"
    result: dict = {"how": how, "wall_s": round(time.time() - t0, 1), "returncode": proc.returncode}
    try:
        result.update(json.loads(pathlib.Path(result_path).read_text()))
    except (OSError, json.JSONDecodeError):
        result["log_tail"] = {"child": (output or "")[-3000:]}
    finally:
        pathlib.Path(result_path).unlink(missing_ok=True)
    if proc.returncode not in (0, None):
        result["log_tail"] = {"child": (output or "")[-3000:]}
    return result


# --- the parts ---------------------------------------------------------------------------------------------------
def part_fleet(family: str, args, work: pathlib.Path, deadline: float, gpu: GpuSampler) -> dict:
    name = f"{family}-fleet"
    overrides = (
        vla_overrides(family, args.cpu, fleet=True, gpu_gib=args.gpu_gib)
        + fleet_overrides(name, args.cpu, work / name, deadline - time.time(), env_on_gpu=args.env_on_gpu0)
        + [f"runner.max_epochs={EPOCHS[args.cpu]}"]
    )
    result = run_fleet(name, overrides, work, deadline, gpu, stop_after_epochs=EPOCHS[args.cpu])
    result.update(_shape(overrides))
    result["model"] = _model_line(family, args.cpu, args.gpu_gib)
    result["estimate"] = _estimate(overrides)
    return result


def _shape(overrides: list[str]) -> dict:
    from rlfleet.config import load_config

    cfg = load_config(None, overrides)
    n = cfg.cluster.num_env_servers
    return {
        "env_servers": n,
        "envs_per_server": cfg.env.train.total_num_envs // n,
        "steps_per_rollout_epoch": cfg.env.train.max_steps_per_rollout_epoch,
    }


def _model_line(family: str, cpu: bool, gpu_gib: float | None = None) -> str:
    if family == "oft":
        return (
            "OpenVLA-OFT tiny, LoRA r32, bf16, 64 px"
            if cpu
            else "OpenVLA-OFT 7.6B (random weights), LoRA r32, bf16, 224 px"
        ) + ", 2 cameras, chunks of 8"
    tune = "full fine-tune" if cpu or (gpu_gib or 0) >= PI0_FULL_GIB else "action expert trained (VLM frozen)"
    return (
        f"π0 tiny, {tune}, bf16, 64 px" if cpu else f"π0 3.5B (random weights), {tune}, bf16, 224 px"
    ) + ", 2 cameras, chunks of 8"


def _estimate(overrides: list[str]) -> dict:
    """The start-up memory check's estimates for this config: the learner's rank and one inference server (GB),
    and their sum where both share one GPU."""
    import warnings

    from rlfleet.config import load_config
    from rlfleet.policies import footprint

    cfg = load_config(None, overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp = footprint.estimate(cfg.actor.model, cfg.algorithm.logprob_type)
    learner = fp.rank_bytes(
        1,
        gpu=True,
        reference_copy=cfg.algorithm.kl_beta > 0 and not cfg.actor.model.is_lora,
        rows=cfg.actor.micro_batch_size,
    )
    inference = fp.inference_bytes(cfg.rollout.weights_precision)
    return {
        "parameters_b": round(fp.parameters / 1e9, 3),
        "trainable_b": round(fp.trainable / 1e9, 4),
        "learner_gb": round(learner / 1e9, 1),
        "inference_gb": round(inference / 1e9, 1),
        "collocated_gb": round((learner + inference) / 1e9, 1),
    }


def part_inproc(args, deadline: float, gpu: GpuSampler) -> dict:
    result = run_child("inproc", args, deadline, ["--family", "oft", "--epochs", str(EPOCHS[args.cpu] - 1)])
    window = result.pop("window", None)
    if window:
        result["gpu_epochs"] = gpu.window(*window)
    result["model"] = _model_line("oft", args.cpu)
    return result


def part_mlp(args, work: pathlib.Path, deadline: float, gpu: GpuSampler) -> dict:
    from benchmarks.time_to_success import hits

    overrides = mlp_overrides(args.cpu, work / "mlp", deadline - time.time())
    result = run_fleet("mlp", overrides, work, deadline, gpu, stop_after_epochs=None)
    result.update(_shape(overrides))
    run_dir = work / "mlp" / "mlp"
    h = hits(run_dir) if run_dir.is_dir() else {}
    result["time_to"] = {
        f"{int(th * 100)}%": {"epoch": v[0], "env_steps": v[1], "wall_s": round(v[2], 1), "train_s": round(v[3], 1)}
        for th, v in h.items()
        if isinstance(th, float)
    }
    result["whole_loop_env_steps_per_s"] = h.get("rate")
    result["final_eval"] = h.get("final")
    result["model"] = "MLP 128x128 (the default run), CPU"
    return result


# --- the report --------------------------------------------------------------------------------------------------
def _f(v, fmt: str = "{:,.0f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _gib(mib) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def table(report: dict) -> str:
    parts, pre = report["parts"], report["parts"].get("preflight", {})
    raw_n = f"raw_{ENV_SERVERS[report['cpu']]}_processes"
    gpu = pre.get("gpu") or {}
    where = (
        f"{gpu.get('name', '?')} ({gpu.get('memory_gib', '?')} GiB), {pre.get('cpus')} cores"
        if gpu
        else f"CPU only, {pre.get('cpus', os.cpu_count())} cores"
    )
    lines = [
        f"# The fleet on one machine: {where}",
        "",
        f"{report['mode']} mode, {report['date']}; python {pre.get('python', '?')}, torch {pre.get('torch', '?')}; "
        f"MuJoCo GL {pre.get('mujoco_gl', '?')}: {pre.get('gl_renderer', '?')}"
        + (f" ({pre.get('gl_vendor')})" if pre.get("gl_vendor") else "")
        + "; "
        f"raw simulator (PandaPickCubeVision-v0, two cameras, {pre.get('raw_envs_per_process', '?')} envs per "
        f"process): {_f(pre.get('raw_1_process'))} env steps/s in 1 process, "
        f"{_f(pre.get(raw_n))} in {ENV_SERVERS[report['cpu']]}.",
        "",
    ]
    lines += [
        "| part | model | where | env servers x envs | steps measured | env steps/s (rollout) | "
        "env steps/s (whole epoch) | services up (s) | first epoch logged (s) | GPU busy (epochs) | "
        "GPU memory peak, GiB (learner / inference / env servers / all) | host peak RSS, GiB (learner / inference / "
        "env server) | ended |",
        "|" + "---|" * 13,
    ]
    for name in ("oft-fleet", "oft-inproc", "pi0-fleet", "mlp"):
        r = parts.get(name)
        if r is None:
            continue
        if r.get("skipped"):
            lines.append(f"| {name} | {r.get('model', '')} | | | | | | | | | | | skipped: {r['skipped']} |")
            continue
        if name == "oft-inproc":
            g = r.get("gpu_epochs") or {}
            lines.append(
                f"| {name} | {r.get('model', '')} | one process, no gRPC ({r.get('device', '?')}) | 1 x "
                f"{r.get('envs', '?')} | {r.get('epochs', '-')} | {_f(r.get('env_steps_per_s'), '{:,.1f}')} | - | "
                f"{_f(r.get('build_s'), '{:.0f}')} (build) | {_f(r.get('warmup_epoch_s'), '{:.1f}')} (warm-up) | "
                f"{_f(g.get('gpu_busy'), '{:.0%}')} | {_f(r.get('max_memory_allocated_gib'), '{:.1f}')} "
                f"(max_memory_allocated) | - | {r.get('how', '')}, {_f(r.get('wall_s'), '{:.0f}')} s |"
            )
            continue
        g = r.get("gpu_epochs") or {}
        gm = r.get("gpu_memory_per_process_mib") or {}
        rss = r.get("host_peak_rss_mib") or {}
        shape = f"{r.get('env_servers', '?')} x {r.get('envs_per_server', '?')}"
        placement = (
            "CPU"
            if report["cpu"] or name == "mlp"
            else "actor,rollout,env: GPU 0"
            if pre.get("env_on_gpu0")
            else "actor,rollout: GPU 0; env: CPU + EGL"
        )
        epochs = r.get("measured_epochs") or []
        lines.append(
            f"| {name} | {r.get('model', '')} | {placement} | {shape} | "
            f"{(f'{epochs[0]}-{epochs[-1]}' if len(epochs) > 1 else (str(epochs[0]) if epochs else 'none'))} | "
            f"{_f(r.get('rollout_env_steps_per_s'), '{:,.1f}')} | {_f(r.get('epoch_env_steps_per_s'), '{:,.1f}')} | "
            f"{_f(r.get('services_up_s'), '{:.0f}')}{_f(r.get('first_weights_set_s'), ' (first weights set {:.0f})', '')} | {_f(r.get('first_epoch_logged_s'), '{:.0f}')} | "
            f"{_f(g.get('gpu_busy'), '{:.0%}')} | {_gib(gm.get('learner', {}).get('max_mib'))} / "
            f"{_gib(gm.get('inference', {}).get('max_mib'))} / {_gib(gm.get('env', {}).get('sum_mib'))} / "
            f"{_gib((r.get('gpu_whole_part') or {}).get('gpu_memory_peak_mib'))} | "
            f"{_gib(rss.get('learner', {}).get('max_mib'))} / {_gib(rss.get('inference', {}).get('max_mib'))} / "
            f"{_gib(rss.get('env', {}).get('max_mib'))} | {r.get('how', '')}, {_f(r.get('wall_s'), '{:.0f}')} s"
            + (" (failed: see gpu_fleet.json log_tail)" if r.get("log_tail") else "")
            + " |"
        )
    # phase times
    keys = sorted({k for r in parts.values() if isinstance(r, dict) for k in (r.get("time_median_s") or {})})
    if keys:
        lines += [
            "",
            "Phase times, median seconds per measured epoch (`time/*` of metrics.jsonl; `time/epoch`: "
            "`time/rollout` + `time/train` + `time/weight_sync`; wire share: the `time/wire/*` seconds over "
            "`time/epoch`, where the run logs them; its act seconds are partly on gRPC threads, overlapping):",
            "",
            "| part | " + " | ".join(f"`{k}`" for k in keys) + " | wire share |",
            "|" + "---|" * (len(keys) + 2),
        ]
        for name in ("oft-fleet", "pi0-fleet", "mlp"):
            r = parts.get(name) or {}
            t = r.get("time_median_s") or {}
            if not t:
                continue
            lines.append(
                f"| {name} | "
                + " | ".join(_f(t.get(k), "{:.3f}") for k in keys)
                + " | "
                + _f(r.get("wire_share"), "{:.0%}", "not logged")
                + " |"
            )
    said = [
        (n, parts[n]["bottleneck"]) for n in ("oft-fleet", "pi0-fleet", "mlp") if (parts.get(n) or {}).get("bottleneck")
    ]
    if said:
        lines += ["", "The run's own bottleneck line (`coordinatorctl status`, at the last measured epoch):", ""]
        lines += [f"- {n}: {b}" for n, b in said]
    inproc, fleet = parts.get("oft-inproc") or {}, parts.get("oft-fleet") or {}
    if inproc.get("env_steps_per_s") and fleet.get("rollout_env_steps_per_s"):
        lines += [
            "",
            f"oft-fleet's rollout / the in-process loop: "
            f"{fleet['rollout_env_steps_per_s'] / inproc['env_steps_per_s']:.2f}x "
            f"(in-process: env {inproc.get('env_time_s')} s + inference {inproc.get('inference_time_s')} s "
            f"per epoch).",
        ]
    est = [(n, parts[n]["estimate"]) for n in ("oft-fleet", "pi0-fleet") if (parts.get(n) or {}).get("estimate")]
    if est:
        lines += [
            "",
            "Memory check's estimates (GB): "
            + "; ".join(
                f"{n}: {e['parameters_b']}B parameters ({e['trainable_b']}B trained), learner {e['learner_gb']}, "
                f"inference server {e['inference_gb']}, both on one GPU {e['collocated_gb']}"
                for n, e in est
            )
            + ".",
        ]
    mlp = parts.get("mlp") or {}
    if mlp and not mlp.get("skipped"):
        tt = mlp.get("time_to") or {}

        def cell(th: str) -> str:
            v = tt.get(th)
            return f"{v['train_s']:.0f} / {v['env_steps'] / 1000:.0f}k" if v else "not reached"

        two = TWO_CORES
        lines += [
            "",
            "The default MLP run, seed 1 (training seconds without evaluations / env steps):",
            "",
            "| machine | env servers | to 50% | to 90% | to 95% | whole loop env steps/s |",
            "|---|---|---|---|---|---|",
            f"| this one ({pre.get('cpus', '?')} cores) | {ENV_SERVERS[report['cpu']]} | {cell('50%')} | "
            f"{cell('90%')} | {cell('95%')} | {_f(mlp.get('whole_loop_env_steps_per_s'))} |",
            f"| the 2-core CPU machine (README: seeds 1-12, median; seed 1 reached 95% at "
            f"{two['seed1_to95_steps'] // 1000}k) | 1 | {two['to50_s']} / {two['to50_steps'] // 1000}k | "
            f"{two['to90_s']} / {two['to90_steps'] // 1000}k | {two['to95_median_s']} / "
            f"{two['to95_median_steps'] // 1000}k (worst {two['to95_worst_s']}) | {two['env_steps_per_s']:,} |",
        ]
    skipped = [f"{n}: {r['skipped']}" for n, r in parts.items() if isinstance(r, dict) and r.get("skipped")]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_fleet_out", help="results folder")
    ap.add_argument("--work", default=None, help="run folders (default: a temporary folder)")
    ap.add_argument("--cpu", action="store_true", help="tiny models on the CPU (CI)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for every part together (default: 480 on a GPU, 420 with --cpu)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--family", default="oft", help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.env_on_gpu0 = False  # the preflight sets it where EGL renders only with the GPU visible
    args.gpu_gib = None  # and the GPU's memory (π0's variant)
    if args.child:
        result = {"preflight": child_preflight, "inproc": child_inproc, "render": child_render}[args.child](args)
        if args.child_out == "-":
            print(json.dumps(result), flush=True)
        else:
            pathlib.Path(args.child_out).write_text(json.dumps(result))
        return 0
    t_begin = time.time()
    budget = args.budget_s or (420.0 if args.cpu else 480.0)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        ap.error(f"--parts: {unknown} not in {list(PARTS)}")
    if not args.cpu and not _which("nvidia-smi"):
        print(
            "gpu_fleet: no nvidia-smi here: run on a GPU machine, or with --cpu (tiny models on the CPU)",
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="gpu_fleet_"))
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "mode": "cpu" if args.cpu else "gpu",
        "cpu": bool(args.cpu),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "budget_s": budget,
        "parts": {},
        "host": platform.node(),
    }
    gpu = GpuSampler().start()
    if not args.cpu and args.gpu_gib is None:  # the preflight says it too; a call without the preflight asks here
        args.gpu_gib = _gpu_memory_gib()
    report["gpu_memory_idle_mib"] = None
    deadline_all = t_begin + budget

    def save() -> None:
        report["elapsed_s"] = round(time.time() - t_begin, 1)
        (out / "gpu_fleet.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_fleet.md").write_text(table(report))

    try:
        for name in [p for p in PARTS if p in wanted]:
            left = deadline_all - time.time()
            cap = CAPS[name][args.cpu]
            # leave the parts after this one their minimum (π0 comes last and takes what is left)
            reserve = sum(MINIMUM[p] for p in PARTS[PARTS.index(name) + 1 :] if p in wanted and p != "pi0-fleet")
            allowed = min(cap, left - reserve) if name != "pi0-fleet" else min(cap, left)
            if allowed < MINIMUM[name]:
                report["parts"][name] = {
                    "skipped": f"{left:.0f}s of the budget left, it needs {MINIMUM[name]}s",
                    "model": _model_line("pi0", args.cpu, args.gpu_gib) if name == "pi0-fleet" else "",
                }
                log(f"{name}: skipped ({report['parts'][name]['skipped']})")
                save()
                continue
            deadline = time.time() + allowed
            log(f"{name}: up to {allowed:.0f}s ({left:.0f}s of the budget left)")
            try:
                if name == "preflight":
                    result = run_child("preflight", args, deadline, [])
                    args.env_on_gpu0 = bool(result.get("env_on_gpu0"))
                    args.gpu_gib = (result.get("gpu") or {}).get("memory_gib")
                    if gpu.available:
                        time.sleep(1.0)
                        report["gpu_memory_idle_mib"] = gpu.idle_memory()
                elif name == "oft-fleet":
                    result = part_fleet("oft", args, work, deadline, gpu)
                elif name == "oft-inproc":
                    result = part_inproc(args, deadline, gpu)
                elif name == "mlp":
                    result = part_mlp(args, work, deadline, gpu)
                else:
                    result = part_fleet("pi0", args, work, deadline, gpu)
            except Exception as exc:  # noqa: BLE001 - one part's failure is reported; the others still run
                import traceback

                result = {"how": f"failed: {exc!r}", "log_tail": {"gpu_fleet": traceback.format_exc()[-3000:]}}
            report["parts"][name] = result
            for k, v in (result.get("log_tail") or {}).items():
                log(f"{name}: --- tail of {k} ---\n{v}")
            save()
    finally:
        gpu.stop()
        save()
    print(table(report), flush=True)
    failed = [n for n, r in report["parts"].items() if r.get("log_tail")]
    log(
        f"done in {time.time() - t_begin:.0f}s; results in {out}/gpu_fleet.json and gpu_fleet.md"
        + (f"; failed or incomplete: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
