"""Generate the gRPC/protobuf Python modules from ``protos/`` (never edit the output by hand).

python -m rlfleet.wire.protogen           # regenerate rlfleet/v1/*_pb2*.py
python -m rlfleet.wire.protogen --check   # exit 1 if the committed modules are stale
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = "rlfleet/v1"


def proto_files() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run grpcio-tools' protoc into ``out_dir``; return the generated files (relative paths)."""
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out_dir) for p in (out_dir / PACKAGE_DIR).glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Generated files that differ from (or are missing in) the committed tree."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        generated = generate(tmp_path)
        stale = [
            str(rel)
            for rel in generated
            if not (REPO_ROOT / rel).exists() or not filecmp.cmp(tmp_path / rel, REPO_ROOT / rel, shallow=False)
        ]
        committed = {p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PACKAGE_DIR).glob("*_pb2*.py*")}
        stale += [f"{rel} (no .proto produces it)" for rel in sorted(committed - set(generated))]
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the committed modules are current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated files (run `python -m rlfleet.wire.protogen`):\n  " + "\n  ".join(stale))
            return 1
        print("generated protobuf modules are current")
        return 0
    generated = generate(REPO_ROOT)
    print("generated:\n  " + "\n  ".join(map(str, generated)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
