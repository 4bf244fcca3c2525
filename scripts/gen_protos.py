"""Regenerate the committed gRPC stubs from proto/ into kvpool/v1/ (run after editing the .proto).

Usage: .venv/bin/python scripts/gen_protos.py [--check]
`--check` exits 1 when the committed stubs differ from a fresh generation (the test suite runs it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
STUB_FILES = ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "kvpool" / "v1" / "kvpool.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs only")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "kvpool" / "v1"
        target = ROOT / "kvpool" / "v1"
        changed = [
            n
            for n in STUB_FILES
            if not (target / n).is_file() or (target / n).read_bytes() != (fresh / n).read_bytes()
        ]
        if opts.check:
            if changed:
                print(f"stale generated stubs: {changed}; run scripts/gen_protos.py", file=sys.stderr)
                return 1
            return 0
        target.mkdir(parents=True, exist_ok=True)
        for name in STUB_FILES:
            (target / name).write_bytes((fresh / name).read_bytes())
        (target / "__init__.py").write_text('"""Generated gRPC stubs of proto/kvpool/v1/kvpool.proto."""\n')
        print(f"wrote {len(STUB_FILES)} stubs to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
