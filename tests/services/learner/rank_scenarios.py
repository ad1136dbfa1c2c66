"""Learner scenarios that the rank-group tests run under torchrun (real processes, a real gloo group):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/services/learner/rank_scenarios.py \
        SCENARIO OUT_DIR [key=value ...]

Every rank builds the same learner; rank 0 drives it (set-up, rollouts, updates, checkpoints) and the other ranks
follow its commands, exactly as the learner server does. Rank 0 writes what the test compares into OUT_DIR:
``state.safetensors`` (the gathered policy), ``result.json`` (metrics, per-rank memory).

Scenarios: ``update`` (EPOCHS updates on fixed rollouts), ``save`` (EPOCHS updates, then a checkpoint),
``resume`` (resume from RESUME_DIR's last checkpoint, then the remaining updates), ``idle`` (set up, write
OUT_DIR/ready, sleep SLEEP seconds: the fault tests kill a rank meanwhile).
Options: model=mlp|oft_lora|pi0|pi0_real, float64=1, no_sync=1 (gradient synchronisation off: must break equivalence),
envs=N, epochs=K, resume=DIR, hb=SECONDS (heartbeat timeout), sleep=SECONDS, act_device=cuda (act for the rollouts on the GPU), act_as_learner=1 (the acting copy
has the learner's weights: the log-probs the update recomputes match the acting ones), save_state=0, export=1 (Learner.export to OUT_DIR/export), measure_cuda=1 (the GPU test set:
torch.cuda.max_memory_allocated and the memory check's estimate), any dotted key=value (a config override).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
torch.set_num_threads(1)

from rlfleet.config import load_config  # noqa: E402
from rlfleet.config.views import learner_view  # noqa: E402
from rlfleet.policies import build_policy  # noqa: E402
from rlfleet.wire import codec  # noqa: E402
from rlfleet.wire.codec import EpisodeStat  # noqa: E402
from rlfleet.wire.service import exit_after  # noqa: E402
from rlfleet.wire.spaces import TensorSpace  # noqa: E402
from services.learner import learner as learner_module  # noqa: E402
from services.learner import sharding  # noqa: E402
from services.learner.group import RankGroup  # noqa: E402
from services.learner.learner import Learner  # noqa: E402

IMAGE = TensorSpace((32, 32, 3), "uint8")
MODELS = {
    # the default run's MLP PPO on PandaPickCube's state; an uneven number of envs splits 3 / 2
    "mlp": (
        None,
        [
            "actor.model.hidden_dims=[32,32]",
            "actor.micro_batch_size=4",
            "actor.global_batch_size=16",
            "algorithm.update_epoch=2",
        ],
        {"state": TensorSpace((13,), "float32")},
        4,
    ),
    # OpenVLA-OFT GRPO with LoRA (groups of 2 envs never split), token-level log-probs
    "oft_lora": (
        "pandapickcube_vision_grpo_openvla_oft_tiny",
        [
            "actor.model.vla.image_size=32",
            "actor.model.lora_rank=4",
            "algorithm.group_size=2",
            "algorithm.filter_rewards=null",
            "actor.micro_batch_size=4",
            "actor.global_batch_size=8",
            "algorithm.update_epoch=1",
            "actor.model.num_action_chunks=2",
        ],
        {"third_person": IMAGE, "state": TensorSpace((7,), "float32")},
        4,
    ),
    # π0 (Flow-SDE) PPO with a value head, chunk-level log-probs
    "pi0": (
        "metaworld_mt10_ppo_pi0_tiny",
        [
            "actor.micro_batch_size=4",
            "actor.global_batch_size=8",
            "algorithm.update_epoch=1",
            "actor.model.num_action_chunks=2",
        ],
        {"corner": IMAGE, "state": TensorSpace((4,), "float32")},
        4,
    ),
    # the real-size π0 (PaliGemma 3B + the 300M action expert, bf16 autocast): the GPU test set's full fine-tune
    "pi0_real": (
        "metaworld_mt50_ppo_pi0",
        ["actor.micro_batch_size=4", "actor.global_batch_size=8", "algorithm.update_epoch=1"],
        {"corner": TensorSpace((224, 224, 3), "uint8"), "state": TensorSpace((49,), "float32")},
        4,
    ),
}


def config(model: str, out: pathlib.Path, extra: list[str]):
    name, overrides, specs, action_dim = MODELS[model]
    cfg = load_config(
        name,
        [
            *overrides,
            "runner.save_interval=1000",
            f"runner.logger.log_path={out}",
            "actor.model.precision=fp32",
            "cluster.learner_num_threads=1",
            *extra,
        ],
    )
    return cfg, specs, action_dim


def rollout(cfg, specs: dict, action_dim: int, T: int, N: int, seed: int, device: str = "cpu", weights=None):
    """A fixed rollout made by acting with a plain (unsharded) copy of the policy: real forward inputs. ``device``
    cuda builds and runs that copy on the GPU (the real-size models, too slow to act with on a CPU); ``weights``
    (the learner's gathered state) makes it act as the learner's policy, else it has its own random weights."""
    torch.manual_seed(1000 + seed)
    with torch.device(device):
        policy = build_policy(
            cfg.actor.model, specs, action_dim, cfg.algorithm.normalize_obs, cfg.algorithm.logprob_type
        )
    if weights is not None:
        policy.load_state_dict(weights)
    g = torch.Generator().manual_seed(seed)
    obs = {
        k: (
            torch.randint(0, 256, (T * N, *s.shape), dtype=torch.uint8, generator=g)
            if s.is_image
            else torch.randn(T * N, *s.shape, generator=g)
        )
        for k, s in specs.items()
    }
    with torch.no_grad():
        out = policy.act({k: v.to(device) for k, v in obs.items()}, False, ["pick up the cube"] * (T * N))
    del policy
    out = type(out)(
        **{
            f: (v.cpu() if torch.is_tensor(v) else {k: t.cpu() for k, t in v.items()} if isinstance(v, dict) else v)
            for f, v in vars(out).items()
        }
    )
    tm = {f"obs.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in obs.items()}
    tm.update({f"fi.{k}": v.numpy().reshape(T, N, *v.shape[1:]) for k, v in out.forward_inputs.items()})
    rng = np.random.default_rng(seed)
    values = out.values if out.values is not None else torch.zeros(T * N)
    tm.update(
        {
            "actions": out.actions.float().numpy().reshape(T, N, *out.actions.shape[1:]),
            "log_probs": out.log_probs.float().numpy().reshape(T, N, -1),
            "values": values.float().numpy().reshape(T, N),
            "rewards": rng.random((T, N)).astype(np.float32),
            "terminated": np.zeros((T, N), bool),
            "truncated": np.zeros((T, N), bool),
            "loss_mask": np.ones((T, N), bool),
        }
    )
    tm["truncated"][T // 2] = True
    tm["loss_mask"][T - 1, 0] = False  # one sample that does not train
    # the next and final observations: each env's first observation again (any valid observation will do)
    first = {k[4:]: v[0] for k, v in tm.items() if k.startswith("obs.")}
    tail = codec.make_tail(first, np.arange(N) + (T // 2) * N, first)
    return tm, tail, [EpisodeStat(0, 3.0, 8, True, True)]


def main(argv: list[str]) -> int:
    scenario, out = argv[0], pathlib.Path(argv[1])
    opts = dict(a.split("=", 1) for a in argv[2:])
    model = opts.get("model", "mlp")
    extra = [f"runner.resume_dir={opts['resume']}"] if "resume" in opts else []
    extra += [f"{k}={v}" for k, v in opts.items() if "." in k]  # config overrides (the GPU tests' sizes)
    cfg, specs, action_dim = config(model, out, extra)
    if opts.get("float64") == "1":  # the exactness tests: the policy (and its shards) in float64
        build = learner_module.build_policy
        learner_module.build_policy = lambda *a, **kw: build(*a, **kw).double()
    if opts.get("no_sync") == "1":  # the broken variant: each rank keeps its own gradients
        shard = sharding.shard_policy

        def unsynced(model, group):
            from torch.distributed.fsdp import FSDPModule

            model = shard(model, group)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_requires_gradient_sync(False)
            return model

        learner_module.shard_policy = unsynced
    group = RankGroup.from_environ(timeout_s=120, heartbeat_timeout_s=float(opts.get("hb", 30)))
    learner = Learner(learner_view(cfg), out / "run", group=group)
    if not group.is_leader:
        learner.follow()
        learner.close()
        return 0
    T, N = 8, int(opts.get("envs", "5" if model == "mlp" else "4"))
    epochs = int(opts.get("epochs", "1"))
    learner.setup(specs, action_dim)
    if scenario == "idle":  # set up, then wait (the fault tests kill a rank meanwhile)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ready").write_text("1")
        time.sleep(float(opts.get("sleep", "60")))
        learner.close()
        return 0
    metrics = []
    measure = opts.get("measure_cuda") == "1"
    act_on = opts.get("act_device", "cpu")
    weights = learner.state_dict() if opts.get("act_as_learner") == "1" else None
    rollouts = {
        epoch: rollout(cfg, specs, action_dim, T, N, seed=epoch, device=act_on, weights=weights)
        for epoch in range(learner.epoch + 1, epochs)
    }
    if measure:  # the peak of the updates alone (the acting copy above is gone)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for epoch, data in rollouts.items():
        learner.rollouts.receive(epoch, 0, *data)
        metrics.append(learner.train(epoch, [0]))
    update_s = time.perf_counter() - started
    if scenario == "save":
        learner.save_checkpoint()
    if opts.get("export") == "1":  # the released layout, gathered on rank 0
        learner.export(out / "export")
    extra_results = {}
    if measure:  # the GPU test set: the memory check's estimate against the allocator's peak
        from rlfleet.policies import footprint

        fp = footprint.estimate(cfg.actor.model, cfg.algorithm.logprob_type)
        extra_results = {
            "cuda_max_allocated": torch.cuda.max_memory_allocated(),
            "estimate_per_rank": fp.rank_bytes(group.world, gpu=True, rows=cfg.actor.micro_batch_size),
        }
    if opts.get("save_state", "1") == "1":  # save_state=0: no gathered copy (the real-size GPU test: 14 GB)
        state = learner.state_dict()
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "state.safetensors"))
    (out / "result.json").write_text(
        json.dumps(
            {
                "metrics": metrics,
                "memory": learner.memory(),
                "world": group.world,
                "epoch": learner.epoch,
                "update_s": update_s,
                **extra_results,
            }
        )
    )
    learner.close()
    return 0


if __name__ == "__main__":
    # a rank ends as the learner service's ranks do (exit_after: flush, then os._exit, no interpreter finalisation).
    # Rank 0 once aborted in CI under load ("terminate called without an active exception", SIGABRT, no Python
    # traceback; where is unknown: test_rank_group.py now runs the ranks with faulthandler on); interpreter
    # finalisation beside gloo's C++ threads is a known cause of exactly that abort (pytorch/pytorch#190489)
    exit_after(lambda: main(sys.argv[1:]))
