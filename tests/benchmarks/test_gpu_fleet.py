"""benchmarks/gpu_fleet.py, the GPU run of issue 34: its CPU mode end to end (tiny models, so that a GPU call can fail
only on what is GPU-specific), and the real-size configs it starts on a GPU, checked here without one."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_fleet  # noqa: E402


@pytest.mark.slow
def test_cpu_mode_runs_every_part_and_writes_the_tables(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_fleet", "--cpu", "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_fleet.json").read_text())
    table = (out / "gpu_fleet.md").read_text()
    parts = report["parts"]
    assert report["mode"] == "cpu" and list(parts) == list(gpu_fleet.PARTS)
    pre = parts["preflight"]
    assert pre["gl_renderer"] and pre["raw_1_process"] > 0 and pre["raw_2_processes"] > 0
    for name in ("oft-fleet", "pi0-fleet"):
        r = parts[name]
        assert "log_tail" not in r, r.get("log_tail")
        assert [int(e["step"]) for e in r["epochs"]] == [1, 2] and r["measured_epochs"] == [2]
        assert r["how"].startswith("stopped after epoch 2's metrics")
        assert r["rollout_env_steps_per_s"] > 0 and r["epoch_env_steps_per_s"] > 0
        assert {
            "time/rollout",
            "time/env",
            "time/inference_wait",
            "time/train",
            "time/weight_sync",
            "time/epoch",
        } <= set(r["time_median_s"])
        assert r["env_servers"] == 2 and r["envs_per_server"] == 4
        assert {role: d["processes"] for role, d in r["host_peak_rss_mib"].items()} == {
            "learner": 1,
            "inference": 1,
            "env": 2,
        }
        assert r["services_up_s"] > 0 and r["first_epoch_logged_s"] >= r["services_up_s"]
        assert 0 <= r["first_weights_set_s"] < r["services_up_s"]  # the coordinator's split of the start-up
        assert f"| {name} | {r['model']} | CPU | 2 x 4 | 2 | " in table
    inproc = parts["oft-inproc"]
    assert inproc["env_steps_per_s"] > 0 and inproc["env_steps_per_epoch"] == 128  # 8 envs x 16 steps
    assert "| oft-inproc | " in table and "oft-fleet's rollout / the in-process loop: " in table
    mlp = parts["mlp"]
    assert "log_tail" not in mlp and mlp["how"] == "ended by itself" and len(mlp["epochs"]) == 4
    assert mlp["whole_loop_env_steps_per_s"] > 0 and mlp["final_eval"] is not None
    assert "| mlp | MLP 128x128 (the default run), CPU | CPU | 2 x 32 | 2-4 | " in table
    assert "| the 2-core CPU machine (README" in table
    assert "| part | `time/env` | `time/epoch` | " in table


def test_the_gpu_configs_are_valid_and_their_memory_fits_one_gpu(monkeypatch, tmp_path):
    """What the GPU mode starts, checked without a GPU: the real-size configs with RLinf's collocated placement on one
    GPU pass validation and the start-up memory check, and by the same estimates the learner and the inference
    server's copies together fit the GPU they share: an H100 (~78 GiB usable; π0's action expert trains, the VLM
    frozen) and an H200 (~139 GiB; π0 fine-tuned whole)."""
    from rlfleet.config import fit, load_config
    from rlfleet.policies import footprint

    sizes = {"oft": (7.5, 7.7), "pi0": (3.4, 3.6)}
    for gpu_gib, usable in ((79.6, 78), (139.8, 139)):
        monkeypatch.setattr(footprint, "available_memory", lambda g=gpu_gib: ("the smallest of 1 GPU(s)", g * 2**30))
        for family in ("oft", "pi0"):
            overrides = (
                gpu_fleet.vla_overrides(family, False, fleet=True, gpu_gib=gpu_gib)
                + gpu_fleet.fleet_overrides(f"{family}-fleet", False, tmp_path, 300)
                + ["runner.max_epochs=4"]
            )
            cfg = load_config(None, overrides)
            assert cfg.cluster.component_placement == {"actor,rollout": 0}
            assert cfg.env.train.init_params.image_size == 224 and cfg.actor.model.precision == "bf16"
            assert fit.check(cfg) is None
            est = gpu_fleet._estimate(overrides)
            low, high = sizes[family]
            assert low <= est["parameters_b"] <= high, est
            assert est["collocated_gb"] <= usable * 2**30 / 1e9 - 4, (gpu_gib, family, est)  # contexts, EGL
            if family == "pi0":
                assert cfg.actor.model.openpi.train_expert_only == (gpu_gib < gpu_fleet.PI0_FULL_GIB)
    mlp = load_config(None, gpu_fleet.mlp_overrides(False, tmp_path, 300))  # 8 env servers: eval envs split evenly
    assert mlp.cluster.num_env_servers == 8 and mlp.env.eval.total_num_envs == 56
    assert gpu_fleet.MLP_EVAL_ENVS == load_config(None, []).env.eval.total_num_envs
    oft = load_config(None, gpu_fleet.vla_overrides("oft", False, fleet=True))
    assert (oft.actor.model.is_lora, oft.actor.model.lora_rank, list(oft.actor.model.extra_image_keys)) == (
        True,
        32,
        ["wrist"],
    )
    assert oft.actor.model.vla.llm_layers == 32 and oft.actor.model.vla.use_dinov2
    assert (
        gpu_fleet.fleet_overrides("x", False, tmp_path, 60, env_on_gpu=True)[-2]
        == "cluster.component_placement={'actor,rollout,env': 0}"
    )


def test_weights_streams_get_the_publish_deadline(tmp_path):
    """A real-size first weights set takes minutes: each UpdateWeights stream gets the coordinator's PublishWeights
    deadline, max(120 s, cluster.rpc_timeout_s), not a fixed 120 s."""
    from rlfleet.config import load_config
    from rlfleet.config.views import learner_view
    from services.learner.learner import Learner

    for value, expected in ((60, 120.0), (900, 900.0)):
        learner = Learner(learner_view(load_config(None, [f"cluster.rpc_timeout_s={value}"])), tmp_path / str(value))
        try:
            assert learner.publisher.timeout == expected
        finally:
            learner.close()


FAKE_NVIDIA_SMI = r"""
# a stand-in for nvidia-smi: the outputs of the queries benchmarks/gpu_fleet.py makes
import os, sys, time
args = " ".join(sys.argv[1:])


def pids(module):
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                if module in open(f"/proc/{e}/cmdline", "rb").read().decode(errors="replace"):
                    out.append(int(e))
            except OSError:
                pass
    return out


if "utilization.gpu" in args and "-lms" in args:
    i = 0
    while True:
        print(f"{40 + i % 20}, {20000 + 10 * i}", flush=True)
        i += 1
        time.sleep(0.25)
elif "--query-compute-apps" in args:
    for p in pids("services.learner.server"):
        print(f"{p}, 36000")
    for p in pids("services.inference.server"):
        print(f"{p}, 31000")
elif "-q" in args and "PIDS" in args:
    print("==============NVSMI LOG==============\n\nGPU 00000000:00:07.0\n    Processes")
    for p in pids("services.env.server"):
        print(f"        GPU instance ID                   : N/A\n        Process ID                        : {p}\n"
              f"            Type                          : G\n            Name                          : python\n"
              f"            Used GPU Memory               : 420 MiB")
elif "memory.total" in args:
    print("NVIDIA H100 80GB HBM3, 81559, 580.159.04" if "name" in args else "81559")
else:
    sys.exit(f"stand-in nvidia-smi: {args}")
"""


def test_gpu_sampling_reads_nvidia_smi(tmp_path, monkeypatch):
    """The GPU-only readings, through a stand-in nvidia-smi answering the queries the GPU run makes: utilization
    and memory every 250 ms, each process's memory (compute processes, and the env servers' EGL contexts from
    `-q -d PIDS`) attributed to its service, and the GPU's memory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    learner = subprocess.Popen([*sleeper, "services.learner.server"])
    env = subprocess.Popen([*sleeper, "services.env.server"])
    sampler = gpu_fleet.GpuSampler()
    try:
        assert sampler.available
        sampler.start()
        t0 = time.time()
        time.sleep(3.0)
        window = sampler.window(t0, time.time())
        assert gpu_fleet._role(learner.pid) == "learner" and gpu_fleet._role(env.pid) == "env"
    finally:
        sampler.stop()
        for proc in (learner, env):
            proc.kill()
            proc.wait()
    assert window["gpu_samples"] >= 4 and 0.4 <= window["gpu_busy"] <= 0.6 and window["gpu_memory_peak_mib"] >= 20000
    assert sampler.apps[learner.pid] == 36000 and sampler.apps[env.pid] == 420
    assert gpu_fleet._gpu_memory_gib() == 79.6
