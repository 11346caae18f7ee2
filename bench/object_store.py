"""Object-store reads (`make bench-object-store`): one big part read back from s3:// (moto's
server) and gs:// (fake-gcs-server), started on 127.0.0.1 behind the tests' proxy, which
holds every ranged GET `--latency-ms` (a store's round trip; loopback has none).

Per protocol (rows `fs-s3`, `fs-gcs`), in one run: the fs transport's reads of the part in
fetch calls of `--window` chunks, whose chunks are read concurrently, against the bound
measured just before: the same chunks read one after another (a single stream, one GET at a
time). `speedup` is the single stream's seconds over the transport's (median of `--repeat`
each); every chunk read is compared with the bytes written. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.object_stores import Emulator, missing_packages  # noqa: E402
from weightsync.manifest import Endpoint  # noqa: E402
from weightsync.transports.base import FetchRequest  # noqa: E402
from weightsync.transports.fs import PART_FILE, FsStore, FsTransport  # noqa: E402
from weightsync.transports.fs_options import parse_fs_options  # noqa: E402

ROWS = {"s3": "fs-s3", "gs": "fs-gcs"}


def _timed(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_row(protocol: str, args: argparse.Namespace, workdir: Path) -> dict:
    emulator = Emulator(protocol, workdir)
    try:
        bucket = emulator.new_store()
        options = parse_fs_options([f"{k}={v}" for k, v in bucket.options.items()])
        store = FsStore(bucket.root, options)
        chunk = args.chunk_mib << 20
        data = bytes(range(256)) * ((args.part_mib << 20) // 256)
        relative, _ = store.write_part("bench", 1, 0, data, content="0123456789abcdef")
        spans = [(o, min(chunk, len(data) - o)) for o in range(0, len(data), chunk)]
        part = store.resolve(relative) + "/" + PART_FILE
        bucket.proxy.delay_s = args.latency_ms / 1000

        def single_stream() -> None:
            for offset, length in spans:
                assert store.fs.cat_file(part, start=offset, end=offset + length) == data[offset : offset + length]

        transport = FsTransport(bucket.root, options)
        transport.open(Endpoint(fs_uri=relative))

        def transport_reads() -> None:
            for first in range(0, len(spans), args.window):
                window = spans[first : first + args.window]
                indices = list(range(first, first + len(window)))
                request = FetchRequest("bench", 1, 0, indices, timeout_s=60.0, spans=window)
                for payload in transport.fetch(request):
                    offset = payload.offset
                    assert bytes(payload.data) == data[offset : offset + len(payload.data)]

        single_s = _timed(single_stream, args.repeat)
        transport_s = _timed(transport_reads, args.repeat)
        transport.close()
        mib = len(data) / (1 << 20)
        return {
            "row": ROWS[protocol],
            "part_mib": args.part_mib,
            "chunk_mib": args.chunk_mib,
            "latency_ms": args.latency_ms,
            "single_stream_seconds": round(single_s, 4),
            "transport_seconds": round(transport_s, 4),
            "single_stream_mib_s": round(mib / single_s, 1),
            "transport_mib_s": round(mib / transport_s, 1),
            "speedup": round(single_s / transport_s, 2),
            "max_gets_in_flight": bucket.proxy.max_in_flight,
        }
    finally:
        emulator.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocols", default="s3,gs", help="comma-separated: s3, gs")
    p.add_argument("--part-mib", type=int, default=32)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--window", type=int, default=16, help="chunks per fetch call (the puller's --window-chunks)")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="wsbench-obj-") as tmp:
        for protocol in args.protocols.split(","):
            if why := missing_packages(protocol):
                skipped[ROWS[protocol]] = why
                continue
            rows.append(run_row(protocol, args, Path(tmp)))
    print(json.dumps({"rows": rows, "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
