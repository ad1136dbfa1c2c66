"""benchmarks/wire_budget.py in its tiny mode (--quick): every path goes through real gRPC servers in processes of
their own and prints its row, the compression study runs on frames the vision env renders, and --markdown writes the
tables between the markers of a page without touching the rest of it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _rows(text: str, first: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith(f"| {first}")
    ]


def test_quick_mode_prints_every_row(tmp_path):
    from benchmarks.wire_budget import shm_available

    transports = ["grpc"] if shm_available() else ["grpc", "shm"]
    page = tmp_path / "wire-budget.md"
    page.write_text(
        "# prose above\n\n<!-- wire-budget:begin -->\nSTALE-TABLE\n<!-- wire-budget:end -->\n\nprose below\n"
    )
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.wire_budget",
            "--quick",
            "--markdown",
            str(page),
            "--transport",
            "both" if "shm" in transports else "grpc",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table, _, summary = out.stdout.split("command: `", 1)[1].partition("gRPC against shared memory")
    if "shm" in transports:  # one line per path, case and env count measured both ways
        assert len(_rows(summary, "Act")) == 2 and len(_rows(summary, "UpdateWeights")) == 2, summary
    act, push, weights = _rows(table, "Act"), _rows(table, "PushRollout"), _rows(table, "UpdateWeights")
    cases = ["OpenVLA-OFT, PandaPickCubeVision", "pi0, LIBERO"]
    assert [r[1] for r in act] == [c for c in cases for _ in transports], act  # each case over each transport
    assert [r[0] for r in act] == [{"grpc": "Act", "shm": "Act (shm)"}[t] for t in transports] * 2, act
    assert [r[1] for r in push] == [r[1] for r in act], push
    assert [r[1] for r in weights] == (
        ["OpenVLA-OFT, LoRA r32 adapters, fp32"] * len(transports) + ["pi0, full set, fp32"] * len(transports)
    ), weights
    assert "LoRA r32 adapters (partial)" in weights[0][-1] and "full set" in weights[-1][-1], weights
    for row in act + push + weights:
        assert len(row) == 17, row
        for cell in row[3:12] + [row[13], row[15]]:  # bytes, stages, wall, CPU, GPU, saturation: numbers
            assert re.fullmatch(r"[-\d,.]+( / [-\d,.]+)?", cell), (cell, row)
        assert float(row[3].replace(",", "")) > 0 and float(row[10].replace(",", "")) > 0, row
    codecs = [r[0] for r in _rows(summary or table, "")][-6:]
    assert codecs == ["lz4", "XOR delta + lz4", "zstd-1", "XOR delta + zstd-1", "zstd-3", "XOR delta + zstd-3"], codecs
    text = page.read_text()
    assert text.startswith("# prose above") and text.endswith("prose below\n") and "STALE-TABLE" not in text
    assert "| Act | OpenVLA-OFT, PandaPickCubeVision | 4 |" in text and "XOR delta + zstd-1" in text


def test_shm_transport_says_whether_it_is_there():
    from benchmarks.wire_budget import shm_available

    note = shm_available()
    assert note is None or note.startswith(("not available", "not measured")), note
