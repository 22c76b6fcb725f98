"""Regenerates the gRPC stubs from proto/ with grpcio-tools' bundled protoc (no protoc on PATH).

The proto path mirrors the Python import path (queue_client/wire/...), so the generated modules
import each other as `queue_client.wire.*`. `--check` exits 1 when the committed stubs are stale.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "client"
PROTOS = ["queue_client/wire/batchqueue.proto"]
GENERATED = ["batchqueue_pb2.py", "batchqueue_pb2.pyi", "batchqueue_pb2_grpc.py"]


def generate(out_root: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only regeneration needs it

    include = Path(protoc.__file__).parent / "_proto"
    for proto in PROTOS:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(PROTO_ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="fail if the committed stubs are stale"
    )
    opts = parser.parse_args()
    if not opts.check:
        generate(OUT_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in GENERATED
            if not filecmp.cmp(
                Path(tmp) / "queue_client/wire" / name,
                OUT_ROOT / "queue_client/wire" / name,
                shallow=False,
            )
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run `make proto`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
