"""LeRobot datasets that lie (sft.dataset_path, Dataset): each written by the project's own DatasetWriter, then
tampered with. A video_path template or a link that leads out of the dataset is refused although what lies there
would decode, and that file is never opened; a template with fields of its own, a truncated or non-parquet file, a
column of the wrong width, an info.json with a string fps or a huge shape, episodes whose bounds disagree, frames
of another size, an image feature naming a file outside: each one line naming the file, the field and what was
expected. ``coordinatorctl sft`` prints that line; ``collect-demos`` never writes through a link."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rlfleet.data.datasets as ds
from rlfleet.data.datasets import Dataset, DatasetWriter, Episode, decode_video
from rlfleet.untrusted import BadFile, OutsideRoot, TooLarge

DATA = "data/chunk-000/file-000.parquet"
VIDEO = "videos/observation.images.cam/chunk-000/file-000.mp4"
EPISODES = "meta/episodes/chunk-000/file-000.parquet"


def _episode(T: int, seed: int) -> Episode:
    rng = np.random.default_rng(seed)
    img = np.zeros((T, 32, 32, 3), np.uint8)
    img[:, :16] = (60 + 20 * seed, 140, 90)
    return Episode(
        {"cam": img, "state": rng.normal(size=(T, 3)).astype(np.float32)},
        rng.uniform(-1, 1, (T, 4)).astype(np.float32),
        np.zeros(T, np.float32),
        np.arange(T) == T - 1,
        f"task {seed}",
        seed,
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("written") / "demos"
    w = DatasetWriter(root, env_id="Toy-v0", simulator="gym", fps=10, source="test")
    for seed in (1, 2):
        w.add(_episode(4, seed))
    w.close()
    return root


@pytest.fixture
def dataset(written, tmp_path):
    shutil.copytree(written, tmp_path / "demos")
    return tmp_path / "demos"


def _info(root, **changes):
    info = json.loads((root / "meta" / "info.json").read_text())
    info.update(changes)
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return info


def _read_all(root, keys=None):
    d = Dataset(root, keys)
    return [d.episode(i) for i in range(len(d))]


def _one_line(err, start: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(start), msg
    return msg


@pytest.fixture
def opened(monkeypatch):
    """Every file the video reader opens (the module's open() and PyAV's av.open), by real path."""
    import av

    seen: list[str] = []
    real_open, real_av_open = open, av.open

    def spy_open(file, *a, **kw):
        if isinstance(file, (str, os.PathLike)):
            seen.append(os.path.realpath(file))
        return real_open(file, *a, **kw)

    def spy_av_open(file, *a, **kw):
        seen.append(
            os.path.realpath(file)
            if isinstance(file, (str, os.PathLike))
            else os.path.realpath(getattr(file, "name", "?"))
        )
        return real_av_open(file, *a, **kw)

    monkeypatch.setattr(ds, "open", spy_open, raising=False)
    monkeypatch.setattr(av, "open", spy_av_open)
    return seen


def test_the_untampered_dataset_reads(dataset, opened):
    eps = _read_all(dataset)
    assert len(eps) == 2 and eps[0].observations["cam"].shape == (4, 32, 32, 3)
    assert os.path.realpath(dataset / VIDEO) in opened  # the spy sees what the reader opens


def test_a_video_path_template_out_of_the_dataset_is_refused_and_never_opened(dataset, tmp_path, opened):
    """video_path = ../../secret/...: a real video lies there (it decodes), the reader never opens it."""
    secret = tmp_path / "secret" / "observation.images.cam" / "chunk-000" / "file-000.mp4"
    secret.parent.mkdir(parents=True)
    shutil.copy(dataset / VIDEO, secret)
    assert decode_video(secret)[0].shape == (8, 32, 32, 3)  # it would decode fine
    opened.clear()
    _info(dataset, video_path="../../secret/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4")
    with pytest.raises(OutsideRoot) as err:
        _read_all(dataset)
    _one_line(
        err,
        f"{dataset / 'meta' / 'info.json'}: video_path: expected a path inside {dataset}, found "
        f"'../../secret/observation.images.cam/chunk-000/file-000.mp4'",
    )
    assert os.path.realpath(secret) not in opened and not any("secret" in p for p in opened)


def test_a_video_linked_out_of_the_dataset_is_refused_and_never_opened(dataset, tmp_path, opened):
    outside = tmp_path / "elsewhere.mp4"
    shutil.move(dataset / VIDEO, outside)
    os.symlink(outside, dataset / VIDEO)
    opened.clear()
    with pytest.raises(OutsideRoot) as err:
        _read_all(dataset)
    assert "through a symbolic link" in _one_line(err, f"{dataset / 'meta' / 'info.json'}: video_path: expected ")
    assert os.path.realpath(outside) not in opened
    os.unlink(dataset / VIDEO)  # the same file inside the dataset reads
    shutil.move(outside, dataset / VIDEO)
    assert len(_read_all(dataset)) == 2


def test_data_and_metadata_files_linked_or_templated_out_are_refused(dataset, tmp_path):
    shutil.copytree(dataset, tmp_path / "copy")
    _info(dataset, data_path="../copy/data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet")
    with pytest.raises(OutsideRoot) as err:
        _read_all(dataset)
    _one_line(err, f"{dataset / 'meta' / 'info.json'}: data_path: expected a path inside")
    for rel in (DATA, EPISODES, "meta/tasks.parquet", "meta/info.json"):
        shutil.rmtree(dataset)
        shutil.copytree(tmp_path / "copy", dataset)
        (dataset / rel).unlink()
        os.symlink(tmp_path / "copy" / rel, dataset / rel)  # the very same content, outside
        with pytest.raises(OutsideRoot) as err:
            _read_all(dataset)
        assert "through a symbolic link" in str(err.value) and "\n" not in str(err.value), (rel, str(err.value))


@pytest.mark.parametrize(
    "template, found",
    [
        ("videos/{video_key.__class__}/file-{file_index:03d}.mp4", "{video_key.__class__}"),
        ("videos/{video_key}/file-{file_index:0>999999999}.mp4", "{file_index:0>999999999}"),
        ("videos/{video_key!r}/{file_index}.mp4", "{video_key!r}"),
        ("videos/{0}/{file_index}.mp4", "{0}"),
        ("videos/{video_key/{file_index}.mp4", "unexpected '{' in field name"),
    ],
)
def test_templates_with_fields_of_their_own_are_refused(dataset, template, found):
    """Attribute access, a billion-wide padding, conversions, positional fields: refused before formatting."""
    _info(dataset, video_path=template)
    with pytest.raises(BadFile) as err:
        Dataset(dataset)
    msg = _one_line(
        err,
        f"{dataset / 'meta' / 'info.json'}: video_path: expected a path template whose fields are "
        "{video_key}, {chunk_index}, {file_index}",
    )
    assert found in msg


def test_a_truncated_or_foreign_parquet_file_is_named(dataset):
    data = (dataset / DATA).read_bytes()
    (dataset / DATA).write_bytes(data[: len(data) // 2])
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    _one_line(err, f"{dataset / DATA}: parquet footer: expected a parquet file, found ")
    (dataset / DATA).write_bytes(b"PAR1" + b"\0" * 64 + data[-len(data) // 3 :])  # a footer, pages that are not
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    _one_line(err, f"{dataset / DATA}: ")
    (dataset / "meta" / "tasks.parquet").write_text("task_index,task\n0,pick\n")
    with pytest.raises(BadFile) as err:
        Dataset(dataset)
    _one_line(err, f"{dataset / 'meta' / 'tasks.parquet'}: parquet footer: expected a parquet file")


def test_a_column_of_the_wrong_width_is_named_with_its_feature(dataset):
    """info.json says observation.state holds 13 floats a frame; the data file holds 3."""
    info = json.loads((dataset / "meta" / "info.json").read_text())
    info["features"]["observation.state"]["shape"] = [13]
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    assert str(err.value) == (
        f"{dataset / DATA}: column 'observation.state': expected 13 numbers per row (meta/info.json features), found 3"
    )
    # rows of uneven length in a list column, and strings where numbers belong
    table = pq.read_table(dataset / DATA)
    rows = [list(r) for r in table.column("observation.state").to_pylist()]
    rows[5] = rows[5][:2]
    info["features"]["observation.state"]["shape"] = [3]
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    i = table.column_names.index("observation.state")
    pq.write_table(table.set_column(i, "observation.state", pa.array(rows, pa.list_(pa.float32()))), dataset / DATA)
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    assert str(err.value).endswith(
        "column 'observation.state': expected 3 numbers per row (meta/info.json features), found 2 in row 5"
    )
    j = table.column_names.index("next.reward")
    pq.write_table(table.set_column(j, "next.reward", pa.array(["x"] * table.num_rows)), dataset / DATA)
    with pytest.raises(
        BadFile,
        match=r"column 'next.reward': expected numbers \(meta/info.json features\), "
        r"found string$",
    ):
        _read_all(dataset)


@pytest.mark.parametrize(
    "change, start",
    [
        ({"fps": "30"}, "fps: expected a number of frames per second in (0, 10000], found '30'"),
        ({"fps": None}, "fps: expected a number"),
        ({"total_episodes": 10**15}, "total_episodes: expected at most 10,000,000, found 1,000,000,000,000,000"),
        ({"features": []}, "features: expected a JSON object of features"),
        ({"features": {"action": {"dtype": "object", "shape": [4]}}}, "features['action'].dtype: expected one of"),
        (
            {"features": {"action": {"dtype": "float32", "shape": [100000, 100000, 3]}}},
            "features['action'].shape: expected at most 65,536, found 100,000",
        ),
        (
            {"features": {"action": {"dtype": "float32", "shape": [60000, 60000]}}},
            "features['action'].shape (elements per frame): expected at most 67,108,864, found 3,600,000,000",
        ),
        ({"features": {"action": {"dtype": "float32", "shape": "4"}}}, "features['action'].shape: expected a list"),
        ({"rlfleet": {"env_id": ["x"]}}, "rlfleet.env_id: expected a string"),
    ],
)
def test_info_json_fields_with_wrong_types_or_huge_shapes_are_named(dataset, change, start):
    _info(dataset, **change)
    with pytest.raises(BadFile) as err:
        Dataset(dataset)
    _one_line(err, f"{dataset / 'meta' / 'info.json'}: {start}")


def test_info_json_beyond_its_bound_or_not_json_is_named(dataset, monkeypatch):
    (dataset / "meta" / "info.json").write_text('{"codebase_version": "v3.0", "fps": NaN}')
    with pytest.raises(BadFile, match=r"info.json: meta/info.json: expected valid UTF-8 JSON, found NaN is not JSON"):
        Dataset(dataset)
    os.truncate(dataset / "meta" / "info.json", 17 * 2**20)  # sparse: 17 MiB of NULs
    with pytest.raises(TooLarge, match=r"info.json: meta/info.json: expected at most 16,777,216 bytes"):
        Dataset(dataset)


def test_parquet_footers_are_checked_before_a_table_is_read(dataset, monkeypatch):
    monkeypatch.setattr(ds, "MAX_PARQUET_ROWS", 7)  # the data file's footer says 8 rows
    with pytest.raises(TooLarge) as err:
        _read_all(dataset)
    _one_line(err, f"{dataset / DATA}: num_rows (parquet footer): expected at most 7, found 8")
    monkeypatch.setattr(ds, "MAX_PARQUET_ROWS", 1 << 26)
    monkeypatch.setattr(ds, "MAX_TABLE_BYTES", 100)
    with pytest.raises(TooLarge, match=r"uncompressed bytes \(parquet footer\): expected at most 100"):
        Dataset(dataset)


def test_episode_rows_that_disagree_are_named(dataset):
    table = pq.read_table(dataset / EPISODES)
    i = table.column_names.index("dataset_to_index")
    pq.write_table(table.set_column(i, "dataset_to_index", pa.array([4, 10**6])), dataset / EPISODES)
    with pytest.raises(BadFile) as err:
        Dataset(dataset)
    assert str(err.value) == (
        f"{dataset / EPISODES}: episode 1: dataset_to_index: expected dataset_from_index + length = 8, found 1000000"
    )
    j = table.column_names.index("length")
    pq.write_table(table.set_column(j, "length", pa.array(["four", "four"])), dataset / EPISODES)
    with pytest.raises(BadFile, match=r"file-000.parquet: length: expected an integer, found 'four'$"):
        Dataset(dataset)


def test_frames_of_another_size_than_declared_are_refused_before_decoding(dataset):
    info = json.loads((dataset / "meta" / "info.json").read_text())
    info["features"]["observation.images.cam"]["shape"] = [64, 64, 3]
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    assert str(err.value) == f"{dataset / VIDEO}: frame size: expected 64 x 64 (meta/info.json features), found 32 x 32"
    info["features"]["observation.images.cam"]["shape"] = [32, 32, 3]
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    (dataset / VIDEO).write_bytes(b"#EXTM3U\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:1.0,\nfile:///etc/passwd\n")
    with pytest.raises(BadFile) as err:  # a playlist is no mp4: the mp4 demuxer is forced, nothing is followed
        _read_all(dataset)
    _one_line(err, f"{dataset / VIDEO}: video: expected an mp4 video file, found ")


def test_a_video_with_more_frames_than_its_episodes_span_is_refused(dataset, tmp_path):
    """The episodes index says the file's frames end at 0.8 s; one that goes on is decoded only that far: a
    decoder that yields frames without time (all at 0) stops at the bound instead of filling memory."""
    long = tmp_path / "long"
    w = DatasetWriter(long, env_id="Toy-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(60, 1))
    w.close()
    shutil.copy(long / VIDEO, dataset / VIDEO)  # 60 frames where two 4-frame episodes are indexed
    got = Dataset(dataset)
    assert got.episode(1).length == 4  # decoding stopped a second past 0.8 s, the frames it needs are there
    assert len(got._videos[next(iter(got._videos))][0]) <= 20
    with pytest.raises(TooLarge, match=r"file-000.mp4: frames: expected at most 5 \(what its episodes span\)"):
        decode_video(dataset / VIDEO, 3, size=(32, 32), max_frames=5)


def test_an_image_feature_naming_a_file_outside_is_refused(dataset, tmp_path):
    """lerobot's image features keep PNG bytes or a path in the data file; a path out of the dataset (to a PNG that
    would decode) is refused, as is an image of another size than declared."""
    import io

    from PIL import Image

    outside = tmp_path / "outside.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(outside)
    table = pq.read_table(dataset / DATA)
    n = table.num_rows
    info = json.loads((dataset / "meta" / "info.json").read_text())
    info["features"]["observation.images.front"] = {
        "dtype": "image",
        "shape": [32, 32, 3],
        "names": ["height", "width", "channels"],
    }
    info["rlfleet"]["observations"]["front"] = "observation.images.front"
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

    def write(items):
        pq.write_table(table.append_column("observation.images.front", pa.array(items, image_type)), dataset / DATA)

    write([{"bytes": None, "path": "../outside.png"}] * n)
    with pytest.raises(OutsideRoot) as err:
        _read_all(dataset)
    _one_line(err, f"{dataset / DATA}: column 'observation.images.front' row 0 path: expected a path inside")
    (dataset / "img.png").symlink_to(outside)
    write([{"bytes": None, "path": "img.png"}] * n)
    with pytest.raises(OutsideRoot, match="through a symbolic link"):
        _read_all(dataset)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((48, 40, 3), np.uint8)).save(buf, format="PNG")
    write([{"bytes": buf.getvalue(), "path": None}] * n)
    with pytest.raises(BadFile) as err:
        _read_all(dataset)
    assert str(err.value) == (
        f"{dataset / DATA}: column 'observation.images.front' row 0: expected a 32 x 32 image "
        f"(meta/info.json features), found 40 x 48"
    )
    (dataset / "img.png").unlink()
    shutil.copy(outside, dataset / "img.png")  # the same PNG inside the dataset reads
    write([{"bytes": None, "path": "img.png"}] * n)
    assert _read_all(dataset)[0].observations["front"].shape == (4, 32, 32, 3)


def test_sft_prints_one_line_naming_the_file(dataset, capsys):
    from services.learner.sft import main

    info = json.loads((dataset / "meta" / "info.json").read_text())
    info["features"]["observation.state"]["shape"] = [13]
    (dataset / "meta" / "info.json").write_text(json.dumps(info))
    code = main(
        [
            "--config",
            "pandapickcube_vision_sft_openvla_oft_tiny",
            "actor.model.vla.vision_layers=1",
            "actor.model.vla.llm_layers=1",
            "actor.model.num_action_chunks=2",
            "sft.max_steps=1",
            "cluster.learner_num_threads=1",
            f"sft.dataset_path={dataset}",
            "sft.dataset_keys={wrist: observation.images.cam, state: observation.state, action: action}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == (
        f"sft: {dataset / DATA}: column 'observation.state': expected 13 numbers per row "
        f"(meta/info.json features), found 3"
    ), err


def test_collect_demos_never_writes_through_a_link_or_over_someone_elses_folders(tmp_path):
    """DatasetWriter (what collect-demos writes with) replaces meta/, data/ and videos/ of an earlier dataset: a
    link there would send its writes (and its removal) elsewhere; data/ without meta/ is not a dataset's."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(precious, out / "data")
    with pytest.raises(OutsideRoot) as err:
        DatasetWriter(out, env_id="Toy-v0", simulator="gym", fps=10, source="test", overwrite=True)
    _one_line(
        err,
        f"{out / 'data'}: dataset folder: expected a real folder data/ of the dataset (or none), found a "
        f"link to {precious}",
    )
    assert (precious / "keep.txt").read_text() == "mine"
    (out / "data").unlink()
    (out / "videos").mkdir()
    (out / "videos" / "holiday.mp4").write_text("not ours")
    with pytest.raises(BadFile, match=r"dataset folder: expected an empty folder or an earlier dataset"):
        DatasetWriter(out, env_id="Toy-v0", simulator="gym", fps=10, source="test", overwrite=True)
    assert (out / "videos" / "holiday.mp4").exists()
    w = DatasetWriter(tmp_path / "fresh", env_id="Toy-v0", simulator="gym", fps=10, source="test")
    w.add(_episode(3, 1))
    w.close()
    again = DatasetWriter(
        tmp_path / "fresh", env_id="Toy-v0", simulator="gym", fps=10, source="test", overwrite=True
    )  # an earlier dataset is replaced, as before
    again.add(_episode(2, 2))
    again.close()
    assert len(Dataset(tmp_path / "fresh")) == 1


def test_a_dataset_in_a_real_hub_cache_reads_through_its_blob_links(dataset, tmp_path, monkeypatch):
    """sft.dataset_path as a hub id: the snapshot's files are links into blobs/ (allowed), one linked elsewhere is
    refused."""
    from rlfleet.config import load_config
    from services.learner.sft import open_dataset
    from tests.hostile.test_hub_ids import COMMIT, hub_cache

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    repo_dir, snapshot = hub_cache(tmp_path / "hf", dataset, repo="someone/toy-demos")
    os.replace(repo_dir.parent / "models--someone--toy-demos", repo_dir.parent / "datasets--someone--toy-demos")
    snapshot = repo_dir.parent / "datasets--someone--toy-demos" / "snapshots" / COMMIT
    assert os.path.islink(snapshot / VIDEO)
    cfg = load_config(None, ["sft.dataset_path=someone/toy-demos@main"])
    d = open_dataset(cfg)
    assert d.root == snapshot and d.episode(1).observations["cam"].shape == (4, 32, 32, 3)
    os.unlink(snapshot / VIDEO)
    os.symlink(dataset / VIDEO, snapshot / VIDEO)  # the same video, outside the cache
    with pytest.raises(OutsideRoot, match="through a symbolic link"):
        open_dataset(cfg).episode(0)
    with pytest.raises(BadFile, match=r"^sft.dataset_path: someone/toy-demos: revision: expected a git ref"):
        open_dataset(load_config(None, ["sft.dataset_path=someone/toy-demos@../../.."]))
