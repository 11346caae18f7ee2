"""The transfer benchmark's table (bench/transfer.py): a `Row` per method, mode and N, the
table on the console, in Markdown and as a plot, the targets' MET/MISS lines (`verdicts`),
the results written beside each other, and a finished run judged again (`rejudge`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bounds import Bounds  # noqa: E402
from common import shapes  # noqa: E402

CORES = os.cpu_count() or 1
PAIRED_PEER = "gloo"  # the peer every weightsync row runs its rounds beside


@dataclass
class Row:
    method: str
    mode: str
    rollouts: int
    seconds: float
    gbps: float
    ratio_to_bound: float
    bound: str
    egress_ratio: float
    peak_rss_bytes: int
    rounds: list[float] = field(default_factory=list)
    trainer_peak_rss_bytes: int = 0
    stage_seconds: float = 0.0  # weightsync: the trainer's staging (copy + digests) inside `seconds`
    pull_seconds: float = 0.0  # weightsync: the slowest rollout's pull
    pull_ratio_to_bound: float = 0.0
    rollout_overhead_bytes: int = 0  # weightsync: a rollout's peak RSS beyond its applied weights
    apply_mode: str = ""
    reuses_memory: bool = True
    # CPU seconds per round over every process of the method (trainer or sender, coordinator,
    # rollouts or readers), and by role: on CORES cores no schedule of that work ends before
    # cpu / CORES.
    cpu_seconds: float = 0.0
    cpu_roles: dict[str, float] = field(default_factory=dict)
    # the least CPU the roles' work takes (bounds.Bounds.cpu_min), and by role
    cpu_min_seconds: float = 0.0
    cpu_min_roles: dict[str, float] = field(default_factory=dict)
    # How long the engine could not serve per round: weightsync from its handshakes (a NumPy
    # engine waits for the apply alone); peers, the whole round (the engine waits for the
    # broadcast or the load).
    pause_seconds: float = 0.0
    # medians of per-round ratios to gloo's round at the same N, rounds interleaved, or for
    # rows that cannot run beside gloo (memory) blocks of rounds alternated (`paired_by`)
    paired_ratio_to_gloo: float = 0.0
    paired_pause_ratio_to_gloo: float = 0.0
    paired_rounds: int = 0
    paired_by: str = ""
    # results from before the alternation (--rejudge): median seconds over gloo's median
    ratio_to_gloo: float = 0.0
    # one warm copy of the model's bytes (an apply), measured just before the row's rounds,
    # and N such copies at once (N rollouts applying together on this one machine)
    copy_seconds: float = 0.0
    copies_at_once_seconds: float = 0.0
    # bytes on the wire per rollout / model bytes (medians); with a delta, also the delta's
    # bytes and the fraction of 16-bit elements that changed per step
    wire_ratio: float = 0.0
    delta_bytes: int = 0
    changed_fraction: float = 0.0
    egress_bytes: int = 0  # median per round


COLUMNS = (
    "method",
    "mode",
    "N",
    "seconds",
    "GB/s",
    "x bound",
    "x gloo (paired)",
    "stage s",
    "pull s",
    "pause s",
    "CPU s",
    "CPU min s",
    "wire/model",
    "egress/model",
    "peak RSS GB",
    "trainer RSS GB",
)


def _cells(r: Row) -> list[str]:
    """One row's cells, in COLUMNS order (staging, pull and CPU min only weightsync measures)."""
    ours = r.method == "weightsync"
    return [
        r.method,
        r.mode,
        str(r.rollouts),
        f"{r.seconds:.3f}",
        f"{r.gbps:.2f}",
        f"{r.ratio_to_bound:.2f} {r.bound}",
        f"{r.paired_ratio_to_gloo:.2f}" if r.paired_rounds else (f"{r.ratio_to_gloo:.2f}*" if r.ratio_to_gloo else ""),
        f"{r.stage_seconds:.3f}" if ours else "",
        f"{r.pull_seconds:.3f}" if ours else "",
        f"{r.pause_seconds:.3f}",
        f"{r.cpu_seconds:.2f}",
        f"{r.cpu_min_seconds:.2f}" if ours else "",
        f"{r.wire_ratio:.4f}" if ours else "",
        f"{r.egress_ratio:.4f}" if r.delta_bytes else f"{r.egress_ratio:.2f}",
        f"{r.peak_rss_bytes / 1e9:.2f}",
        f"{r.trainer_peak_rss_bytes / 1e9:.2f}",
    ]


def header(total: int, b: Bounds, delta_lr: float = 0.0, link: str = "") -> str:
    update = (
        f" · +delta rows: fp32 master weights, Adam-style step lr {delta_lr:g} x N(0,1) per element, served bf16"
        if delta_lr
        else ""
    )
    return (
        f"model {total / 1e9:.2f} GB bf16 · copy {b.copy_s:.3f} s ({b.memcpy_gbps:.1f} GB/s) · "
        f"xxh3 {b.hash_s:.3f} s · socket {b.socket_gbps:.2f} GB/s "
        f"(send {b.send_cpu_s:.2f} + recv {b.recv_cpu_s:.2f} CPU s) · {CORES} cores{update}"
        + (f" · every loopback byte through one {link} link (tc tbf on lo)" if link else "")
    )


def print_table(rows: list[Row], total: int, b: Bounds, delta_lr: float, link: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header(total, b, delta_lr, link))
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("method", "mode") else "left")
    for r in rows:
        table.add_row(*_cells(r))
    Console(width=190).print(table)


def markdown_table(rows: list[Row]) -> str:
    """The table as Markdown (written beside the JSON, for the README; without trainer RSS)."""
    cols = COLUMNS[:-1]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(r)[: len(cols)]) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def delta_verdicts(by: dict[tuple[str, str, int], Row], lr: float) -> list[str]:
    """The delta-sync targets, from the +delta rows beside the full rows and gloo's."""
    out: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append(f"{'MET ' if ok else 'MISS'} {name}: {detail}")

    d1, full1 = by.get(("weightsync", "tcp+delta", 1)), by.get(("weightsync", "tcp", 1))
    if d1 is not None:
        check(
            f"lr {lr:g}: delta bytes on the wire <= 5% of model bytes",
            d1.wire_ratio <= 0.05,
            f"{d1.wire_ratio:.2%} ({d1.delta_bytes / 1e6:.1f} MB per step; "
            f"{d1.changed_fraction:.2%} of elements changed)",
        )
        if full1 is not None:
            ratio = d1.stage_seconds / max(full1.stage_seconds, 1e-9)
            check(
                "staging with delta <= 1.3x staging without",
                ratio <= 1.3,
                f"{d1.stage_seconds:.3f} s vs {full1.stage_seconds:.3f} s = {ratio:.2f}x (bench-delta splits it up)",
            )
    for n in (1, 4):
        d, full, gloo = (
            by.get(("weightsync", "tcp+delta", n)),
            by.get(("weightsync", "tcp", n)),
            by.get(("gloo", "tcp", n)),
        )
        if d is None or gloo is None or not (d.paired_rounds or d.ratio_to_gloo):
            continue
        how = (
            ("paired" if d.paired_by == "rounds" else f"paired by {d.paired_by}")
            if d.paired_rounds
            else "unpaired: it ran after gloo's processes closed (memory)"
        )
        vs_gloo = d.paired_ratio_to_gloo or d.ratio_to_gloo
        floor = (
            f"; the least work {d.cpu_min_seconds:.2f} CPU s needs {d.cpu_min_seconds / CORES:.3f} s on {CORES} "
            f"cores, our CPU {d.cpu_seconds:.2f} s ({d.cpu_roles}), gloo's {gloo.cpu_seconds:.2f} s"
        )
        check(
            f"tcp+delta N={n} publish -> COMMITTED faster than gloo's full broadcast ({how})",
            vs_gloo < 1.0,
            f"{vs_gloo:.3f}x (ours {d.seconds:.3f} s, gloo {gloo.seconds:.3f} s{floor})",
        )
        if full is not None:
            both_paired = bool(full.paired_rounds and d.paired_rounds)
            speedup = (
                full.paired_ratio_to_gloo / max(d.paired_ratio_to_gloo, 1e-9)
                if both_paired
                else full.seconds / d.seconds
            )
            check(
                f"tcp+delta N={n} >= 3x faster than full tcp",
                speedup >= 3.0,
                f"{speedup:.2f}x ({'ratio of their paired ratios to gloo, ' if both_paired else ''}"
                f"{full.seconds:.3f} s vs {d.seconds:.3f} s; full CPU {full.cpu_seconds:.2f} s, "
                f"delta CPU {d.cpu_seconds:.2f} s)",
            )
    relay = by.get(("weightsync", "relay+delta", 4))
    if relay is not None and relay.delta_bytes:
        ratio = relay.egress_bytes / relay.delta_bytes
        check(
            "relay+delta N=4 trainer egress <= 1.25x the delta bytes",
            ratio <= 1.25,
            f"{ratio:.2f}x ({relay.egress_bytes / 1e6:.1f} MB sent per step, delta {relay.delta_bytes / 1e6:.1f} MB)",
        )
    return out


def verdicts(
    rows: list[Row], b: Bounds, vllm: dict | None, window: int, largest: int, delta_lr: float = 0.0
) -> list[str]:
    """The transfer targets (the pause, the CPU, the time against gloo), each with the figures it
    was judged on."""
    by = {(r.method, r.mode, r.rollouts): r for r in rows}
    out: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append(f"{'MET ' if ok else 'MISS'} {name}: {detail}")

    for mode in ("tcp", "relay"):
        for n in (1, 4):
            r = by.get(("weightsync", mode, n))
            if r is None:
                continue
            copy = r.copy_seconds
            shared = ""
            if n > 1:
                shared = (
                    f"; the {n} rollouts share {CORES} cores and apply at once: {n} copies at once take "
                    f"{r.copies_at_once_seconds:.3f} s here"
                )
            check(
                f"{mode} N={n} pause <= 1.5x one apply copy",
                r.pause_seconds <= 1.5 * copy,
                f"{r.pause_seconds:.3f} s vs 1.5 x {copy:.3f} s = {1.5 * copy:.3f} s{shared}",
            )
            if r.paired_rounds:
                check(
                    f"{mode} N={n} pause <= 0.5x gloo's round (paired)",
                    r.paired_pause_ratio_to_gloo <= 0.5,
                    f"median of {r.paired_rounds} paired ratios {r.paired_pause_ratio_to_gloo:.3f}",
                )
    for mode in ("tcp", "relay"):
        r = by.get(("weightsync", mode, 1))
        if r is not None:
            roles = ", ".join(f"{k} {v:.2f} (min {r.cpu_min_roles.get(k, 0.0):.2f})" for k, v in r.cpu_roles.items())
            check(
                f"{mode} N=1 CPU <= 1.3x the roles' physical minimum",
                r.cpu_seconds <= 1.3 * r.cpu_min_seconds,
                f"{r.cpu_seconds:.2f} CPU s vs 1.3 x {r.cpu_min_seconds:.2f} = {1.3 * r.cpu_min_seconds:.2f} "
                f"({r.cpu_seconds / max(r.cpu_min_seconds, 1e-9):.2f}x; {roles})",
            )
    for n in (1, 2, 4):
        gloo = by.get((PAIRED_PEER, "tcp", n))
        paired = [r for r in rows if r.method == "weightsync" and r.rollouts == n and r.paired_rounds]
        if not (gloo and paired):
            continue
        if n == 1:
            best = min(
                (r for r in paired if r.mode in ("tcp", "relay")), key=lambda r: r.paired_ratio_to_gloo, default=None
            )
            if best is not None:
                check(
                    "tcp or relay N=1 publish -> COMMITTED <= 1.25x gloo (paired)",
                    best.paired_ratio_to_gloo <= 1.25,
                    f"{best.mode} {best.paired_ratio_to_gloo:.3f}x{_floor(best, gloo)}",
                )
        if n == 4 and (relay := by.get(("weightsync", "relay", 4))) and relay.paired_rounds:
            check(
                "relay N=4 publish -> COMMITTED faster than gloo (paired)",
                relay.paired_ratio_to_gloo < 1.0,
                f"{relay.paired_ratio_to_gloo:.3f}x{_floor(relay, gloo)}",
            )
    relay = by.get(("weightsync", "relay", 4))
    if relay:
        check("relay N=4 egress <= 1.25x model", relay.egress_ratio <= 1.25, f"{relay.egress_ratio:.2f}x")
    out += delta_verdicts(by, delta_lr)
    for r in rows:
        if r.apply_mode == "streaming":
            bound = window + largest + (256 << 20)
            check(
                f"streaming rollout RSS <= window + largest tensor + 256 MiB ({r.mode}, N={r.rollouts})",
                r.rollout_overhead_bytes <= bound,
                f"{r.rollout_overhead_bytes / 2**20:.0f} MiB vs {bound / 2**20:.0f} MiB",
            )
    if vllm is not None:
        check(
            f"vLLM ({vllm['preset']}) tokens/s while prefetching >= 0.5x idle",
            vllm["tokens_per_s_ratio"] >= 0.5,
            f"{vllm['tokens_per_s_prefetch']:.1f} vs {vllm['tokens_per_s_idle']:.1f} tokens/s "
            f"= {vllm['tokens_per_s_ratio']:.2f}x over {vllm['prefetch_seconds']:.2f} s of prefetch",
        )
        check(
            f"vLLM ({vllm['preset']}) pause per version <= apply + 50 ms",
            vllm["max_pause_over_apply_s"] <= 0.05,
            f"largest pause - apply {vllm['max_pause_over_apply_s'] * 1e3:.1f} ms "
            f"(median pause {vllm['pause_s_median'] * 1e3:.1f} ms, apply {vllm['apply_s_median'] * 1e3:.1f} ms)",
        )
    return out


def _floor(r: Row, gloo: Row) -> str:
    """What CPU allows on this machine's cores: our round cannot end before cpu / CORES,
    nor before the roles' minimum work / CORES."""
    return (
        f" (ours {r.seconds:.3f} s, gloo {gloo.seconds:.3f} s; our CPU {r.cpu_seconds:.2f} s on {CORES} cores: "
        f"no schedule under {r.cpu_seconds / CORES:.3f} s; the least work {r.cpu_min_seconds:.2f} CPU s: "
        f"{r.cpu_min_seconds / CORES:.3f} s; gloo CPU {gloo.cpu_seconds:.2f} s)"
    )


def plot(rows: list[Row], path: Path, b: Bounds) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = sorted({f"{r.method}:{r.mode}" for r in rows}, key=lambda s: (not s.startswith("weightsync"), s))
    ns = sorted({r.rollouts for r in rows})
    by = {(f"{r.method}:{r.mode}", r.rollouts): r.gbps for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 1.1), 4.5))
    width = 0.8 / len(ns)
    for k, n in enumerate(ns):
        ax.bar(
            [i + k * width for i in range(len(labels))], [by.get((lab, n), 0) for lab in labels], width, label=f"N={n}"
        )
    ax.axhline(b.socket_gbps, color="gray", linestyle="--", label="loopback socket")
    ax.set_xticks([i + width * (len(ns) - 1) / 2 for i in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s (model bytes / seconds to every rollout)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_results(out: Path, rows: list[Row], meta: dict, b: Bounds, delta_lr: float) -> None:
    """latest.json (rows), .meta.json (bounds, verdicts), .md (the table and verdicts)."""
    total, vllm, lines = meta["model_bytes"], meta["vllm"], meta["verdicts"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1))
    vllm_md = f"\nvLLM row: `{json.dumps(vllm)}`\n" if vllm else ""
    out.with_suffix(".md").write_text(
        f"{header(total, b, delta_lr, meta.get('link', ''))}\n\n"
        + markdown_table(rows)
        + vllm_md
        + "\n"
        + "\n".join(f"- {v}" for v in lines)
        + "\n"
    )


def rejudge(out: Path, window: int) -> int:
    """The verdicts of a finished run again, from its JSON (after a change to `verdicts`)."""
    rows = [Row(**r) for r in json.loads(out.read_text())]
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    fields = {f for f in Bounds.__dataclass_fields__}
    b = Bounds(**{k: v for k, v in meta["bounds"].items() if k in fields})
    delta_lr = (meta.get("delta_update_model") or {}).get("lr", 0.0)
    largest = meta.get("largest_tensor_bytes") or 2 * max(
        int(np.prod(shape)) for shape in shapes(meta["size"]).values()
    )  # (bf16)
    meta["verdicts"] = verdicts(rows, b, meta["vllm"], window, largest, delta_lr)
    write_results(out, rows, meta, b, delta_lr)
    print("\n".join(meta["verdicts"]))
    return 0
