"""Demonstrations from a simulator's scripted expert, recorded into a LeRobot v3.0 dataset (rlfleet.data.datasets).

The env side of supervised fine-tuning: the same ``VecEnv`` and backend an env server hosts (so it runs from the
simulator's own environment, as env servers do), stepped with the backend's ``expert_actions``. Episode k is reset
with seed ``sft.demo_seed + k`` (and fixed initial state k when the env has them), so a dataset is reproducible and
its episodes are apart from training and evaluation seeds.

    python -m services.env.demos --config RESOLVED.yaml --out DATASET [--episodes N]

(``coordinatorctl collect-demos CONFIG`` runs this from the right environment.)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from rlfleet.data.datasets import DatasetWriter, Episode
from services.env.vec_env import VecEnv


class _Recording:
    def __init__(self, k: int, seed: int, state_id: int, obs: dict[str, np.ndarray], instruction: str):
        self.k, self.seed, self.state_id, self.instruction = k, seed, state_id, instruction
        self.obs: dict[str, list] = {key: [v] for key, v in obs.items()}
        self.actions: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.success: list[bool] = []

    def episode(self) -> Episode:
        T = len(self.actions)  # the observation after the last action is not a sample
        return Episode(
            {k: np.stack(v[:T]) for k, v in self.obs.items()},
            np.stack(self.actions),
            np.asarray(self.rewards, np.float32),
            np.asarray(self.success, bool),
            self.instruction,
            self.seed,
            self.state_id,
        )


def collect_demonstrations(
    env: VecEnv,
    writer: DatasetWriter,
    num_episodes: int,
    seed: int,
    *,
    only_successful: bool = True,
    max_attempts: int | None = None,
    log=print,
) -> dict:
    """Record ``num_episodes`` expert episodes (successful ones only, unless told otherwise) with ``env``
    (auto-reset off). Returns counts; raises RuntimeError when the expert fails too often to fill the dataset."""
    if env.auto_reset:
        raise ValueError("collect_demonstrations needs a VecEnv with auto_reset=False")
    max_attempts = max_attempts or 3 * num_episodes + 10
    attempts = kept = failed = steps = 0
    slots: dict[int, _Recording] = {}
    t0 = time.perf_counter()

    def start(slot: int) -> None:
        nonlocal attempts
        k = attempts
        attempts += 1
        state = k % env.num_reset_states if env.num_reset_states else -1
        obs = env.reset([slot], [seed + k], [state])
        slots[slot] = _Recording(k, seed + k, state, {key: v[0] for key, v in obs.items()}, env.instructions[slot])

    for slot in range(min(env.num_envs, num_episodes)):
        start(slot)
    while slots and kept < num_episodes:
        ids = np.asarray(sorted(slots))
        actions = env.expert_actions(ids)
        res = env.step(ids, actions)
        steps += len(ids)
        ended = {int(ids[row]) for row in res.final_rows}
        for j, slot in enumerate(ids.tolist()):
            rec = slots[slot]
            rec.actions.append(np.asarray(actions[j], np.float32))
            rec.rewards.append(float(res.rewards[j]))
            rec.success.append(bool(res.success[j]))
            for key, v in res.obs.items():
                rec.obs[key].append(v[j])
        for slot in sorted(ended):
            rec = slots.pop(slot)
            ok = any(rec.success)
            if ok or not only_successful:
                if kept < num_episodes:
                    writer.add(rec.episode())
                    kept += 1
            else:
                failed += 1
            log(
                f"  demo {kept:4d}/{num_episodes}  seed {rec.seed}  {len(rec.actions)} steps  "
                f"{'success' if ok else 'FAILED' + (' (dropped)' if only_successful else '')}"
                + (f"  '{rec.instruction}'" if rec.instruction else "")
            )
            if kept + len(slots) < num_episodes:
                if attempts >= max_attempts:
                    if not slots:
                        raise RuntimeError(
                            f"the expert succeeded in only {kept} of {attempts} episodes; "
                            f"{num_episodes} successful demonstrations were asked for"
                        )
                    continue
                start(slot)
    return {
        "episodes": kept,
        "attempts": attempts,
        "expert_failures": failed,
        "env_steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    from rlfleet.config import load_cli_config
    from rlfleet.config.views import env_view
    from services.env.server import env_kwargs

    p = argparse.ArgumentParser(description="record scripted-expert demonstrations of env.train into a dataset")
    p.add_argument("--config", required=True, help="run config (YAML or built-in name)")
    p.add_argument("--out", required=True, help="dataset folder to write")
    p.add_argument("--episodes", type=int, default=None, help="episodes to record (default: sft.num_demos)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args, cfg = load_cli_config(p, argv)
    n = int(args.episodes or cfg.sft.num_demos)
    tr = cfg.env.train
    kwargs = env_kwargs(env_view(cfg), "train", max(1, min(tr.total_num_envs, n)), cfg.sft.demo_seed, False)
    try:
        env = VecEnv(**kwargs)
    except Exception as exc:  # noqa: BLE001 - an unknown id, bad init_params, a simulator that cannot start
        print(f"collect-demos: cannot start {tr.simulator_type}:{tr.env_id}: {exc}", file=sys.stderr)
        return 1
    writer = DatasetWriter(
        args.out,
        env_id=tr.env_id,
        simulator=tr.simulator_type,
        fps=int(cfg.sft.demo_fps),
        source=f"scripted expert of {tr.simulator_type}:{tr.env_id}",
        overwrite=True,
    )
    print(
        f"collecting {n} demonstrations of {tr.simulator_type}:{tr.env_id} ({env.num_envs} envs, "
        f"{tr.max_episode_steps}-step episodes) into {args.out}",
        flush=True,
    )
    try:
        stats = collect_demonstrations(
            env,
            writer,
            n,
            int(cfg.sft.demo_seed),
            only_successful=bool(cfg.sft.only_successful),
            log=lambda s: print(s, flush=True),
        )
    except Exception as exc:  # noqa: BLE001 - the backend says what is missing (no expert, no simulator)
        writer.close(complete=False)
        print(f"collect-demos: {exc}", file=sys.stderr)
        return 1
    finally:
        env.close()
    writer.close()
    print(
        f"wrote {stats['episodes']} episodes ({writer.meta['total_frames']} frames) to {args.out} in "
        f"{stats['seconds']:.1f}s; the expert failed {stats['expert_failures']} of {stats['attempts']} episodes",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
