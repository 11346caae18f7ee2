#!/bin/sh
# Builds the weightsync wheel with its native shim into OUT_DIR and checks what is inside.
# Usage: deploy/build-wheel.sh OUT_DIR [base|trainer|vllm]   (run from the source root)
# The Containerfile and tests/deploy/test_image_wheel.py both build with this script.
set -eu
out=${1:?usage: build-wheel.sh OUT_DIR [base|trainer|vllm]}
variant=${2:-base}
python=${PYTHON:-python}
case "$variant" in
  trainer) export WEIGHTSYNC_REQUIRE_FFI=1; check="--ffi" ;;  # the trainer image stages through FFI
  base|vllm) check="" ;;
  *) echo "unknown variant $variant (base, trainer, vllm)" >&2; exit 2 ;;
esac
"$python" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$out" .
"$python" deploy/check_wheel.py $check "$out"/weightsync-*.whl
