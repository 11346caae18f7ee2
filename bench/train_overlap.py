"""Publishing beside a real training step: what each way of publishing costs the trainer.

A Qwen3-shaped model (`--preset`, bf16 parameters, fp32 Adam moments, the step donating
its state) trains on random tokens: forward, cross-entropy, backward, Adam update, one
jitted call. Phases, each timed per loop iteration (the step and, where there is one, the
publish call, until the step's loss is ready; `--read-loss` reads it to the host):

  alone     `--steps` steps, no publish
  blocking  `--blocking-steps` steps, each followed by `publish(params, v)`
  async     `--steps` steps, each followed by `publish_async(params, v, snapshot=True)`: the
            D2H, staging and publish run on the publisher's worker while the next steps
            compute; latest wins
  alone2    `--steps` steps, no publish again (drift between phases shows here)
  variants  per `--variant`, another async phase with its own publisher, then as many
            steps without: D2H window and block, staging threads, worker niceness, the
            interpreter's switch interval, Python's garbage collector during the steps
            (`gc`: auto, freeze, off), glibc's malloc (`malloc`: auto, or held: freed heap
            kept, `hold_freed_memory`; it stays so for later phases; `trim`: held, never;
            `fastbins`: on, off), where a superseded snapshot is dropped (`release`:
            caller, thread), how PublishVersion's requests are built and sent
            (`requests`: first, lazy, loop), which steps offer their version (`offer`:
            every, idle, unqueued), which thread copies the blocks (`d2h`: one, the
            process's D2H thread; caller), and how far each publish goes (`work`:
            publish | stage | d2h | snapshot, the last three with no coordinator: staged
            into an arena, only brought to host, only the device snapshot held), to tell
            apart what costs the steps; a phase repeated is numbered (" #2")

`--base` sets the same keys for the run's own phases (`--base d2h=caller`: the control of
the D2H thread). Before the phases a warm-up publishes once blocking and once async; glibc's
account arena by arena after it and after each async phase (`host_heap.arena_stats`: which
threads' freed blocks the process keeps, and the largest arena's heaps and free chunks:
whether live allocations hold its freed blocks apart; the heaps the device path's blocks
landed in, `host_heap.block_heaps`) and the collector's pauses in the phases without
publishing are printed beside the phases' own. `--block-heaps count` leaves the window at
its limit however many heaps the blocks landed in (the control of the device path's
steering), and `--trace-blocks PATH` writes each block's host buffer as it landed (address,
bytes, the window's room then), when its copy was issued and when it was freed, with glibc's
`malloc_info` at the end.

and prints one JSON object (also written to `--out`) and a line per async phase on
stderr: the step times and how long each step's call took to return (its dispatch: where
the loop waits for the interpreter or the runtime, it shows here), `async_ratio` (the
async phase's total over as many no-publish steps at the mean of both no-publish phases),
`overlap_ratio` (the same over the steps that ran while a publish was in flight), the
process's CPU seconds and page faults per step, versions published and skipped and
published per step, the publish-to-ready latency of each published version (from its
`publish_async` call until it was READY: staged and taken by the coordinator; with no
coordinator: staged) in steps and seconds, D2H + staging GB/s, the device memory held for
pending versions, and each async phase's RSS peak against its bound: the RSS before its
publisher started + arena (two slots) + window + 256 MiB (+ the versions held, where the
device is host memory). The RSS is sampled from another process (`rss_sampler.py`, every
`--rss-interval-ms`; 0: not sampled, no bound judged): gVisor, which TPU hosts run under,
has no high-water mark that can be reset, so the process's own (`ru_maxrss`) keeps the
peak of compiling the model. Each slow iteration is printed with the publish steps it
overlapped (stage, send, and PublishVersion's call within it as rpc, each with the page
faults in it where 1,000 or more) and the garbage collections in it; `--heap-timeline`
adds glibc's account around each step.

The publisher needs a coordinator: by default one runs in a process of its own (as a
deployment runs it beside the trainer), on 127.0.0.1 or, where this host has no usable
inet sockets (a TPU VM), on a unix socket in a temporary directory, with the publisher's
chunk server on one beside it; `--coordinator-in-process` runs it in the trainer's process
(its Python then competes with the training loop for the interpreter), and
`--coordinator-address` names a running one. `--stage-only` runs the same worker, snapshot
and staging into an arena with no coordinator and no servers at all (no socket is
opened): the trainer's side.

Here the run and its flags; beside it, each readable alone: `overlap_step.py` (the
training step), `overlap_publishers.py` (how a phase publishes: `--variant`, the publishers,
the coordinator), `overlap_phases.py` (the blocking and async phases and what watches
them), `overlap_memory.py` (the RSS and heap accounting, `--trace-blocks`) and
`overlap_report.py` (the figures of a phase and the lines on stderr).

    python bench/train_overlap.py                                   # CPU: small preset, 8 steps
    JAX_PLATFORMS= python bench/train_overlap.py --preset 0.6b --steps 40 --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from common import HEAP_PADS, emit_json, hold_heaps, peak_rss_bytes, rss_bytes, tpu_transfer_env  # noqa: E402
from overlap_memory import BlockTrace, heap_account, heap_stats, rss_bounds  # noqa: E402
from overlap_phases import GcPauses, StallTraces, async_phase, blocking_phase  # noqa: E402
from overlap_publishers import (  # noqa: E402
    Variant,
    coordinator_here,
    coordinator_process,
    loopback_addresses,
    parse_variant,
    phase_labels,
    publisher,
)
from overlap_report import heap_line, report, summary, time_stats  # noqa: E402
from overlap_step import Trainer  # noqa: E402
from rss_sampler import RssSampler  # noqa: E402
from stall_dumper import StallDumper  # noqa: E402

from trainer_agent.device.device_blocks import block_size  # noqa: E402
from trainer_agent.device.host_heap import block_heaps  # noqa: E402
from trainer_agent.publish.async_publish import held_params  # noqa: E402
from trainer_agent.publish.publisher import ASYNC_WORKER_NICE  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from trainer_agent.stage import params as params_module  # noqa: E402
from weightsync.model_shapes import PRESETS  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = jax.devices()[0]
    trainer = Trainer(args)
    param_bytes = sum(int(p.nbytes) for p in trainer.params.values())
    t = time.perf_counter()
    trainer.wait(trainer.step())
    compile_s = time.perf_counter() - t
    # the heap the compile leaves (JAX's compilation cache, where it hits, leaves far less):
    # every protobuf malloc_trim walks its free chunks (bench/descriptor_trim.py)
    transfer_env = tpu_transfer_env()
    print(
        f"step compiled in {compile_s:.1f} s; glibc's free chunks after it: {heap_stats().get('free_chunks', 0):,}"
        + "".join(f"; {k}={v}" for k, v in transfer_env.items()),
        file=sys.stderr,
    )
    trainer.alone(2)
    base = Variant(args.window_bytes, args.block_bytes, args.staging_threads, args.nice)
    base = parse_variant(args.base, replace(base, work="stage" if args.stage_only else "publish"))
    variants = [parse_variant(text, base) for text in args.variant]
    labels = phase_labels([base, *variants])
    held = [v.malloc == "held" for v in (base, *variants)]
    if any(held) and not all(held[held.index(True) :]):
        raise SystemExit("--variant malloc=held: glibc's thresholds stay set, so later variants must hold too")
    out: dict[str, Any] = {
        "preset": args.preset,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "param_bytes": param_bytes,
        "tensors": len(trainer.params),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "donate": args.donate,
        "read_loss": args.read_loss,
        "mode": "stage-only" if args.stage_only else "coordinator",
        "coordinator_address": args.coordinator_address,
        "coordinator_in_process": args.coordinator_in_process,
        "variant": base.label(),
        "heaps": args.heaps,
        "blocks_forced": args.force_blocks,
        "tpu_transfer_env": transfer_env,
        "compile_s": round(compile_s, 3),
    }
    # the snapshot's program compiled before the baseline: compiling is once per trainer,
    # and the memory it leaves in the heap is not the publish's
    held_params(trainer.params, snapshot=True, block_bytes=block_size(base.block_bytes, PublisherSettings.chunk_bytes))
    # held versions count where the "device" is host memory (CPU)
    held_counted = device.platform == "cpu"
    with contextlib.ExitStack() as stack:
        stalls = None
        if args.trace_stalls_ms:
            path = args.trace_file or "stall-traces.txt"
            native = None
            if args.native_stacks:
                native = stack.enter_context(StallDumper(path + ".native", args.trace_stalls_ms))
            stalls = StallTraces(path, args.trace_stalls_ms, native)
            stack.callback(stalls.close)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overlap-")))
        host, listen = loopback_addresses(tmp)
        coordinator = args.coordinator_address
        if not coordinator and any(v.work == "publish" for v in (base, *variants)):
            if args.coordinator_in_process:
                coordinator = stack.enter_context(coordinator_here(tmp / "c.db", listen))
            else:
                coordinator = stack.enter_context(coordinator_process(tmp / "coordinator", listen))
            out["coordinator_address"] = coordinator
        rss_mark = peak_rss_bytes()  # the high-water mark of building and compiling the model
        rss_baseline = rss_bytes()
        rss = stack.enter_context(RssSampler(args.rss_interval_ms))
        rss.phase("warm-up")
        with publisher(base, coordinator, host) as pub:
            version = 1
            pub.publish(trainer.params, version)  # the arena made, any staging call compiled
            version += 1
            pub.publish_async(trainer.params, version, snapshot=True).result()
            out["heap_after_warm_up"] = heap_account()
            print(
                f"heap after the warm-up's publishes (blocking, async): {heap_line(out['heap_after_warm_up'])}",
                file=sys.stderr,
            )
            rss.phase("alone")
            dispatches: list[float] = []
            alone_gc = GcPauses()
            gc.callbacks.append(alone_gc)  # what the collector stops the loop for without publishing
            alone = trainer.alone(args.steps, dispatches)
            gc.callbacks.remove(alone_gc)
            rss.phase("blocking")
            blocking = blocking_phase(trainer, pub, args.blocking_steps, version)
            rss.phase("async")
            if stalls:
                stalls.label = base.label()
            first = async_phase(
                trainer,
                pub,
                args.steps,
                blocking["version"],
                stalls,
                offer=base.offer,
                heap_timeline=args.heap_timeline,
            )
            version = first["version"]
        rss.phase("alone2")
        gc.callbacks.append(alone_gc)
        alone2 = trainer.alone(args.steps, dispatches)
        gc.callbacks.remove(alone_gc)
        baseline = statistics.fmean(alone + alone2)
        out |= {
            "step_s": {"alone": time_stats(alone), "alone2": time_stats(alone2), "dispatch": time_stats(dispatches)},
            "gc_pauses_alone": alone_gc.summary(),  # the alone and alone2 phases' collections
            "blocking": {
                "iteration_s": time_stats(blocking["iterations"]),
                "publish_s": time_stats(blocking["publishes"]),
                "ratio": round(sum(blocking["iterations"]) / (len(blocking["iterations"]) * baseline), 3),
                "d2h_stage_gbps": round(param_bytes / statistics.fmean(blocking["stages"]) / 1e9, 3),
            },
            "async": summary(first, baseline, param_bytes),
        }
        print(f"GC in the {2 * args.steps} steps alone: {out['gc_pauses_alone']}", file=sys.stderr)
        report(base.label(), out["async"], baseline)
        sweep = {}
        held_max = {base.label(): first["held_max"]}
        baselines = {base.label(): rss_baseline}
        for variant, label in zip(variants, labels[1:], strict=True):
            baselines[label] = rss_bytes()  # what earlier phases left in the heap is not this one's
            with publisher(variant, coordinator, host) as pub:
                version += 1
                pub.publish(trainer.params, version)
                rss.phase(label)
                if stalls:
                    stalls.label = label
                phase = async_phase(
                    trainer, pub, args.steps, version, stalls, offer=variant.offer, heap_timeline=args.heap_timeline
                )
                version = phase["version"]
                held_max[label] = phase["held_max"]
            rss.phase("alone-after:" + label)
            after = trainer.alone(args.steps)
            sweep[label] = summary(phase, statistics.fmean(after), param_bytes) | {"alone_after_s": time_stats(after)}
            report(label, sweep[label], statistics.fmean(after))
        if sweep:
            out["variants"] = sweep
    stats = device.memory_stats() or {}
    out["device_memory"] = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    peak = peak_rss_bytes()  # VmHWM, or getrusage's ru_maxrss where there is none (gVisor)
    # each async phase's RSS peak against the RSS before its publisher started + what it may hold
    bounds = rss_bounds((base, *variants), labels, rss.peaks, baselines, held_max, param_bytes, held_counted)
    out |= {
        "rss_baseline_bytes": rss_baseline,
        "rss_phase_peak_bytes": rss.peaks,
        "rss_async_bounds": bounds,
        # the verdict is the async publish's (the first async phase, the run's settings);
        # a variant's baseline is the RSS its earlier phases left, which the TPU runtime and
        # the heap move by GBs between phases: reported, not judged
        "rss_within_bound": bounds[base.label()]["within"],
        # the process's own high-water mark, building and compiling the model included where
        # it cannot be reset: above the mark taken before publishing, publishing set it
        "rss_process_peak_bytes": peak,
        "rss_process_peak_after_publishing": peak > rss_mark,
    }
    if not rss.sampling:
        print(f"RSS: not sampled (--rss-interval-ms 0); process high-water mark {peak / 1e9:.2f} GB", file=sys.stderr)
        return out
    async_peak = bounds[base.label()]["peak_bytes"]
    print(
        f"RSS: async phase peak {'unknown' if async_peak is None else f'{async_peak / 1e9:.2f}'} GB, bound "
        f"{bounds[base.label()]['bound_bytes'] / 1e9:.2f} GB, within: {out['rss_within_bound']}; variants within: "
        f"{[b['within'] for label, b in bounds.items() if label != base.label()]}; "
        f"process high-water mark {peak / 1e9:.2f} GB",
        file=sys.stderr,
    )
    return out


def main() -> None:
    on_accel = jax.default_backend() != "cpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="0.6b" if on_accel else "small")
    p.add_argument("--steps", type=int, default=40 if on_accel else 8, help="steps per phase")
    p.add_argument("--blocking-steps", type=int, default=0, help="steps of the blocking phase; 0: --steps, at most 10")
    p.add_argument("--batch", type=int, default=4 if on_accel else 2)
    p.add_argument("--seq", type=int, default=512 if on_accel else 64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-bytes", type=int, default=PublisherSettings.d2h_window_bytes)
    p.add_argument("--block-bytes", type=int, default=PublisherSettings.d2h_block_bytes)
    p.add_argument("--staging-threads", type=int, default=0, help="threads of the staging pass; 0 = every core")
    p.add_argument("--nice", type=int, default=ASYNC_WORKER_NICE, help="niceness added to the publish worker")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another async phase, e.g. 'window=1G,block=8M,threads=4,nice=0' (keys window, block, threads, "
        "nice, work, switch, gc, malloc, trim, fastbins, release, requests, offer, d2h); repeatable",
    )
    p.add_argument(
        "--base",
        default="",
        help="the run's own settings (the warm-up, blocking and first async phases), in --variant's form, "
        "e.g. 'd2h=caller'",
    )
    p.add_argument("--no-donate", dest="donate", action="store_false", help="the step does not donate its state")
    p.add_argument("--read-loss", action="store_true", help="read each step's loss to the host (a D2H per step)")
    p.add_argument(
        "--coordinator-address", default="", help="a running coordinator; default: one started in a process of its own"
    )
    p.add_argument(
        "--coordinator-in-process",
        action="store_true",
        help="run the coordinator in this process instead (its Python then takes the trainer's interpreter lock)",
    )
    p.add_argument("--stage-only", action="store_true", help="no coordinator, no servers: snapshot + D2H + staging")
    p.add_argument("--out", default="", help="also write the JSON object here")
    p.add_argument(
        "--trace-stalls-ms",
        type=float,
        default=0,
        help="write every thread's stack when an async iteration passes this many ms (0: never)",
    )
    p.add_argument("--trace-file", default="", help="where --trace-stalls-ms writes (default stall-traces.txt)")
    p.add_argument(
        "--native-stacks",
        action="store_true",
        help="with --trace-stalls-ms: also each thread's native stack (py-spy), in the trace file + .native",
    )
    p.add_argument(
        "--rss-interval-ms",
        type=float,
        default=1.0,
        help="how often another process reads this one's RSS (/proc/PID/status) for each phase's peak; 0: never "
        "(no RSS bound judged: whether the sampling costs the steps)",
    )
    p.add_argument(
        "--heap-timeline",
        action="store_true",
        help="read glibc's arenas, mappings and free chunks around each publish step (mallinfo2: it locks "
        "each arena while it counts, tens of ms on a heap of millions of free chunks)",
    )
    p.add_argument(
        "--heaps",
        choices=tuple(HEAP_PADS),
        default="kept",
        help="a thread arena's heaps, for the whole run: kept as the device path holds them, or unmapped when a "
        "free empties one (glibc's own top pad; the device path's hold takes it)",
    )
    p.add_argument(
        "--block-heaps",
        choices=("steer", "count"),
        default="steer",
        help="the heaps the device path's blocks landed in, for the whole run: past the window, taken off what may be "
        "in flight (steer, the device path's own) or only counted (count, the control)",
    )
    p.add_argument(
        "--trace-blocks",
        default="",
        help="write here (JSON) each block's host buffer as it landed (its address and bytes, the window's room "
        "in flight then), when its copy was issued (its buffer allocated) and when it was freed, and glibc's "
        "malloc_info at the end",
    )
    p.add_argument(
        "--force-blocks",
        action="store_true",
        help="cut shards into blocks on CPU devices too (the accelerator's branch, its held heap included)",
    )
    args = p.parse_args()
    args.blocking_steps = args.blocking_steps or min(args.steps, 10)
    if args.force_blocks:
        params_module.HOST_MEMORY_PLATFORMS = frozenset()
    hold_heaps(args.heaps)
    block_heaps.steer = args.block_heaps == "steer"
    trace = BlockTrace() if args.trace_blocks else None
    out = run(args)
    if trace is not None:
        trace.write(args.trace_blocks)
    emit_json(out, args.out)
    if args.out:
        print(f"results: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
