"""Fails unless a weightsync wheel carries the native shim (and, with --ffi, the JAX FFI
staging handler): an image that promises the tcp data plane must not fall back to gRPC."""

from __future__ import annotations

import argparse
import sys
import zipfile

SHIM = "weightsync/_native/libweightsync_native"
FFI_SYMBOL = b"WsStageFfi"


def problems(wheel: str, *, ffi: bool) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        libs = [n for n in z.namelist() if n.startswith(SHIM) and n.endswith(".so")]
        if not libs:
            return [f"{wheel}: no {SHIM}*.so inside (was setup.py or native/ left out of the build?)"]
        if ffi and not any(FFI_SYMBOL in z.read(n) for n in libs):
            return [f"{wheel}: {libs[0]} was built without the JAX FFI handler ({FFI_SYMBOL.decode()})"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("wheel")
    parser.add_argument("--ffi", action="store_true", help="also require the JAX FFI handler")
    args = parser.parse_args(argv)
    found = problems(args.wheel, ffi=args.ffi)
    for p in found:
        print(p, file=sys.stderr)
    if not found:
        print(f"{args.wheel}: native shim present{' with the FFI handler' if args.ffi else ''}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
