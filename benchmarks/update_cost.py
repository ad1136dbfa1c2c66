"""The learner's PPO update in one process, without the fleet: the whole update of one epoch, then its pieces.

    python benchmarks/update_cost.py [--updates 200] [--repeat 1000] [--idle-ms 120] [key=value ...]

Builds the default run's policy (or the overrides': ``actor.model.hidden_dims=[64,64]``, ``algorithm.update_epoch=4``,
``actor.global_batch_size=1024`` ...) for PandaPickCube-v0's spaces and one synthetic epoch of rows (observations,
sampled actions and their log-probs and values from the policy itself, random advantages and returns), and times
``Trainer.update`` as a synchronous run's learner calls it: the critic's forward and backward apart from the actor's
when this machine has two cores or more (services/learner/trainer.py, ``critic_apart``), in the critic's helper process
(``cluster.learner_critic_process``, services/learner/critic_process.py; started and waited for first) or on a second
thread. Then the pieces of one optimizer step on a minibatch, each alone on one thread: one hidden layer's matrix
product, the actor's and the critic's forward and backward, clipping and Adam. The last lines put the update next to
the floor its matrix products set at the rate measured here: the rest is elementwise work, autograd and Python. With
the critic apart, more rows: the update with the critic's half on a second thread instead of the helper process; the
update with the critic's half skipped (its losses zero, its parameters no gradient): the most that running the
critic's half outside the learner's process could take off; and the update after ``--idle-ms`` of idle time, as a
run's learner meets it after each rollout, with its two halves held on two cores (as the trainer does) and left to
the scheduler.

Medians (and minima) over the timed calls, wall time. The update runs alone here, with warm caches: in a run it
follows a rollout, whose simulator evicts the caches (docs/benchmarks.md puts the two side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ENV_ID = "rlfleet/PandaPickCube-v0"


def _timed(fn, n: int, before=None) -> tuple[float, float]:
    """-> (median, min) wall seconds of ``n`` calls of ``fn`` after two untimed ones (``before()``, untimed, ahead
    of each)."""
    fn(), fn()
    out = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out), min(out)


def setup(overrides: list[str]):
    """-> (learner view, policy, optimizer, trainer, one epoch's rows) for the default run plus ``overrides``."""
    import gymnasium

    import services.env.envs  # noqa: F401  (registers the rlfleet/ ids)
    from rlfleet.config import load_config
    from rlfleet.config.views import learner_view
    from rlfleet.policies import build_policy
    from rlfleet.wire.spaces import TensorSpace
    from services.learner.group import RankGroup
    from services.learner.optim import adam
    from services.learner.trainer import Trainer

    cfg = load_config(None, overrides)
    view = learner_view(cfg)
    env = gymnasium.make(ENV_ID)
    obs_dim, action_dim = env.observation_space.shape[0], env.action_space.shape[0]
    env.close()
    torch.manual_seed(cfg.runner.seed)
    model = build_policy(
        view.model, {"state": TensorSpace((obs_dim,), "float32")}, action_dim, view.algorithm.normalize_obs
    )
    optimizer = adam([p for p in model.parameters() if p.requires_grad], lr=view.lr, eps=view.adam_eps)
    n = cfg.env.train.total_num_envs * cfg.env.train.max_steps_per_rollout_epoch
    g = torch.Generator().manual_seed(cfg.runner.seed)
    obs = torch.randn(n, obs_dim, generator=g)
    with torch.no_grad():
        acted = model.act({"state": obs})
    rows = {
        "index": torch.arange(n),
        "mask": torch.ones(n),
        "advantages": torch.randn(n, generator=g),
        "returns": torch.randn(n, generator=g),
        "old_log_probs": acted.log_probs.float(),
        "old_values": acted.values.float(),
        "obs.state": obs,
        "fi.actions": acted.forward_inputs["actions"],
    }
    return view, model, optimizer, Trainer(view, RankGroup()), rows


def matmul_flops(model, rows: int) -> float:
    """Multiply-adds x 2 of the forward and backward passes of every linear layer on ``rows`` rows (the backward: the
    weight's gradient, and the input's for every layer but the first)."""
    flops = 0.0
    for net in (model.actor_mean, model.critic):
        linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        for i, layer in enumerate(linears):
            once = 2.0 * rows * layer.in_features * layer.out_features
            flops += once * (2 if i == 0 else 3)
    return flops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=200, help="whole updates timed (default 200)")
    ap.add_argument("--repeat", type=int, default=1000, help="calls of each piece timed (default 1000)")
    ap.add_argument(
        "--idle-ms", type=float, default=120.0, help="idle time before each update of the after-idle rows (default 120)"
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the default run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    view, model, optimizer, trainer, rows = setup(args.overrides)
    trainer.start(model)  # the critic's helper process, where the run would use one (cluster.learner_critic_process)
    helper = trainer.critic_process
    if helper is not None and not helper.wait_ready(60.0):
        print(f"the critic's helper process did not start ({helper.failed}); the critic runs on a thread")
    total, mb = len(rows["index"]), view.global_batch_size
    steps = view.algorithm.update_epoch * -(-total // mb)
    epoch = [0]

    def update():
        epoch[0] += 1
        trainer.update(model, optimizer, dict(rows), total=total, epoch=epoch[0], lr=view.lr, use_mask=False)

    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    med, low = _timed(update, args.updates)
    switches = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches) / args.updates
    apart = trainer.critic_apart(model)
    where = "no (one thread)"
    if apart:
        where = (
            "yes, in a helper process" if helper is not None and helper.failed is None else "yes, on a second thread"
        )
    print(
        f"one epoch's update: {total:,} rows, {view.algorithm.update_epoch} passes of {-(-total // mb)} minibatches of "
        f"{mb} = {steps} optimizer steps; critic apart from the actor: {where} ({trainer.cores} cores)\n"
    )
    print("| part | median | min |")
    print("|---|---|---|")
    print(f"| whole update | {med * 1e3:.2f} ms | {low * 1e3:.2f} ms |")
    print(f"| per optimizer step | {med / steps * 1e3:.2f} ms | {low / steps * 1e3:.2f} ms |")
    print(
        f"| voluntary context switches per update (threads waiting: for the GIL, for the critic) | {switches:.0f} | |"
    )
    if apart and helper is not None:  # the same update with the critic's half on a thread of the learner
        trainer.critic_process = None
        on_thread = _timed(update, args.updates)
        trainer.critic_process = helper
        print(
            f"| whole update, the critic's half on a second thread instead (cluster.learner_critic_process=false) | "
            f"{on_thread[0] * 1e3:.2f} ms | {on_thread[1] * 1e3:.2f} ms |"
        )
    if apart:  # what the critic's half costs the update on its thread (the GIL): the update without it
        trainer.critic_process = None
        none = torch.zeros(())
        trainer._critic_half = lambda *_: (none, none)
        bound = _timed(update, args.updates)
        del trainer._critic_half
        trainer.critic_process = helper
        print(
            f"| whole update, the critic's half skipped (what the critic would leave if it ran outside this "
            f"process) | {bound[0] * 1e3:.2f} ms | {bound[1] * 1e3:.2f} ms |"
        )

        def idle():
            time.sleep(args.idle_ms / 1e3)

        after = _timed(update, args.updates, idle)
        trainer._cores_apart = lambda apart: contextlib.nullcontext()  # the threads left to the scheduler
        unpinned = _timed(update, args.updates, idle)
        del trainer._cores_apart
        print(
            f"| whole update after {args.idle_ms:.0f} ms idle (a rollout's wait), its two threads on two cores | "
            f"{after[0] * 1e3:.2f} ms | {after[1] * 1e3:.2f} ms |"
        )
        print(
            f"| the same, its threads left to the scheduler | {unpinned[0] * 1e3:.2f} ms | {unpinned[1] * 1e3:.2f} ms |"
        )

    # the pieces of one step on a minibatch, each alone on this thread
    from services.learner.rollouts import policy_inputs
    from services.learner.trainer import _clip_grad_norm

    idx = torch.arange(min(mb, total))
    obs, fi = policy_inputs(rows, idx)
    hidden = [m for m in model.actor_mean if isinstance(m, torch.nn.Linear)][1]
    h = torch.randn(len(idx), hidden.in_features)
    with torch.no_grad():
        layer = _timed(lambda: hidden(h), args.repeat)
    rate = 2.0 * len(idx) * hidden.in_features * hidden.out_features / layer[0]

    def actor():
        model.evaluate_actor(obs, fi).log_probs.sum().backward()

    def critic():
        model.value(obs).sum().backward()

    pieces = {
        f"one hidden layer's forward ({len(idx)} x {hidden.in_features} x {hidden.out_features})": layer,
        "the actor's forward and backward": _timed(actor, args.repeat // 4),
        "the critic's forward and backward": _timed(critic, args.repeat // 4),
    }
    params = [p for p in model.parameters() if p.grad is not None]
    pieces["gradient clipping (the trainer's)"] = _timed(
        lambda: _clip_grad_norm(params, view.algorithm.max_grad_norm), args.repeat
    )
    pieces["Adam step"] = _timed(optimizer.step, args.repeat)
    for name, (m, lo) in pieces.items():
        print(f"| {name} | {m * 1e6:.0f} us | {lo * 1e6:.0f} us |")
    floor = matmul_flops(model, total) * view.algorithm.update_epoch / rate
    print(
        f"\nmatrix products: {rate / 1e9:.0f} GFLOP/s on one core (the hidden layer above); the update's "
        f"{matmul_flops(model, total) * view.algorithm.update_epoch / 1e9:.2f} GFLOP of them take {floor * 1e3:.1f} "
        f"core-ms at that rate, {floor / max(1, min(2, trainer.cores)) * 1e3:.1f} ms on "
        f"{max(1, min(2, trainer.cores))} cores; the update's median is {med / floor:.1f}x the one-core figure"
    )
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
