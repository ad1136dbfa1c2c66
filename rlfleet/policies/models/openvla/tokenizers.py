"""Text tokenizers: OpenVLA's prompt, the file-less byte tokenizer of tiny models, a checkpoint's own tokenizer."""

from __future__ import annotations

from pathlib import Path

PROMPT = "In: What action should the robot take to {instruction}?\nOut:"


class ByteTokenizer:
    """A tokenizer that needs no files: UTF-8 bytes as ids 3..258 (pad 0, bos 1, eos 2). Tiny models use it; a
    real checkpoint brings its own (``tokenizer/`` in ``model_path``)."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]


def load_hf_tokenizer(path: Path, *, within: Path | None = None):
    """A checkpoint's own tokenizer (transformers' files in ``path``), never with remote code. ``within``: the model
    folder ``path`` lies in (default ``path``): every file the tokenizer may read is checked first to be a regular
    file inside that folder's root and bounded in size (rlfleet.policies.model_folder)."""
    import os

    from transformers import AutoTokenizer
    from transformers.utils import logging

    from rlfleet.policies.model_folder import check_tokenizer_folder

    within = Path(within if within is not None else path)
    check_tokenizer_folder(within, os.path.relpath(os.path.abspath(path), os.path.abspath(within)))

    # never remote code: a released folder's config.json may name its own classes (auto_map, as OpenVLA's); the
    # tokenizer needs none, and transformers then reads that config as a plain one (its warning says only that)
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - code it would have to run (auto_map), files it cannot parse: one line
        from rlfleet.untrusted import BadFile

        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise BadFile(
            path,
            "tokenizer",
            "files transformers' AutoTokenizer loads without running the folder's code",
            f"{type(exc).__name__}: {first[:160]}",
        ) from None
    finally:
        logging.set_verbosity(level)

    class _Wrapped:
        pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        bos_token_id = tok.bos_token_id
        vocab_size = len(tok)

        def encode(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        def save_pretrained(self, directory) -> None:
            tok.save_pretrained(str(directory))

    return _Wrapped()


def has_tokenizer_files(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def byte_tokenizer_as_hf():
    """``ByteTokenizer`` as a transformers tokenizer with the same ids (byte-level BPE without merges: byte b is id
    3 + b; pad, bos, eos are 0, 1, 2 and never matched in text), so a model that uses it can be written with real
    tokenizer files (tokenizer.json, tokenizer_config.json) that ``AutoTokenizer`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the printable character byte-level BPE writes it as
    specials = {
        "<pad>": ByteTokenizer.pad_token_id,
        "<s>": ByteTokenizer.bos_token_id,
        "</s>": ByteTokenizer.eos_token_id,
    }
    tok = Tokenizer(models.BPE(vocab={**specials, **{chars[b]: 3 + b for b in range(256)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", split_special_tokens=True
    )


def save_tokenizer_files(tokenizer, path: Path) -> None:
    """The tokenizer's files in ``path`` itself, as released checkpoints keep them (the byte tokenizer of tiny
    models as its transformers equivalent, ``byte_tokenizer_as_hf``)."""
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = byte_tokenizer_as_hf()
    tokenizer.save_pretrained(str(path))


def save_tokenizer(tokenizer, path: Path) -> None:
    """A checkpoint's own tokenizer goes into ``tokenizer/`` of the layout rlfleet writes (the byte tokenizer of
    tiny models needs no files)."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(path / "tokenizer")
