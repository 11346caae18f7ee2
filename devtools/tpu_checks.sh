#!/usr/bin/env bash
# The TPU host's checks in as few device calls as possible, each inside a call's 10
# minutes. Prepare the offline kit on a machine with a package index: `make tpu-kit`
# (docs/install-tpu.md); carry .tpu-kit/ to the host with the project and run there
#
#   source .tpu-kit/activate && devtools/tpu_checks.sh suite       # the tests, ~9 min at most; ends
#                                                                  # `suite: N failed, M passed, K skipped`
#   source .tpu-kit/activate && devtools/tpu_checks.sh bench       # trainer staging and overlap, ~9 min at most
#   source .tpu-kit/activate && devtools/tpu_checks.sh apply       # the JAX apply and a rollout service, ~9 min
#   source .tpu-kit/activate && devtools/tpu_checks.sh demo        # ~2 min
#   source .tpu-kit/activate && devtools/tpu_checks.sh diagnose    # the D2H's runtime settings, the overlap's controls, ~9 min
#   source .tpu-kit/activate && devtools/tpu_checks.sh vllm        # weightsync inside vLLM's TPU engine, ~5 min; ends
#                                                                  # `vllm: N of 3 committed, corrupted refused: yes|no, ...`
#
# Each step's log lands in $OUT (the device tool's folder; /tmp/tpu-checks elsewhere), one
# file per step, with a line in summary.txt; host.json holds the host's facts (their
# stderr, JAX's warnings, in host.err). A step runs under its budget: past it, it gets
# SIGTERM and, 10 s later, SIGKILL, and its line says it was cut short; what it printed
# until then stays in its log (Python runs unbuffered). The steps of one call also share
# TPU_CHECKS_DEADLINE_S (570 s, under the device call's 600): a step gets what is left
# of it when that is less than its budget, and none is started once less than 20 s are
# left. A failing step is recorded and the next one runs. `TPU_CHECKS_ONLY="a b"` runs only
# the steps of those names (a second call for what the first had no time left for). JAX
# takes its default platform (the chip); one process holds it, so steps run one by one.
# `TPU_CHECKS_CPU=1` runs the same steps on 8 CPU devices, to try the script off the host.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/tpu-checks}; mkdir -p "$out"
py=${PYTHON:-python3}
deadline=$((SECONDS + ${TPU_CHECKS_DEADLINE_S:-570}))
export PYTHONUNBUFFERED=1
if [ "${TPU_CHECKS_CPU:-}" = 1 ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8"
  small=1
else
  unset JAX_PLATFORMS
  small=
  # the overlap bench compiles its training step for 86-106 s on the chip: the steps of one
  # call share JAX's compilation cache, so only the first pays it
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/tpu-checks-jax-cache}
fi
summary="$out/summary.txt"
GRACE_S=10   # SIGTERM to SIGKILL
MIN_STEP_S=20

asked() {  # asked NAME: whether TPU_CHECKS_ONLY (when set) names the step
  [ -z "${TPU_CHECKS_ONLY:-}" ] || [[ " $TPU_CHECKS_ONLY " == *" $1 "* ]]
}

step() {  # step NAME BUDGET_S COMMAND...: runs it within its budget, logs to $out/NAME.log
  local name=$1 budget=$2; shift 2
  asked "$name" || return 0
  local left=$((deadline - SECONDS)) limit t0=$SECONDS rc note=""
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    printf '%-22s skipped: %ss left of the call\n' "$name" "$left" | tee -a "$summary"
    return
  fi
  limit=$((budget < left ? budget : left))
  timeout --kill-after="$GRACE_S" "$((limit - GRACE_S))" "$@" > "$out/$name.log" 2>&1
  rc=$?
  case $rc in
    124 | 137) note="  cut short at its ${limit}s budget (log: what it printed until then)" ;;
  esac
  printf '%-22s rc=%-3s %4ss%s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" | tee -a "$summary"
  if [ "$rc" != 0 ]; then
    tail -n 5 "$out/$name.log" | sed 's/^/    /' | tee -a "$summary"
  fi
}

facts() {  # the host's facts as JSON in host.json; what the interpreter says besides, host.err
  timeout 60 "$py" - > "$out/host.json" 2> "$out/host.err" <<'PY'
import json, os, platform, jax
print(json.dumps({"devices": [str(d) for d in jax.devices()], "platform": jax.devices()[0].platform,
                  "jax": jax.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
                  "libc": platform.libc_ver()}))
PY
  local rc=$?
  [ "$rc" = 0 ] || printf '%-22s rc=%-3s (host.err says why)\n' facts "$rc" | tee -a "$summary"
  printf 'allocator to preload: %s\n' "$(preloadable_allocator)" >> "$out/host.err"
}

preloadable_allocator() {  # the first tcmalloc or jemalloc the host has (Debian's and RHEL's paths), or nothing
  local lib
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/lib64/libtcmalloc.so.4 /usr/lib64/libjemalloc.so.2; do
    [ -e "$lib" ] && { echo "$lib"; return; }
  done
}

suite_verdict() {  # suite_verdict STEP...: one line for those of the steps asked, `suite: N failed,
  # M passed, K skipped` from their pytest summaries (a step without one, cut short or
  # skipped for time, named), into the summary
  local name logs=()
  for name in "$@"; do asked "$name" && logs+=("$out/$name.log"); done
  [ "${#logs[@]}" = 0 ] || "$py" devtools/suite_verdict.py --name suite "${logs[@]}" | tee -a "$summary"
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced (tests/integration/test_tpu_checks.py): the functions only

case "${1:-}" in
  suite)
    facts
    rm -f "$out/unit.log" "$out/tpu-marked.log"  # a step skipped for time leaves no log of an earlier call
    # the unit suite at JAX's default platform: CPU-meant tests pin a CPU device, inet tests skip
    step unit 400 "$py" -m pytest -q -p no:cacheprovider --timeout 120 tests/unit
    # the chip's own tests (skipped off a TPU), the unix-socket process tests beside them
    step tpu-marked 165 "$py" -m pytest -q -p no:cacheprovider --timeout 150 -m "tpu or unix_only" tests
    suite_verdict unit tpu-marked
    ;;
  bench)
    facts
    if [ -n "$small" ]; then s=small; b=small; else s=4b; b=0.6b; fi
    step stage 250 "$py" bench/stage.py --devices 1 --model-size "$s" --repeats 2 --deadline-s 235 --json
    # the run's settings (every step offers its version), then steps that offer one only
    # while no publish runs or waits, then the run's settings with the trainer's objects
    # frozen out of Python's collector (gc.freeze(), as vLLM does once it has started)
    step overlap 260 "$py" bench/train_overlap.py --preset "$b" --out "$out/overlap.json" \
      --variant offer=idle --variant gc=freeze
    ;;
  diagnose)
    facts
    if [ -n "$small" ]; then b=small; else b=0.6b; fi
    # the TPU runtime's premapped host buffer: whole buffers and 64 MiB blocks with its own
    # transfer threshold, then with the threshold at the buffer's default size (4 GiB)
    premapped=(--devices 1 --model-size "$b" --repeats 1 --rows-mib 16,64 --blocks-mib 64 --windows-mib 256
      --deadline-s 75 --json)
    step stage-premap-default 90 "$py" bench/stage.py "${premapped[@]}"
    step stage-premap-raised 90 env TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES=4294967296 \
      "$py" bench/stage.py "${premapped[@]}"
    # the overlap with the threshold raised, blocks cut and whole buffers (this process
    # compiles the step; the steps after it load it from JAX's compilation cache)
    step overlap-premap 200 env TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES=4294967296 \
      "$py" bench/train_overlap.py --preset "$b" --variant block=0
    # the control: each publish's block copies on the thread that publishes (the warm-up's
    # blocking publish on the main thread, the rest on the worker), not on one D2H thread
    step overlap-caller 110 "$py" bench/train_overlap.py --preset "$b" --base d2h=caller --variant d2h=caller
    # what a protobuf malloc_trim costs a publish's requests on a heap of ~100,000 free
    # chunks (what XLA's compile leaves is ~300,000), built a message per descriptor and in place
    step descriptor-trim 90 "$py" bench/descriptor_trim.py --free-chunks 100000
    # for a second call (TPU_CHECKS_ONLY): the run's settings twice, a thread arena's heaps
    # unmapped as glibc does; no process reading the trainer's /proc/PID/status; glibc's
    # arenas unlimited; another allocator where the host has one
    step overlap 200 "$py" bench/train_overlap.py --preset "$b" --variant offer=every
    step overlap-cached 110 "$py" bench/train_overlap.py --preset "$b" --variant offer=every
    step overlap-unmapped 170 "$py" bench/train_overlap.py --preset "$b" --heaps unmapped --variant offer=every
    step overlap-unsampled 130 "$py" bench/train_overlap.py --preset "$b" --rss-interval-ms 0 --variant offer=every
    # glibc's arenas past its limit (8 a core: the v5e host's process has all 104 before its
    # first publish, so the D2H thread gets one other threads use or used): whether an arena of
    # its own keeps the blocks' heap within the window
    step overlap-arenas 170 env GLIBC_TUNABLES=glibc.malloc.arena_max=1024 \
      "$py" bench/train_overlap.py --preset "$b" --variant offer=every
    # where glibc placed each block's host buffer and when it was freed (bench/train_overlap.py
    # --trace-blocks), the heaps the blocks landed in only counted (the control), then steering
    # the window as the device path does
    step overlap-blocks-count 200 "$py" bench/train_overlap.py --preset "$b" --block-heaps count \
      --trace-blocks "$out/blocks-count.json" --variant offer=every
    step overlap-blocks-steer 130 "$py" bench/train_overlap.py --preset "$b" --trace-blocks "$out/blocks-steer.json" \
      --variant offer=every
    lib=$(preloadable_allocator)
    if [ -n "$lib" ]; then
      step overlap-preload 130 env LD_PRELOAD="$lib" "$py" bench/train_overlap.py --preset "$b" --variant offer=every
    elif asked overlap-preload; then
      printf '%-22s skipped: no tcmalloc or jemalloc on this host\n' overlap-preload | tee -a "$summary"
    fi
    ;;
  apply)
    facts
    if [ -n "$small" ]; then b=small; else b=0.6b; fi
    dev=(); cpu=(); [ -n "$small" ] && dev=(--devices 8 --mesh 2x4) && cpu=(--cpu-devices 8)
    step apply-swap 90 "$py" bench/apply.py "${dev[@]}" --preset "$b" --mode swap --repeats 3 --json
    step apply-inplace 90 "$py" bench/apply.py "${dev[@]}" --preset "$b" --mode inplace --repeats 3 --json
    # a rollout service holding the chip, its trainer in another process (JAX on the CPU there)
    step tpu-service 270 "$py" devtools/tpu_service_check.py --preset "$b" "${cpu[@]}" --deadline-s 250 --out "$out/tpu-service"
    step tpu-runtime-memory 100 "$py" devtools/tpu_service_check.py --probe-runtime --out "$out/tpu-service"
    ;;
  demo)
    facts
    step demo 240 "$py" -m devtools.demo --unix-sockets --steps 3
    ;;
  vllm)
    # vLLM's TPU engine with weightsync inside (devtools/tpu_vllm_check.py): the kit's vLLM
    # closure installed and put on PYTHONPATH here (.tpu-kit/activate-vllm, its log
    # vllm-kit.log), then the check; off the host (TPU_CHECKS_CPU=1) the engine is the
    # stand-in worker, in the environment as it is (TPU_CHECKS_VLLM_KIT=1: the kit's too).
    # No `facts`: only the engine opens the chip, once.
    if [ -n "$small" ] && [ "${TPU_CHECKS_VLLM_KIT:-}" != 1 ]; then
      :
    elif [ -f .tpu-kit/activate-vllm ] && asked vllm-kit; then
      t0=$SECONDS
      # shellcheck disable=SC1091
      source .tpu-kit/activate-vllm > "$out/vllm-kit.log" 2>&1
      rc=$?
      printf '%-22s rc=%-3s %4ss\n' vllm-kit "$rc" "$((SECONDS - t0))" | tee -a "$summary"
    elif asked vllm-kit; then
      printf '%-22s skipped: no .tpu-kit/activate-vllm (make tpu-kit): the environment as it is\n' vllm-kit \
        | tee -a "$summary"
    fi
    engine=vllm
    [ -n "$small" ] && engine=standin
    step vllm 560 "$py" devtools/tpu_vllm_check.py --engine "$engine" --out "$out" \
      --deadline-s "$((deadline - SECONDS - GRACE_S - 15))"
    asked vllm && [ -f "$out/vllm.log" ] && tail -n 1 "$out/vllm.log" | tee -a "$summary"
    ;;
  *)
    echo "usage: $0 suite|bench|apply|demo|diagnose|vllm   (results in \$OUT, or /tmp/tpu-checks)" >&2
    exit 2
    ;;
esac
