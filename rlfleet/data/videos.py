"""Evaluation videos: an episode's camera frames written as an animated GIF (Pillow; GitHub and browsers play it).

Every image observation (uint8 HxWx3) of a frame is placed side by side, so one file shows every camera. The
file name carries what a reader looks for: ``episode007_seed1000007_success.gif``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import numpy as np


def image_keys(space: Mapping) -> list[str]:
    """Names of the image entries (uint8 [H, W, 3]) of an observation space {key: TensorSpace}, sorted."""
    return sorted(
        k for k, s in space.items() if np.dtype(s.dtype) == np.uint8 and len(s.shape) == 3 and s.shape[-1] == 3
    )


def tile(frame: Mapping[str, np.ndarray], keys: Sequence[str]) -> np.ndarray:
    """One time step's camera images [H, W, 3] -> one image, side by side (shorter ones padded below)."""
    height = max(frame[k].shape[0] for k in keys)
    parts = [np.pad(frame[k], ((0, height - frame[k].shape[0]), (0, 0), (0, 0))) for k in keys]
    return np.concatenate(parts, axis=1)


def video_name(episode: int, seed: int, success: bool) -> str:
    return f"episode{episode:03d}_seed{seed}_{'success' if success else 'fail'}.gif"


def write_gif(
    path: str | pathlib.Path, frames: Sequence[np.ndarray], fps: float = 10.0, scale: int = 2
) -> pathlib.Path:
    """Frames [H, W, 3] uint8 -> an animated GIF (upscaled ``scale`` times with nearest neighbours)."""
    from PIL import Image

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(np.repeat(np.repeat(f, scale, 0), scale, 1)) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(20, int(1000 / fps)), loop=0)
    return path
