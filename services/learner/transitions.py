"""A rollout as transitions: what an off-policy algorithm's replay buffer (replay.py) stores.

The rollout is algorithm-neutral (rlfleet/wire/codec.py): ``[T, N]`` rows of observations, actions, rewards,
terminations and truncations, and its tail (each env's observation after the last step, the final observation of
each episode that ended). Row (t, n)'s next observation is:

- the final observation of its episode, where the episode ended at t (terminated or truncated): with auto-reset the
  observation at t + 1 is already the next episode's first;
- else the observation at t + 1;
- else (t = T - 1) the env's observation after the last step (``next_obs``).

Rows that do not train (``loss_mask`` false: an env idle after its episode ended, without auto-reset) are left out.
A terminated row with no final observation (such an idle env) would take its own observation as the next one: its
target never bootstraps from it.
"""

from __future__ import annotations

import numpy as np

from rlfleet.wire.codec import FINAL_INDEX, FINAL_OBS, NEXT_OBS, OBS


def transitions(part: dict) -> dict[str, np.ndarray]:
    """One worker's checked rollout (``{"time": [T, N] tensors, "tail": ...}``) -> flat transitions in time-major
    row order (row t * N + n), with the replay buffer's field names (``obs.<k>``, ``next_obs.<k>``, ``action``,
    ``reward``, ``terminated``, ``truncated``, ``weights_version``). A chunk of actions is one transition whose action
    is the whole chunk, flattened."""
    tm, tail = part["time"], part["tail"]
    T, N = tm["rewards"].shape
    keep = tm["loss_mask"].reshape(-1)
    index = tail[FINAL_INDEX]
    ended = tm["terminated"].reshape(-1) | tm["truncated"].reshape(-1)
    idle = ended & ~np.isin(np.arange(T * N), index)  # ended with no final observation: an idle env
    out: dict[str, np.ndarray] = {}
    for key in (k[len(OBS) :] for k in tm if k.startswith(OBS)):
        obs = tm[f"{OBS}{key}"]
        nxt = np.concatenate([obs[1:], tail[f"{NEXT_OBS}{key}"][None]])  # row t + 1, or after the last step
        nxt = nxt.reshape(T * N, *obs.shape[2:])
        nxt[index] = tail[f"{FINAL_OBS}{key}"]
        flat = obs.reshape(T * N, *obs.shape[2:])
        nxt[idle] = flat[idle]
        out[f"obs.{key}"] = flat[keep]
        out[f"next_obs.{key}"] = nxt[keep]
    actions = tm["actions"]
    out["action"] = actions.reshape(T * N, -1)[keep]
    out["reward"] = tm["rewards"].reshape(-1)[keep]
    out["terminated"] = tm["terminated"].reshape(-1)[keep]
    out["truncated"] = tm["truncated"].reshape(-1)[keep]
    version = tm.get("weights_version")
    out["weights_version"] = (
        np.zeros(T * N, np.int32) if version is None else np.maximum(version, 0).astype(np.int32).reshape(-1)
    )[keep]
    return out
