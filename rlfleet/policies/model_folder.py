"""Reading a model folder (``actor.model.model_path``: rlfleet's layout, OpenVLA's or transformers' π0 layout, a
hub snapshot) as hostile until checked, with the rules of :mod:`rlfleet.untrusted`:

- every file read is a regular file inside the folder's root (the folder, or a hub snapshot's repo folder, whose
  ``blobs/`` its files link to): a symbolic link out of it, or a shard name of ``model.safetensors.index.json`` such
  as ``../x.safetensors``, is :class:`~rlfleet.untrusted.OutsideRoot`;
- JSON (config.json, the index, dataset_statistics.json, tokenizer configs) is read bounded; tokenizer files are
  bounded in size before a tokenizer library parses them;
- every safetensors file's header is checked against the file's size (:func:`~rlfleet.untrusted.safetensors_header`)
  before ``load_file`` / ``safe_open`` maps it, so a header that claims a terabyte is refused before anything is
  allocated;
- the sizes a config.json gives (hidden sizes, layers, heads, vocabulary) are bounded (:func:`check_sizes`), and the
  model they describe is built on PyTorch's meta device and compared with the elements the checkpoint really holds
  (:func:`check_build_fits`) before it is built for real: a config that would allocate more than its weights is
  refused with the numbers;
- nothing is executed: tokenizers and transformers models load with ``trust_remote_code=False`` (a folder's
  ``auto_map`` names code that is never imported), weights only from safetensors (never pickle), a ``.pt`` file of
  OpenVLA-OFT only with ``weights_only`` and memory-mapped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rlfleet.untrusted import (
    BadFile,
    GiB,
    MiB,
    TooLarge,
    check_count,
    folder_root,
    in_folder,
    read_json,
    regular_file,
    safetensors_header,
)

MAX_CONFIG_BYTES = 16 * MiB  # config.json, an index's weight map, dataset_statistics.json (OpenVLA-7B's: 80 KB)
MAX_TOKENIZER_BYTES = 256 * MiB  # tokenizer.json (Gemma's: 33 MB), tokenizer.model, vocabularies
MAX_PT_BYTES = 1 * GiB  # OpenVLA-OFT's proprio_projector--*.pt (OpenVLA-7B's: 67 MB)
MAX_SHARDS = 100_000  # tensors named by an index
FRESH_ELEMENTS = 1 << 26  # what a build may add to a checkpoint's tensors: fresh heads (value head, noise head)
# files a transformers tokenizer may read from its folder
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)
SMALL_JSON = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "config.json",
    "chat_template.json",
)
# the integer sizes a config may give, by how their key ends: (suffix, most accepted, least accepted)
SIZE_LIMITS = (
    ("vocab_size", 1 << 21, 1),
    ("action_token_end", 1 << 21, 1),
    ("pad_to_multiple_of", 1 << 21, 0),
    ("intermediate_size", 1 << 18, 1),
    ("hidden_size", 1 << 16, 1),
    ("head_dim", 1 << 12, 1),
    ("layers", 1024, 0),
    ("heads", 1024, 1),
    ("image_size", 8192, 1),
    ("patch_size", 1024, 1),
    ("registers", 1024, 0),
    ("n_action_bins", 1 << 16, 2),
    ("max_position_embeddings", 1 << 22, 1),
    ("projection_dim", 1 << 16, 1),
    ("max_state_dim", 1 << 12, 1),
    ("max_action_dim", 1 << 12, 1),
    ("num_denoise_steps", 10_000, 1),
    ("num_inference_steps", 10_000, 1),
    ("chunk_size", 1 << 16, 1),
    ("num_image_tokens", 1 << 16, 0),
    ("num_images_in_input", 64, 1),
)


def model_file(folder: str | os.PathLike, name: str, *, what: str | None = None) -> Path:
    """``folder / name`` resolved, refused unless it stays inside the folder's root (no link out of it)."""
    return in_folder(folder, name, what=what or name, source=Path(folder) / name)


def has_file(folder: str | os.PathLike, name: str) -> bool:
    """Whether ``folder / name`` is there (a link counts, wherever it points: reading it is checked)."""
    return os.path.lexists(Path(folder) / name)


def read_config(
    folder: str | os.PathLike, name: str = "config.json", *, required: bool = True, max_bytes: int = MAX_CONFIG_BYTES
) -> dict | None:
    """A JSON object file of the folder, bounded and inside its root; None when absent and not ``required``."""
    path = Path(folder) / name
    if not required and not has_file(folder, name):
        return None
    return read_json(path, max_bytes=max_bytes, root=folder_root(folder), what=name)


def check_sizes(sizes: Mapping, source: str | os.PathLike, field: str = "", *, recurse: bool = True) -> None:
    """Every integer size of ``sizes`` (keys ending as in SIZE_LIMITS; nested configs too, with ``recurse``)
    within its bounds, else one line naming the file and the key."""
    for key, value in sizes.items():
        name = f"{field}.{key}" if field else str(key)
        if isinstance(value, Mapping) and recurse:
            check_sizes(value, source, name)
            continue
        if value is None or isinstance(value, (list, tuple, bool)):
            continue
        for suffix, most, least in SIZE_LIMITS:
            if str(key).endswith(suffix):
                check_count(name, value, most, source=source, minimum=least)
                break
    ids = sizes.get("prompt_suffix_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or len(ids) > 64:
            raise BadFile(
                source,
                f"{field + '.' if field else ''}prompt_suffix_ids",
                "a list of at most 64 token ids",
                repr(ids)[:80],
            )
        for i in ids:
            check_count(f"{field + '.' if field else ''}prompt_suffix_ids", i, 1 << 21, source=source)


def shard_names(
    folder: str | os.PathLike, *, index: str = "model.safetensors.index.json", exclude: Iterable[str] = ()
) -> list[str]:
    """The safetensors files of a folder: those its index's ``weight_map`` names (each a file inside the folder),
    else every ``*.safetensors`` in it but ``exclude``."""
    folder = Path(folder)
    if has_file(folder, index):
        data = read_config(folder, index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadFile(
                folder / index, "weight_map", "a map of tensor names to safetensors files", repr(weight_map)[:80]
            )
        check_count("weight_map entries", len(weight_map), MAX_SHARDS, source=folder / index)
        names = set()
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or not shard.endswith(".safetensors"):
                raise BadFile(
                    folder / index, f"weight_map['{tensor[:60]}']", "a .safetensors file name", repr(shard)[:80]
                )
            if shard not in names:
                in_folder(folder, shard, what=f"weight_map['{tensor[:60]}']", source=folder / index)
                names.add(shard)
        return sorted(names)
    exclude = set(exclude)
    return sorted(p.name for p in folder.glob("*.safetensors") if p.name not in exclude)


def tensor_headers(folder: str | os.PathLike, names: Iterable[str]) -> dict[str, dict]:
    """{tensor: its header entry} over the named safetensors files of a folder, each file checked (inside the
    root, its header bounded and consistent with its size) without reading any tensor."""
    out: dict[str, dict] = {}
    root = folder_root(folder)
    for name in names:
        in_folder(folder, name, what="safetensors file", source=Path(folder) / name)
        out.update(safetensors_header(Path(folder) / name, root=root))
    return out


def elements(headers: Mapping[str, dict]) -> int:
    """Elements of the tensors of checked headers."""
    total = 0
    for entry in headers.values():
        n = 1
        for d in entry["shape"]:
            n *= d
        total += n
    return total


def load_tensors(folder: str | os.PathLike, names: Iterable[str]) -> dict:
    """All tensors of the named safetensors files of a folder, each file's header checked first
    (:func:`tensor_headers`), so nothing is allocated for a header that lies."""
    from safetensors.torch import load_file

    state = {}
    for name in names:
        tensor_headers(folder, [name])
        state.update(load_file(str(model_file(folder, name))))
    return state


def check_tokenizer_folder(folder: str | os.PathLike, sub: str = ".") -> None:
    """Every file a transformers tokenizer may read from ``folder / sub`` (TOKENIZER_FILES, additional chat
    templates) a regular file inside ``folder``'s root and at most MAX_TOKENIZER_BYTES, its JSON configs bounded,
    before a tokenizer library parses any of it."""
    folder = Path(folder)
    root = folder_root(folder)
    in_folder(folder, sub, what="tokenizer folder")
    tok = folder / sub
    names = [os.path.normpath(os.path.join(sub, n)) for n in TOKENIZER_FILES if has_file(tok, n)]
    if has_file(tok, "additional_chat_templates"):
        extra = os.path.normpath(os.path.join(sub, "additional_chat_templates"))
        in_folder(folder, extra, what="additional_chat_templates")
        names += [os.path.join(extra, p.name) for p in sorted((folder / extra).iterdir())]
    for name in names:
        in_folder(folder, name, what=os.path.basename(name), source=folder / name)
        regular_file(folder / name, root=root, what=os.path.basename(name), max_bytes=MAX_TOKENIZER_BYTES)
        if os.path.basename(name) in SMALL_JSON:  # tokenizer.json itself: parsed by the tokenizers library only
            read_config(folder, name, max_bytes=MAX_CONFIG_BYTES)


def load_pt_weights(path: str | os.PathLike, root: str | os.PathLike) -> dict:
    """A ``.pt`` state dict (OpenVLA-OFT's projector files): inside ``root``, bounded, unpickled with
    ``weights_only`` (tensors and plain containers, no code) and memory-mapped (a storage larger than the file is
    refused, nothing is allocated for it); the tensors are copied out."""
    import torch

    resolved = regular_file(path, root=root, what="state dict", max_bytes=MAX_PT_BYTES)
    try:
        state = torch.load(resolved, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - not a zip of torch.save, a forbidden global, a storage past the end
        raise BadFile(
            path,
            "state dict",
            "a torch.save zip file of tensors (weights_only)",
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise BadFile(path, "state dict", "a map of tensor names to tensors", type(state).__name__)
    return {k: v.clone() for k, v in state.items()}


def check_build_fits(
    build: Callable[[], object], checkpoint_elements: int, source: str | os.PathLike, field: str = "sizes"
) -> None:
    """Build the model ``build`` makes on PyTorch's meta device (shapes only) and refuse it (:class:`TooLarge`)
    when it holds more elements than the checkpoint's tensors, plus 10% and FRESH_ELEMENTS for fresh heads: the
    sizes of a config.json then describe a model its weights cannot fill, which would be allocated first."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build()
    planned = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    limit = checkpoint_elements + checkpoint_elements // 10 + FRESH_ELEMENTS
    if planned > limit:
        raise TooLarge(
            source,
            field,
            f"a model of at most {limit:,} elements (its safetensors hold {checkpoint_elements:,})",
            f"sizes that build {planned:,}",
        )
