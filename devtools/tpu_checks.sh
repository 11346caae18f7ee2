#!/usr/bin/env bash
# The TPU host's checks in as few device calls as possible, each well inside a call's
# 10 minutes. Prepare here: `make setup && ../shared/tools/tpu-kit.sh pytest pytest-timeout
# hypothesis cryptography safetensors pyyaml`; then, with the device tool, carry
# [".tpu-kit"] and run
#
#   source .tpu-kit/activate && devtools/tpu_checks.sh suite       # ~5 min
#   source .tpu-kit/activate && devtools/tpu_checks.sh bench       # ~6 min
#   source .tpu-kit/activate && devtools/tpu_checks.sh demo        # ~2 min
#
# Each step's log and JSON land in $OUT (the device tool's folder; /tmp/tpu-checks
# elsewhere), one file per step; a failing step is recorded and the next one runs. JAX
# takes its default platform (the chip); one process holds it, so steps run one by one.
# `TPU_CHECKS_CPU=1` runs the same steps on 8 CPU devices, to try the script off the host.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tpu-checks}; mkdir -p "$out"
py=${PYTHON:-python3}
if [ "${TPU_CHECKS_CPU:-}" = 1 ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8"
  small=1
else
  unset JAX_PLATFORMS
  small=
fi
summary="$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: runs it under a deadline, logs to $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$summary"
}

facts() {
  "$py" - > "$out/host.json" 2>&1 <<'PY'
import json, os, platform, jax
print(json.dumps({"devices": [str(d) for d in jax.devices()], "platform": jax.devices()[0].platform,
                  "jax": jax.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
                  "libc": platform.libc_ver()}))
PY
}

case "${1:-}" in
  suite)
    facts
    # the unit suite at JAX's default platform: CPU-meant tests pin a CPU device, inet tests skip
    step unit 330 "$py" -m pytest -q -p no:cacheprovider --timeout 120 tests/unit
    # the chip's own tests (skipped off a TPU), the unix-socket process tests beside them
    step tpu-marked 200 "$py" -m pytest -q -p no:cacheprovider --timeout 150 -m "tpu or unix_only" tests
    ;;
  bench)
    facts
    if [ -n "$small" ]; then s=small; b=small; else s=4b; b=0.6b; fi
    dev=(); [ -n "$small" ] && dev=(--devices 8 --mesh 2x4)
    step stage 200 "$py" bench/stage.py --devices 1 --model-size "$s" --repeats 2 --json
    step apply-swap 90 "$py" bench/apply.py "${dev[@]}" --preset "$b" --mode swap --json
    step apply-inplace 90 "$py" bench/apply.py "${dev[@]}" --preset "$b" --mode inplace --json
    step overlap 150 "$py" bench/train_overlap.py --preset "$b" --out "$out/overlap.json"
    ;;
  demo)
    facts
    step demo 240 "$py" -m devtools.demo --unix-sockets --steps 3
    ;;
  *)
    echo "usage: $0 suite|bench|demo   (results in \$OUT, or /tmp/tpu-checks)" >&2
    exit 2
    ;;
esac
