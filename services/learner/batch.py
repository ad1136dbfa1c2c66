"""One epoch's training batch, built once on rank 0 from the workers' rollouts, then split across the ranks.

``build_batch`` turns the committed rollouts into flat per-sample rows: advantages (GAE or GRPO) and GRPO group
statistics are computed here, once, over the whole batch. ``split_rows`` gives each rank a contiguous block of env
columns (whole episodes of those envs; a GRPO group is never split), balancing the samples that train
(``loss_mask``). Every row keeps its global index, so the ranks can walk one shared permutation of the batch and
together compute the same update as one process on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlfleet.errors import FailedPrecondition
from rlfleet.policies.models.actor_critic import RunningMeanStd
from rlfleet.wire.codec import FI, FINAL_INDEX, FINAL_OBS, NEXT_OBS, OBS
from services.learner import grpo, ppo


class RewardScaler:
    """Rewards scaled by the running std of discounted returns (algorithm.normalize_rewards), per worker's envs."""

    def __init__(self, gamma: float):
        self.gamma = gamma
        self.rms = RunningMeanStd(())
        self.returns: dict[int, np.ndarray] = {}  # per worker: running discounted return per env

    def __call__(self, worker: int, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        """Scale one worker's rewards [T, N]; its running returns and the statistics move only when the result is
        finite (rewards are bounded by the rollout schema, so they always are; this keeps a bad batch from ever
        leaving the normaliser in a state that scales every later reward to nothing or to infinity)."""
        ret = self.returns.get(worker)
        ret = np.zeros(rewards.shape[1]) if ret is None or ret.shape[0] != rewards.shape[1] else ret.copy()
        history = np.empty_like(rewards, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
            for t in range(rewards.shape[0]):
                ret[:] = ret * self.gamma + rewards[t]
                history[t] = ret
                ret[dones[t]] = 0.0
        # the statistics move in place and are put back if the result is refused (a copy of the buffers, not of the
        # module: deep-copying it took a third of the learner's batch preparation)
        kept = [b.clone() for b in self.rms.buffers()]
        self.rms.update(torch.from_numpy(history))
        scale = float(np.sqrt(self.rms.var.item() + 1e-8))
        if not (np.isfinite(history).all() and np.isfinite(scale)):
            with torch.no_grad():
                for b, old in zip(self.rms.buffers(), kept):
                    b.copy_(old)
            raise FailedPrecondition(
                f"rewards of worker {worker}: their discounted returns overflow the reward "
                f"normaliser (algorithm.normalize_rewards); it is left as it was"
            )
        self.returns[worker] = ret
        return (rewards / scale).astype(np.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v.contiguous() for k, v in self.rms.state_dict().items()}
        state.update({f"returns.{w}": torch.from_numpy(r.copy()) for w, r in self.returns.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        self.returns = {
            int(k.split(".", 1)[1]): state.pop(k).numpy().copy() for k in list(state) if k.startswith("returns.")
        }
        self.rms.load_state_dict(state)


@dataclass
class Batch:
    """One epoch's samples: ``rows`` are flat [T * N, ...] tensors (row t * N + n is env n at step t)."""

    T: int
    N: int
    rows: dict[str, torch.Tensor]  # obs.<k>, fi.<k>, old_log_probs, old_values, advantages, returns, mask
    episodes: list
    raw_rewards: np.ndarray  # [T, N] as the envs reported them
    values: torch.Tensor  # [T, N]
    advantages: torch.Tensor  # [T, N]
    returns: torch.Tensor  # [T, N]
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def use_mask(self) -> bool:
        return not bool(self.rows["mask"].all())


def bootstrap_rows(parts: list[dict], truncated_too: bool) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """The rows whose value the advantages need beyond the rollout's own: each env's observation after the last
    step, and (``truncated_too``) the final observation of each episode cut by its time limit, each with the
    forward inputs of the row it follows (a VLA's prompt, instruction included) -> (rows, the truncated rows' flat
    index in the whole batch)."""
    N_all = sum(p["time"]["rewards"].shape[1] for p in parts)
    obs_keys = [k[len(OBS) :] for k in parts[0]["time"] if k.startswith(OBS)]
    fi_keys = [k for k in parts[0]["time"] if k.startswith(FI)]
    rows: dict[str, list[np.ndarray]] = {f"{OBS}{k}": [] for k in obs_keys} | {k: [] for k in fi_keys}
    where, offset = [], 0
    for p in parts:
        tm, tail = p["time"], p["tail"]
        T, N = tm["rewards"].shape
        index = tail[FINAL_INDEX]
        cut = (tm["truncated"] & ~tm["terminated"]).reshape(-1)[index] if truncated_too else np.zeros(len(index), bool)
        picked = index[cut]
        t, n = picked // N, picked % N
        where.append(t * N_all + offset + n)
        for k in obs_keys:
            rows[f"{OBS}{k}"].append(tail[f"{FINAL_OBS}{k}"][cut])
        for k in fi_keys:
            rows[k].append(tm[k][t, n])
        offset += N
    for p in parts:  # then every env's next observation, with the forward inputs of its last row
        tm, tail = p["time"], p["tail"]
        for k in obs_keys:
            rows[f"{OBS}{k}"].append(tail[f"{NEXT_OBS}{k}"])
        for k in fi_keys:
            rows[k].append(tm[k][-1])
    return {k: torch.as_tensor(np.concatenate(v)) for k, v in rows.items()}, np.concatenate(where)


def build_batch(
    parts: list[dict], workers: list[int], alg, scaler: RewardScaler, critic=None, auto_reset=True
) -> Batch:
    """The rollouts of ``workers`` (in order) -> advantages, returns and flat rows (rank 0, once per epoch).
    ``critic(rows) -> [R]``: the learner's critic on rows of observations and forward inputs (the policy being
    trained, before its update: the one that acted, in a synchronous run); it bootstraps the advantages from the
    rollouts' next and final observations (None: no critic, zeros)."""
    episodes = [e for p in parts for e in p["episodes"]]

    def cat(key):
        return np.concatenate([p["time"][key] for p in parts], axis=1)

    raw_rewards = cat("rewards")
    dones = cat("terminated") | cat("truncated")
    tt = torch.as_tensor
    values = tt(cat("values"))
    loss_mask = tt(cat("loss_mask").astype(np.float32))
    stats: dict[str, float] = {}
    if alg.adv_type == "grpo":  # group-relative scores of whole episodes; no critic, no reward normalisation
        fr = tuple(alg.filter_rewards) if alg.filter_rewards is not None else None
        advantages, loss_mask, stats = grpo.grpo_advantages(
            tt(raw_rewards * alg.reward_coef), loss_mask, alg.group_size, filter_range=fr
        )
        returns = advantages
    else:
        rewards = (
            np.concatenate(
                [
                    scaler(w, p["time"]["rewards"], p["time"]["terminated"] | p["time"]["truncated"])
                    for w, p in zip(workers, parts)
                ],
                axis=1,
            )
            if alg.normalize_rewards
            else raw_rewards
        )
        extra, where = bootstrap_rows(parts, alg.bootstrap_truncated and auto_reset)
        v = critic(extra) if critic is not None else torch.zeros(len(next(iter(extra.values()))))
        v = v.detach().to("cpu", torch.float32).numpy()
        if len(where):  # gamma * V(final obs) added to the reward of each truncated episode's last step
            rewards = np.array(rewards, np.float32)
            rewards.reshape(-1)[where] += alg.gamma * v[: len(where)]
        last_values = tt(v[len(where) :])
        advantages, returns = ppo.compute_gae(
            tt(rewards), values, tt(dones.astype(np.float32)), last_values, alg.gamma, alg.gae_lambda
        )
    T, N = raw_rewards.shape
    flat = lambda x: torch.as_tensor(x).reshape(T * N, *x.shape[2:])  # noqa: E731
    rows = {k: flat(cat(k)) for k in parts[0]["time"] if k.startswith((OBS, FI))}
    rows.update(
        {
            "old_log_probs": flat(cat("log_probs")),
            "old_values": flat(values),
            "advantages": flat(advantages),
            "returns": flat(returns),
            "mask": flat(loss_mask),
        }
    )
    if all("weights_version" in p["time"] for p in parts):
        rows["weights_version"] = flat(cat("weights_version"))
    return Batch(T, N, rows, episodes, raw_rewards, values, advantages, returns, stats)


def env_blocks(N: int, world: int, group_size: int, valid_per_env: np.ndarray) -> list[range]:
    """Split env columns 0..N-1 into ``world`` contiguous blocks of whole groups of ``group_size`` envs, balancing
    the valid samples per block (``valid_per_env[n]``: env n's samples that train). Every block is non-empty."""
    groups = N // max(group_size, 1)
    if groups < world:
        raise FailedPrecondition(
            f"the batch's {N} envs form {groups} group(s) of {group_size} "
            f"(algorithm.group_size): too few to give each of the learner's {world} ranks one; "
            f"use more envs or fewer ranks"
        )
    weight = valid_per_env.reshape(groups, -1).sum(1).astype(np.float64) + 1e-9  # a group with none still counts
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    bounds = [0]
    for r in range(1, world):  # cut where the running total crosses r / world of the samples
        cut = int(np.searchsorted(cum, cum[-1] * r / world, side="left"))
        if cut > 0 and abs(cum[cut - 1] - cum[-1] * r / world) <= abs(cum[cut] - cum[-1] * r / world):
            cut -= 1
        cut = min(max(cut, bounds[-1] + 1), groups - (world - r))  # each block keeps at least one group
        bounds.append(cut)
    bounds.append(groups)
    g = max(group_size, 1)
    return [range(bounds[r] * g, bounds[r + 1] * g) for r in range(world)]


def split_rows(batch: Batch, world: int, group_size: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's rows (its env block at every step) with their global row ids ('index')."""
    mask = batch.rows["mask"].reshape(batch.T, batch.N)
    blocks = env_blocks(batch.N, world, group_size, (mask > 0).sum(0).numpy())
    out = []
    for block in blocks:
        idx = (torch.arange(batch.T)[:, None] * batch.N + torch.tensor(list(block))[None, :]).reshape(-1)
        shard = {k: v[idx] for k, v in batch.rows.items()}
        shard["index"] = idx
        out.append(shard)
    return out
