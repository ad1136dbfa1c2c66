"""Reproducible sampling noise, keyed per env and step.

A stochastic policy's sample for a row must not depend on which inference batch the row lands in (dynamic batching
merges requests from several env servers and pipeline stages in whatever order they arrive), nor on how many rows
came before it. So the rollout gives every row a 64-bit *noise key* derived from the run seed, the env's global
index, the epoch and the step (``row_keys``), and a policy draws that row's noise from its key alone
(``RowNoise``): a counter-based generator (splitmix64 over key and counter, Box-Muller for normals), so any subset
of rows, in any order, in any batch, draws the same numbers.

Without keys (``RowNoise`` absent), policies fall back to torch's global generator, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _mix(key: np.ndarray, value) -> np.ndarray:
    """Chain a value into a pseudorandom key. ``key + value`` (not a symmetric combination of two hashes, which
    would make (seed a, epoch b) collide with (seed b, epoch a)); splitmix64 is a bijection, so keys that differ
    before the finaliser differ after it."""
    with np.errstate(over="ignore"):  # counters step by the golden gamma, as in SplitMix64 itself
        return _splitmix64(key + np.asarray(value, dtype=np.uint64) * _GOLDEN)


def row_keys(env_seeds: np.ndarray | Sequence[int], epoch: int, step: int) -> np.ndarray:
    """uint64 noise keys for rows whose envs have these seeds (one per env, unique in the run) at (epoch, step)."""
    seeds = np.asarray(env_seeds, dtype=np.int64).astype(np.uint64)
    return _mix(_mix(_splitmix64(seeds), np.uint64(epoch)), np.uint64(step))


class RowNoise:
    """Per-row noise streams: row i's draws are a function of ``keys[i]`` and of how many draws were made before.

    Each call to ``normal``/``uniform`` consumes the next block of the stream, so a policy that draws several
    times per act (a denoising chain) gets independent numbers each time, the same ones in every run."""

    def __init__(self, keys: np.ndarray | Sequence[int]):
        self.keys = np.asarray(keys, dtype=np.uint64).reshape(-1)
        self._calls = 0

    def __len__(self) -> int:
        return len(self.keys)

    def _bits(self, size: int) -> np.ndarray:
        """[n, size] uniform uint64 words for the next call."""
        self._calls += 1
        stream = _mix(self.keys, np.uint64(self._calls))[:, None]
        return _mix(stream, np.arange(size, dtype=np.uint64)[None, :])

    def uniform(self, shape: Sequence[int]) -> np.ndarray:
        """float64 [n, *shape] in the open interval (0, 1)."""
        size = int(np.prod(shape, dtype=np.int64))
        u = ((self._bits(size) >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
        return u.reshape(len(self.keys), *shape)

    def normal(self, shape: Sequence[int]) -> np.ndarray:
        """float32 [n, *shape] standard normal draws (Box-Muller on two uniform words per number)."""
        size = int(np.prod(shape, dtype=np.int64))
        u = self.uniform((2, size))
        z = np.sqrt(-2.0 * np.log(u[:, 0])) * np.cos(2.0 * np.pi * u[:, 1])
        return z.astype(np.float32).reshape(len(self.keys), *shape)

    def torch_normal(self, shape: Sequence[int], like):
        """``normal`` as a tensor on ``like``'s device and dtype."""
        import torch

        return torch.from_numpy(self.normal(shape)).to(device=like.device, dtype=like.dtype)

    def torch_uniform(self, shape: Sequence[int], like):
        import torch

        return torch.from_numpy(self.uniform(shape)).to(device=like.device, dtype=torch.float64)
