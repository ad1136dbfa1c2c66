"""Checkpoints that lie (issue 33): a real pickle payload (``os.system("touch MARKER")`` on unpickling) planted in
``state/.metadata``, in a non-tensor item of a ``.distcp`` shard, in ``learner_state.json`` and in
``reward_rms.safetensors`` is refused by ``coordinatorctl eval``, ``export`` and ``start --resume`` as a user runs
them, with one line naming the file, and the marker is never created (each payload is first shown to run under the
reader torch or Python offers). A truncated shard, a ``.metadata`` pointing at ``../../x``, a shard that is a
symbolic link out of the run folder and absurd lengths are named before anything starts; a corrupt file the
learner itself meets is a named FAILED_PRECONDITION in seconds (it was DEADLINE_EXCEEDED after 126 s), on one rank
and on two.

One short real run (real processes, gRPC, MuJoCo, PPO) is trained per module; each case corrupts a copy of it."""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from rlfleet.data.checkpoint_files import METADATA_GLOBALS, read_metadata, verify_checkpoint
from rlfleet.untrusted import BadFile, OutsideRoot, TooLarge
from tests.services.coordinator.test_eval_cli import TINY, ctl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEP = "global_step_2"  # TINY trains 2 epochs and saves at its end
LR = "optim.param_groups.0.lr"  # a non-tensor item DCP stores with torch.save
WEIGHT = "model.actor_mean.0.weight"


class Payload:
    """What a crafted file carries: unpickling it runs ``touch MARKER`` through os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A trained MLP run (2 epochs of the default task, shortened, as test_eval_cli trains it): its folder."""
    base = tmp_path_factory.mktemp("hostile-checkpoints")
    proc = ctl("start", *TINY, f"runner.logger.log_path={base}", "runner.experiment_name=trained")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (base / "trained" / "checkpoints" / STEP / "learner_state.json").is_file()
    return base / "trained"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run folder, this case's to corrupt."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def _state(run: Path) -> Path:
    return run / "checkpoints" / STEP / "state"


def _write_metadata(state: Path, md) -> None:
    (state / ".metadata").write_bytes(pickle.dumps(md))  # as DCP writes it (FileSystemWriter: pickle.dump)


# --- the plants: each returns what the refusal names ---------------------------------------------------------------
def plant_metadata(run: Path, marker: Path) -> list[str]:
    """The real metadata with a payload among its fields: the whole file still unpickles as DCP's Metadata."""
    md = read_metadata(_state(run))
    md.storage_meta.modules = [Payload(marker)]
    _write_metadata(_state(run), md)
    return [
        ".metadata: pickled global: expected only torch.distributed.checkpoint's metadata classes",
        "found 'posix.system'",
    ]


def plant_byte_item(run: Path, marker: Path) -> list[str]:
    """The optimizer's learning rate replaced by a torch.save'd payload appended to the shard (its metadata
    entry moved there), as DCP stores a non-tensor item."""
    state = _state(run)
    md = read_metadata(state)
    key = MetadataIndex(LR)
    rel = md.storage_data[key].relative_path
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    shard = state / rel
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[key] = _StorageInfo(rel, offset, len(buf.getvalue()))
    _write_metadata(state, md)
    return [
        f"{rel}: item '{LR}': expected a plain value torch.load(weights_only=True) reads",
        "unsupported GLOBAL posix.system",
    ]


def plant_learner_state(run: Path, marker: Path) -> list[str]:
    (run / "checkpoints" / STEP / "learner_state.json").write_bytes(pickle.dumps({"epoch": Payload(marker)}))
    return ["learner_state.json: learner state: expected valid UTF-8 JSON"]


def plant_reward_rms(run: Path, marker: Path) -> list[str]:
    path = run / "checkpoints" / STEP / "reward_rms.safetensors"
    torch.save({"mean": Payload(marker)}, path)
    return ["reward_rms.safetensors: header length: expected at most"]


PAYLOADS = {
    "metadata": plant_metadata,
    "byte item": plant_byte_item,
    "learner_state.json": plant_learner_state,
    "reward_rms.safetensors": plant_reward_rms,
}
# the reader each file would meet without rlfleet's checks (torch's own DCP reader and converter, pickle, torch.load)
NAIVE = {
    "metadata": "from torch.distributed.checkpoint import FileSystemReader; "
    "FileSystemReader(CKPT + '/state').read_metadata()",
    "byte item": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(CKPT + '/state', CKPT + '/../whole.pt')",
    "learner_state.json": "import pickle; pickle.load(open(CKPT + '/learner_state.json', 'rb'))",
    "reward_rms.safetensors": "import torch; torch.load(open(CKPT + '/reward_rms.safetensors', 'rb'), "
    "weights_only=False)",
}


def _command(which: str, run: Path, tmp_path: Path) -> tuple[list, str]:
    """The command line as a user types it, and the prefix of its one-line refusal."""
    if which == "eval":
        return ["eval", run], "coordinatorctl eval: "
    if which == "export":
        return ["export", run, tmp_path / "out"], "coordinatorctl export: "
    return ["start", "--resume", run, "runner.max_epochs=3"], "coordinatorctl: config error: 'runner.resume_dir': "


def _refused(which: str, run: Path, tmp_path: Path, expect: list[str]) -> float:
    """Run the command; it must exit 2 with one line naming the bad file, having started nothing; -> seconds."""
    logs = {p.name: p.read_bytes() for p in (run / "logs").iterdir()}
    args, prefix = _command(which, run, tmp_path)
    t0 = time.monotonic()
    proc = ctl(*args, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    assert str(run / "checkpoints" / STEP) in lines[0], lines[0]
    for part in expect:
        assert part in lines[0], (part, lines[0])
    assert {p.name: p.read_bytes() for p in (run / "logs").iterdir()} == logs  # no service started, none logged
    assert not (run / "eval").exists() and not (tmp_path / "out").exists()
    return took


# --- payloads ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", list(PAYLOADS))
def test_each_payload_runs_under_the_plain_reader(run, tmp_path, where):
    """The control: the planted payload is live. The reader torch or Python offers for that file (DCP's
    FileSystemReader, DCP's dcp_to_torch_save, pickle.load, torch.load) creates the marker."""
    marker = tmp_path / "MARKER"
    PAYLOADS[where](run, marker)
    code = f"import sys; CKPT = sys.argv[1]; {NAIVE[where]}"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run / "checkpoints" / STEP)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert marker.exists(), (
        f"the {where} payload did not run under the plain reader: the test would prove nothing\n{proc.stderr[-2000:]}"
    )


@pytest.mark.parametrize("which", ["eval", "export", "resume"])
@pytest.mark.parametrize("where", list(PAYLOADS))
def test_a_payload_is_refused_by_name_and_never_runs(run, tmp_path, where, which):
    marker = tmp_path / "MARKER"
    expect = PAYLOADS[where](run, marker)
    _refused(which, run, tmp_path, expect)
    assert not marker.exists()


# --- files that lie about where and how long -----------------------------------------------------------------------
def truncate_shard(run: Path, tmp_path: Path) -> list[str]:
    shard = _state(run) / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    return ["__0_0.distcp: bytes ", f"expected inside the file's {size // 2:,} bytes", "truncated"]


def metadata_points_outside(run: Path, tmp_path: Path) -> list[str]:
    (run / "checkpoints" / "x").write_bytes(b"\0" * 4096)  # what ../../x would reach from the state folder: exists
    md = read_metadata(_state(run))
    md.storage_data[MetadataIndex(LR)] = _StorageInfo("../../x", 0, 10)
    _write_metadata(_state(run), md)
    return [f".metadata: storage_data['{LR}'].relative_path: expected a plain file name in", "found '../../x'"]


def shard_links_outside(run: Path, tmp_path: Path) -> list[str]:
    shard = _state(run) / "__0_0.distcp"
    outside = tmp_path / "elsewhere" / "__0_0.distcp"
    outside.parent.mkdir()
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    return ["relative_path: expected a path inside", "(through a symbolic link)"]


def absurd_length(run: Path, tmp_path: Path) -> list[str]:
    md = read_metadata(_state(run))
    key = next(k for k in md.storage_data if k.fqn == WEIGHT)
    md.storage_data[key] = _StorageInfo(md.storage_data[key].relative_path, 0, 1 << 60)
    _write_metadata(_state(run), md)
    return [f"bytes 0..{1 << 60:,} of '{WEIGHT}'", "beyond its end"]


def negative_offset(run: Path, tmp_path: Path) -> list[str]:
    md = read_metadata(_state(run))
    key = next(k for k in md.storage_data if k.fqn == WEIGHT)
    md.storage_data[key] = _StorageInfo(md.storage_data[key].relative_path, -4096, 100)
    _write_metadata(_state(run), md)
    return [f"storage_data['{WEIGHT}'] offset/length: expected non-negative integers, found -4096, 100"]


LIES = {
    "truncated shard": truncate_shard,
    "relative path ../../x": metadata_points_outside,
    "shard links outside": shard_links_outside,
    "absurd length": absurd_length,
    "negative offset": negative_offset,
}


@pytest.mark.parametrize("lie", list(LIES))
def test_resume_names_a_lying_checkpoint_before_anything_starts(run, tmp_path, lie):
    """`coordinatorctl start --resume` names the file in seconds (a truncated shard took 126 s and ended in
    DEADLINE_EXCEEDED with nothing in the learner's log before) and starts no service. The whole command's wall
    time is printed (alone on this machine: 3.0-3.5 s, Python and torch's start included); the bound leaves room for
    the suite's other worker on the same two cores, and still fails a command that waits on a deadline."""
    expect = LIES[lie](run, tmp_path)
    took = _refused("resume", run, tmp_path, expect)
    print(f"--resume with a checkpoint whose {lie}: named after {took:.1f}s")
    assert took < 30, f"{lie}: named after {took:.1f}s"


@pytest.mark.parametrize("which", ["eval", "export"])
def test_eval_and_export_name_a_truncated_shard(run, tmp_path, which):
    _refused(which, run, tmp_path, truncate_shard(run, tmp_path))


@pytest.mark.parametrize("lie", list(LIES))
def test_verify_checkpoint_refuses_each_lie_with_its_kind(run, tmp_path, lie):
    expect = LIES[lie](run, tmp_path)
    kind = {"truncated shard": TooLarge, "absurd length": TooLarge, "negative offset": BadFile}.get(lie, OutsideRoot)
    with pytest.raises(kind) as err:
        verify_checkpoint(run / "checkpoints" / STEP)
    assert all(part in str(err.value) for part in expect), str(err.value)
    assert "\n" not in str(err.value)


def test_the_metadata_whitelist_is_what_a_real_save_needs(trained):
    """Every global the real .metadata refers to is admitted (the unpickler records none refused), and none of the
    admitted names is a function that could run a command."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(_state(trained) / ".metadata", "rb") as f:  # the file this module's own run wrote
        Recorder(f).load()
    assert seen <= METADATA_GLOBALS and ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert not {m for m, _ in METADATA_GLOBALS} & {"os", "posix", "builtins", "subprocess", "sys", "importlib"}


def test_a_symlinked_checkpoint_folder_out_of_the_run_is_refused(run, tmp_path):
    ckpt = run / "checkpoints" / STEP
    elsewhere = tmp_path / "elsewhere-ckpt"
    shutil.move(ckpt, elsewhere)
    ckpt.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OutsideRoot, match="checkpoint folder: expected a path inside"):
        verify_checkpoint(ckpt)


# --- the learner itself --------------------------------------------------------------------------------------------
def _corrupt_tensor_record(run: Path) -> str:
    """The last bytes of the policy's first weight record zeroed, in place: sizes and offsets still agree (the
    verification passes), the record no longer loads."""
    md = read_metadata(_state(run))
    info = next(v for k, v in md.storage_data.items() if k.fqn == WEIGHT)
    with open(_state(run) / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length - 64)
        f.write(b"\0" * 64)
    return info.relative_path


def _learner_state_bad_field(run: Path) -> list[str]:
    path = run / "checkpoints" / STEP / "learner_state.json"
    state = json.loads(path.read_text())
    state["env_steps"] = "400; import os"
    path.write_text(json.dumps(state))
    return ["learner_state.json: env_steps: expected an integer, found '400; import os'"]


def _reward_rms_bad_header(run: Path) -> list[str]:
    path = run / "checkpoints" / STEP / "reward_rms.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"[1, "  # the JSON header broken
    path.write_bytes(bytes(data))
    return ["reward_rms.safetensors: line 1 column"]


@pytest.mark.parametrize("case", ["learner_state.json", "reward_rms.safetensors", "shard body"])
def test_the_learner_reports_a_bad_checkpoint_by_name_over_grpc(run, case, caplog):
    """The learner (rank 0, over gRPC) meets a bad checkpoint when the coordinator's check is bypassed (another
    launcher, a file changed since): PublishWeights fails at once with FAILED_PRECONDITION naming the file (was
    INTERNAL with a raw exception type, or for a shard no answer at all until the caller's deadline), and the
    learner logs it."""
    from rlfleet.config import load_config
    from rlfleet.v1 import env_pb2, learner_pb2, learner_pb2_grpc
    from rlfleet.wire import channels
    from rlfleet.wire.spaces import TensorSpace, spaces_to_proto
    from services.learner import server as learner_server

    state = json.loads((run / "checkpoints" / STEP / "learner_state.json").read_text())
    spec = env_pb2.EnvSpec(
        env_id="PandaPickCube-v0",
        num_envs=8,
        observation_space=spaces_to_proto({k: TensorSpace.from_json(v) for k, v in state["obs_specs"].items()}),
        action_space=TensorSpace((state["action_dim"],), "float32", -1.0, 1.0).to_proto(),
    )
    if case == "learner_state.json":
        expect = _learner_state_bad_field(run)
    elif case == "reward_rms.safetensors":
        expect = _reward_rms_bad_header(run)
    else:
        # past the verification: the record itself fails to load, named by file and item
        expect = [
            f"{_corrupt_tensor_record(run)}: item '{WEIGHT}' (bytes ",
            "expected a record torch.load(weights_only=True) reads",
        ]
    cfg = load_config(run / "config.yaml", [f"runner.resume_dir={run}"])
    server, address, learner, _runtime = learner_server.serve(cfg, "127.0.0.1:0", str(run))
    try:
        stub = learner_pb2_grpc.LearnerServiceStub(channels.channel(address))
        t0 = time.monotonic()
        with caplog.at_level("ERROR", logger="rlfleet.learner"), pytest.raises(grpc.RpcError) as err:
            stub.PublishWeights(learner_pb2.PublishWeightsRequest(env_spec=spec), timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        server.stop(0)
        learner.close()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    details = err.value.details()
    assert details.startswith("runner.resume_dir: ") and "\n" not in details, details
    assert all(part in details for part in expect), details
    assert any("cannot resume from" in r.getMessage() and expect[0] in r.getMessage() for r in caplog.records)


def test_two_ranks_name_a_bad_shard_and_neither_hangs(tmp_path):
    """A checkpoint saved by 2 FSDP2 ranks passes the verification (the whitelist covers a sharded save); with one
    shard's record corrupted past the verification, both ranks fail the load with the same named error (DCP
    gathers it to every rank) and the group ends at once instead of waiting on a collective."""
    scenarios = ROOT / "tests" / "services" / "learner" / "rank_scenarios.py"

    def ranks(scenario, out, *opts, timeout=240):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(scenarios),
            scenario,
            str(out),
            *opts,
        ]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    proc = ranks("save", tmp_path / "saved", "epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "saved" / "run"
    ckpt = run / "checkpoints" / "global_step_1"
    info = verify_checkpoint(ckpt)
    assert sorted(p.name for p in (ckpt / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert info.state["world_size"] == 2 and info.items[LR] == pytest.approx(1e-3)
    md = read_metadata(ckpt / "state")
    key, sinfo = next(
        (k, v) for k, v in md.storage_data.items() if k.fqn == WEIGHT and v.relative_path == "__1_0.distcp"
    )
    with open(ckpt / "state" / "__1_0.distcp", "r+b") as f:
        f.seek(sinfo.offset + sinfo.length - 64)
        f.write(b"\0" * 64)
    verify_checkpoint(ckpt)  # sizes still agree: the load itself must name it
    t0 = time.monotonic()
    proc = ranks("resume", tmp_path / "resumed", f"resume={run}", "epochs=2")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    named = f"FailedPrecondition: runner.resume_dir: {ckpt / 'state' / '__1_0.distcp'}: item "
    assert named in out and "expected a record torch.load(weights_only=True) reads" in out, out[-4000:]
    assert took < 120, f"the group took {took:.0f}s to end"
