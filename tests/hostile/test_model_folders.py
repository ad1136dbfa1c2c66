"""Model folders that lie (actor.model.model_path): each built by the project's own writers (save_pretrained in
rlfleet's layout, save_upstream in OpenVLA's released layout, transformers' own π0 save_pretrained), then tampered
with. A safetensors header that claims a terabyte is refused in well under a second without allocating; a shard,
config, statistics file or tokenizer linked out of the folder, or named by the index as ``../x.safetensors``, is
refused although it would load; config sizes beyond their bounds, or beyond what the weights fill, are refused before
the model is built; the folder's own code (auto_map) never runs; every refusal is one line naming the file."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time

import pytest
import torch

from rlfleet.config import load_config
from rlfleet.policies import build_policy
from rlfleet.policies.models.openvla.hub_layout import safetensors_index_problems
from rlfleet.untrusted import BadFile, OutsideRoot, TooLarge
from rlfleet.wire.spaces import TensorSpace

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECS = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
TINY = [
    "actor.model.model_type=openvla_oft",
    "actor.model.vla.image_size=32",
    "actor.model.num_action_chunks=2",
    "actor.model.vla.vision_layers=1",
    "actor.model.vla.llm_layers=1",
    "actor.model.use_proprio=true",
    "env.train.max_steps_per_rollout_epoch=32",
    "actor.global_batch_size=256",
    "actor.micro_batch_size=256",
]
TB = 1 << 40


def _cfg(path=None, *overrides):
    return load_config(None, [*TINY, *([f"actor.model.model_path={path}"] if path else []), *overrides])


def _load(path, *overrides):
    return build_policy(_cfg(path, *overrides).actor.model, SPECS, 4, True, "token_level")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same tiny OpenVLA-OFT (with a proprio projector) in rlfleet's layout and in OpenVLA's released layout
    (sharded, with its index, tokenizer files, auto_map and OFT's proprio_projector--<step>_checkpoint.pt)."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    policy = build_policy(_cfg().actor.model, SPECS, 4, True, "token_level")
    policy.save_pretrained(root / "rlfleet")
    policy.save_upstream(root / "upstream", step=7, max_shard_size="200KB")
    assert (root / "upstream" / "model.safetensors.index.json").is_file()
    assert (root / "upstream" / "proprio_projector--7_checkpoint.pt").is_file()
    assert "auto_map" in json.loads((root / "upstream" / "config.json").read_text())
    return root


@pytest.fixture
def rl(folders, tmp_path):
    shutil.copytree(folders / "rlfleet", tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture
def upstream(folders, tmp_path):
    shutil.copytree(folders / "upstream", tmp_path / "up")
    return tmp_path / "up"


def test_the_untampered_folders_load(rl, upstream):
    for path in (rl, upstream):
        assert isinstance(_load(path).llm, torch.nn.Module)
    assert not safetensors_index_problems(upstream)


def _terabyte_file(path: pathlib.Path, how: str) -> None:
    """A safetensors file of a few bytes whose header claims a terabyte: its length, or a tensor's byte range."""
    if how == "header length":
        path.write_bytes(struct.pack("<Q", TB) + b'{"w": {}}')
        return
    header = json.dumps({"w": {"dtype": "F32", "shape": [TB // 4], "data_offsets": [0, TB]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))


MEASURE = r"""
import json, resource, sys, time, tracemalloc, torch
torch.set_num_threads(1)
from rlfleet.config import load_config
from rlfleet.policies import build_policy, footprint
from rlfleet.wire.spaces import TensorSpace
specs = {"third_person": TensorSpace((32, 32, 3), "uint8"), "state": TensorSpace((7,), "float32")}
good, bad, tiny = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
build_policy(load_config(None, [*tiny, f"actor.model.model_path={good}"]).actor.model, specs, 4, True, "token_level")
out = {}
for what in ("build_policy", "footprint.estimate"):
    cfg = load_config(None, [*tiny, f"actor.model.model_path={bad}"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        if what == "build_policy":
            build_policy(cfg.actor.model, specs, 4, True, "token_level")
        else:
            footprint.estimate(cfg.actor.model, "token_level")
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    seconds = time.perf_counter() - t0
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out[what] = {"error": error, "seconds": seconds, "python_peak": python_peak,
                 "rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}
print(json.dumps(out))
"""


@pytest.mark.parametrize("how", ["header length", "tensor data_offsets"])
def test_a_safetensors_header_claiming_a_terabyte_is_refused_without_allocating(rl, tmp_path, folders, how):
    """The loader (build_policy) and the memory estimate (footprint.estimate, which read the header with
    read(length) before) refuse it, measured in a process of its own after a warm-up load of the good folder: well
    under a second, the peak RSS and Python's own allocations grow by a few MB at most."""
    _terabyte_file(rl / "model.safetensors", how)
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folders / "rlfleet"), str(rl), json.dumps(TINY)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for what, got in out.items():
        assert got["error"] and got["error"][0] == "TooLarge", (what, got)
        msg = got["error"][1]
        assert "\n" not in msg and msg.startswith(str(rl / "model.safetensors")), msg
        assert ("header length" if how == "header length" else "tensor 'w' data_offsets") in msg, msg
        assert got["seconds"] < 0.5, (what, got)
        assert got["rss_growth"] < 32 * 2**20 and got["python_peak"] < 4 * 2**20, (what, got)
    print(
        f"\n1 TB header ({how}): "
        + "; ".join(
            f"{w} {g['seconds'] * 1e3:.1f} ms, peak RSS +{g['rss_growth'] / 2**20:.1f} MiB, Python peak "
            f"{g['python_peak'] / 2**10:.0f} KiB"
            for w, g in out.items()
        )
    )
    # and in this process, through the same readers
    t0 = time.perf_counter()
    with pytest.raises(TooLarge):
        _load(rl)
    assert time.perf_counter() - t0 < 1.0


def test_an_index_naming_a_shard_outside_the_folder_is_refused(upstream, tmp_path):
    """model.safetensors.index.json's weight_map names ``../x.safetensors``: a real shard that would load."""
    index = json.loads((upstream / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.replace(upstream / shard, tmp_path / "x.safetensors")
    index["weight_map"] = {k: ("../x.safetensors" if v == shard else v) for k, v in index["weight_map"].items()}
    (upstream / "model.safetensors.index.json").write_text(json.dumps(index))
    for read in (lambda: _load(upstream), lambda: safetensors_index_problems(upstream)):
        with pytest.raises(OutsideRoot) as err:
            read()
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(str(upstream / "model.safetensors.index.json") + ": weight_map[")
        assert "'../x.safetensors'" in msg


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "dataset_statistics.json", "tokenizer"])
def test_a_file_linked_out_of_the_folder_is_refused(rl, tmp_path, name):
    """Each file the loader reads, replaced by a link to a good copy outside the folder (which would load)."""
    from rlfleet.policies.models.openvla.tokenizers import byte_tokenizer_as_hf

    outside = tmp_path / "outside"
    outside.mkdir()
    stats = {"bridge": {"action": {"q01": [-1.0] * 4, "q99": [1.0] * 4}}}
    if name == "tokenizer":
        byte_tokenizer_as_hf().save_pretrained(str(outside / name))  # the byte tokenizer's ids: it would load
    elif name == "dataset_statistics.json":
        (outside / name).write_text(json.dumps(stats))
    else:
        shutil.copy(rl / name, outside / name)
        (rl / name).unlink()
    os.symlink(outside / name, rl / name)
    key = ["actor.model.unnorm_key=bridge"] if name == "dataset_statistics.json" else []
    with pytest.raises(OutsideRoot) as err:
        _load(rl, *key)
    msg = str(err.value)
    assert "\n" not in msg and name in msg and "through a symbolic link" in msg, msg
    (rl / name).unlink()  # the same content inside the folder loads
    shutil.move(outside / name, rl / name)
    _load(rl, *key)


def test_config_sizes_beyond_their_bounds_or_beyond_the_weights_are_refused_before_building(rl, upstream):
    cfg = json.loads((rl / "config.json").read_text())
    for key, value, field in (
        ("vocab_size", 10**12, "vla.vocab_size"),
        ("llm_layers", 10**9, "vla.llm_layers"),
        ("llm_hidden_size", "wide", "vla.llm_hidden_size"),
    ):
        (rl / "config.json").write_text(json.dumps({**cfg, "vla": {**cfg["vla"], key: value}}))
        with pytest.raises(BadFile) as err:
            _load(rl)
        assert str(err.value).startswith(f"{rl / 'config.json'}: {field}: expected "), str(err.value)
    # within the bounds, but a model its 1-layer weights cannot fill: refused by the meta-device build, in seconds
    (rl / "config.json").write_text(
        json.dumps({**cfg, "vla": {**cfg["vla"], "llm_layers": 1000, "llm_hidden_size": 4096, "vocab_size": 32000}})
    )
    t0 = time.perf_counter()
    with pytest.raises(
        TooLarge,
        match=r"config.json: sizes: expected a model of at most [\d,]+ elements \(its "
        r"safetensors hold [\d,]+\), found sizes that build [\d,]+$",
    ):
        _load(rl)
    assert time.perf_counter() - t0 < 30
    up = json.loads((upstream / "config.json").read_text())
    up["text_config"]["num_attention_heads"] = 10**6
    (upstream / "config.json").write_text(json.dumps(up))
    with pytest.raises(TooLarge, match=r"config.json: text_config.num_attention_heads: expected at most 1,024"):
        _load(upstream)


def test_statistics_that_lie_are_named(rl):
    path = rl / "dataset_statistics.json"
    for stats, field in (
        ({"bridge": {"action": {"q01": [-1.0] * 3, "q99": [1.0] * 3}}}, "bridge.action.q01"),
        ({"bridge": {"action": {"q01": "low", "q99": [1.0] * 4}}}, "bridge.action.q01"),
        ({"bridge": {"action": {"q01": [-1.0] * 4, "q99": [1.0] * 5}}}, "bridge.action"),
        ({"bridge": ["q01"]}, "bridge"),
    ):
        path.write_text(json.dumps(stats))
        with pytest.raises(BadFile) as err:
            _load(rl, "actor.model.unnorm_key=bridge")
        assert str(err.value).startswith(f"{path}: {field}: expected"), str(err.value)
    path.write_text('{"bridge": {"action": {"q01": [NaN, 0, 0, 0], "q99": [1, 1, 1, 1]}}}')
    with pytest.raises(BadFile, match="NaN is not JSON"):
        _load(rl, "actor.model.unnorm_key=bridge")


def _plant_code(folder: pathlib.Path, module: str, marker: pathlib.Path) -> None:
    """A module that, if anything ever imported it, would leave ``marker`` behind."""
    (folder / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast, PretrainedConfig, PreTrainedModel\n"
        "class EvilTokenizer(PreTrainedTokenizerFast): pass\n"
        "class OpenVLAConfig(PretrainedConfig): pass\n"
        "class OpenVLAForActionPrediction(PreTrainedModel): pass\n"
        "class PrismaticProcessor: pass\nclass PrismaticImageProcessor: pass\n"
    )


def _poison_tokenizer_config(folder: pathlib.Path) -> None:
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok.update(
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]},
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))


def test_a_folders_own_code_never_runs(upstream, rl, tmp_path):
    """The released layout names its classes (auto_map: configuration_prismatic, modeling_prismatic,
    processing_prismatic); with those files present and poisoned, and a tokenizer_config.json naming a tokenizer
    class of the folder's own, the folder loads by key mapping (transformers reads the tokenizer as a plain one)
    and none of them runs. In rlfleet's layout (tokenizer/ on its own) such a tokenizer is refused in one line,
    its code not run either."""
    from rlfleet.policies.models.openvla.tokenizers import byte_tokenizer_as_hf

    marker = tmp_path / "RAN"
    for module in ("configuration_prismatic", "modeling_prismatic", "processing_prismatic", "tokenization_evil"):
        _plant_code(upstream, module, marker)
    _poison_tokenizer_config(upstream)
    _load(upstream)
    assert not marker.exists()
    byte_tokenizer_as_hf().save_pretrained(str(rl / "tokenizer"))
    _load(rl)  # the tokenizer/ folder loads as it is
    _plant_code(rl / "tokenizer", "tokenization_evil", marker)
    _poison_tokenizer_config(rl / "tokenizer")
    with pytest.raises(BadFile) as err:
        _load(rl)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{rl / 'tokenizer'}: tokenizer: expected files ")
    assert not marker.exists()


def test_no_code_path_sets_trust_remote_code():
    """No call in rlfleet/ or services/ passes trust_remote_code other than the constant False."""
    wrong = []
    for path in sorted([*ROOT.glob("rlfleet/**/*.py"), *ROOT.glob("services/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.keyword)
                and node.arg == "trust_remote_code"
                and not (isinstance(node.value, ast.Constant) and node.value.value is False)
            ):
                wrong.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not wrong, wrong


def test_a_tokenizer_file_beyond_its_bound_is_refused_before_parsing(upstream):
    os.truncate(upstream / "tokenizer.json", 300 * 2**20)  # sparse: no disk written
    with pytest.raises(
        TooLarge,
        match=r"tokenizer.json: tokenizer.json: expected at most 268,435,456 bytes, found "
        r"314,572,800 bytes$",
    ):
        _load(upstream)


def test_oft_projector_pickles_run_no_code(upstream, tmp_path):
    """proprio_projector--*.pt is unpickled weights-only: a pickle that would call open() is refused, not run."""
    marker = tmp_path / "RAN"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")

    torch.save({"module.fc1.weight": Payload()}, upstream / "proprio_projector--7_checkpoint.pt")
    with pytest.raises(BadFile) as err:
        _load(upstream)
    assert "\n" not in str(err.value) and "proprio_projector--7_checkpoint.pt: state dict: expected" in str(err.value)
    assert not marker.exists()


@pytest.fixture(scope="module")
def pi0_folder(tmp_path_factory):
    from tests.rlfleet.test_openpi import _transformers_pi0_checkpoint

    path = tmp_path_factory.mktemp("pi0") / "pi0_base"
    _transformers_pi0_checkpoint(path)
    return path


PI0 = ["actor.model.model_type=openpi", "actor.model.num_action_chunks=4", "env.train.max_steps_per_rollout_epoch=32"]


def _load_pi0(path):
    return build_policy(
        load_config(None, [*PI0, f"actor.model.model_path={path}"]).actor.model, SPECS, 4, True, "chunk_level"
    )


def test_a_transformers_pi0_folder_is_checked_before_transformers_reads_it(pi0_folder, tmp_path):
    """transformers' own from_pretrained would follow an index's ``../`` shard, apply a peft adapter it finds, and
    build whatever sizes config.json gives: each is refused first."""
    path = tmp_path / "pi0"
    shutil.copytree(pi0_folder, path)
    _load_pi0(path)
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path), "r": 10**9}))
    with pytest.raises(BadFile, match=r"adapter_config.json: file: expected no peft adapter"):
        _load_pi0(path)
    (path / "adapter_config.json").unlink()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.replace(path / shard, tmp_path / shard)
    index["weight_map"] = {k: (f"../{shard}" if v == shard else v) for k, v in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(OutsideRoot, match=r"model.safetensors.index.json: weight_map\["):
        _load_pi0(path)
    shutil.rmtree(path)
    shutil.copytree(pi0_folder, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["vlm_config"]["text_config"]["intermediate_size"] = 1 << 18  # bounded, but 100M elements its weights lack
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TooLarge, match=r"config.json: sizes: expected a model of at most"):
        _load_pi0(path)
