"""A learner checkpoint's layout and the limits of what its files may hold: the names in ``global_step_N/``, the
bounds every reader checks, and ``is_int``. Both readers import this module: rlfleet.data.checkpoint_files (torch-free)
and its DCP part rlfleet.data.dcp_files, which checkpoint_files imports where it needs it and which never imports
checkpoint_files back. Torch-free.
"""

from __future__ import annotations

from rlfleet.untrusted import MiB

STATE_DIR = "state"
METADATA_FILE = ".metadata"
LEARNER_STATE = "learner_state.json"
REWARD_RMS = "reward_rms.safetensors"
STEP_PREFIX = "global_step_"

MAX_METADATA_BYTES = 256 * MiB  # a 7B policy with its Adam state over 64 ranks writes ~20 MB
MAX_LEARNER_STATE_BYTES = 16 * MiB
MAX_ENTRIES = 1 << 24  # state dict entries, stored items, chunks of one tensor
MAX_BYTES_ITEM = 1 * MiB  # one non-tensor item (an optimizer hyper-parameter: a few hundred bytes)
MAX_TENSOR_DIMS = 16
MAX_SPACE_ELEMENTS = 1 << 31
MAX_OBS_ENTRIES = 256
MAX_ACTION_DIM = 1 << 16
MAX_ENVS = 1 << 24
MAX_WORKERS = 1 << 16
SPACE_DTYPES = (
    "bool",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
)


def is_int(v) -> bool:
    """A Python int that is not a bool (JSON and pickle values, checked before they are used as sizes)."""
    return isinstance(v, int) and not isinstance(v, bool)
