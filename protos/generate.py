"""Generates weightsync/_proto/ from protos/weightsync/v1/*.proto (`make protos`).

Usage: python protos/generate.py [OUT_DIR]   (default: weightsync/_proto)
grpc_tools writes imports as `from weightsync.v1 import x_pb2`; they are rewritten to
`from weightsync._proto import x_pb2` so the stubs live inside the core package.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from google.rpc import status_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
IMPORT_RE = re.compile(r"^from weightsync\.v1 import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc into a temp dir, rewrites imports, copies into out_dir."""
    protos = sorted(PROTO_ROOT.glob("weightsync/v1/*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    googleapis = Path(status_pb2.__file__).parents[2]  # google/rpc/status.proto (googleapis-common-protos)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"-I{googleapis}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "weightsync" / "v1").iterdir()):
            text = IMPORT_RE.sub("from weightsync._proto import ", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        init = out_dir / "__init__.py"
        init.write_text('"""Generated gRPC stubs; regenerate with `make protos`."""\n')
        written.append(init)
    return written


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "weightsync" / "_proto"
    if out.exists() and out == ROOT / "weightsync" / "_proto":
        shutil.rmtree(out)
    for path in generate(out):
        print(path.relative_to(out.parent) if out in path.parents else path)


if __name__ == "__main__":
    main()
