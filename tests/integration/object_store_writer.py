"""A trainer's store writer in its own process: writes one part of `--bytes` bytes under
`--root`, for tests that kill it with SIGKILL while its upload is in flight."""

from __future__ import annotations

import argparse

from weightsync.transports.fs import FsStore
from weightsync.transports.fs_options import parse_fs_options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--fs-option", action="append", default=[])
    parser.add_argument("--session", default="job")
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args()
    store = FsStore(args.root, parse_fs_options(args.fs_option))
    data = bytes(range(256)) * (args.bytes // 256)
    print(store.write_part(args.session, args.version, 0, data, content="0123456789abcdef"), flush=True)


if __name__ == "__main__":
    main()
