"""A/B of the transfer bench (`make bench-compare REF=...`): this tree against a reference commit.

    python bench/compare.py REF [--blocks 3] [--modes shm,tcp] [--runs 5] [--judge cpu,wall]

Makes a clone of REF (`git clone --shared`, checked out at REF, under --workdir) with its
native shim (this tree's built library where `native/` is the same at REF, else built there
with CMake), then runs `bench/transfer.py` in the two trees in alternating blocks (REF, this
tree, REF, this tree, ...; each tree's own packages first on PYTHONPATH). This machine drifts
by tens of percent within minutes, so each block of this tree is paired with the REF block
just before it, and per mode the script prints the median of the paired ratios (this tree /
REF) of:

- wall seconds (publish -> COMMITTED, median of the block's rounds),
- CPU seconds of every process of the round (trainer, coordinator, rollouts), and by role,
- the paired ratio to gloo where gloo runs (the control: its own rounds interleaved).

It exits 1 when a judged ratio (`--judge`, CPU and wall seconds by default) of a mode is
above 1 + `--threshold` (10%), 0 otherwise. CPU seconds are the steadier signal on a shared
machine (wall seconds follow the neighbours' load); `git bisect run` takes
`python bench/compare.py GOOD --judge cpu` from a script that copies this file into the
commit under test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE_DIR = Path("weightsync") / "_native"
LIB = "libweightsync_native.so"
XXHASH_CANDIDATES = ("/usr/include", "/usr/local/include")
JUDGED = ("cpu", "wall")


@dataclass(frozen=True)
class Block:
    """One bench run's figures per mode (weightsync rows at the asked N)."""

    tree: str  # "ref" or "this"
    wall: dict[str, float]  # mode -> median seconds of the rounds
    cpu: dict[str, float]  # mode -> median CPU seconds of every process of a round
    roles: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> role -> CPU seconds
    gloo: dict[str, float] = field(default_factory=dict)  # mode -> paired ratio to gloo


def block_from_rows(tree: str, rows: Sequence[Mapping], rollouts: int) -> Block:
    """The weightsync rows at N = `rollouts` of a bench/transfer.py JSON (its `--out`)."""
    ours = [r for r in rows if r["method"] == "weightsync" and r["rollouts"] == rollouts]
    return Block(
        tree,
        wall={r["mode"]: r["seconds"] for r in ours},
        cpu={r["mode"]: r["cpu_seconds"] for r in ours},
        roles={r["mode"]: dict(r["cpu_roles"]) for r in ours},
        gloo={r["mode"]: r["paired_ratio_to_gloo"] for r in ours if r.get("paired_rounds")},
    )


def paired(blocks: Sequence[Block]) -> list[tuple[Block, Block]]:
    """(REF block, this tree's block) pairs in run order: each of this tree's blocks with the
    REF block just before it."""
    out: list[tuple[Block, Block]] = []
    ref: Block | None = None
    for b in blocks:
        if b.tree == "ref":
            ref = b
        elif ref is not None:
            out.append((ref, b))
            ref = None
    return out


def _ratio(pairs: Sequence[tuple[Block, Block]], get) -> float | None:  # noqa: ANN001
    vals = [get(b) / get(a) for a, b in pairs if get(a) and get(b)]
    return statistics.median(vals) if vals else None


def ratios(pairs: Sequence[tuple[Block, Block]], mode: str) -> dict[str, float]:
    """Median paired ratios (this tree / REF) of one mode: wall, cpu, each role's CPU, and
    this tree's paired ratio to gloo over REF's."""
    have = [(a, b) for a, b in pairs if mode in a.wall and mode in b.wall]
    out: dict[str, float] = {}
    getters = {
        "wall": lambda x: x.wall[mode],
        "cpu": lambda x: x.cpu[mode],
        "vs_gloo": lambda x: x.gloo.get(mode, 0.0),
    }
    for role in sorted({r for a, b in have for r in a.roles.get(mode, {})}):
        getters[f"cpu_{role}"] = lambda x, role=role: x.roles.get(mode, {}).get(role, 0.0)
    for name, get in getters.items():
        r = _ratio(have, get)
        if r is not None:
            out[name] = r
    return out


def verdicts(by_mode: Mapping[str, Mapping[str, float]], judge: Sequence[str], threshold: float) -> list[str]:
    """One line per judged ratio above 1 + threshold: the modes this tree made slower."""
    return [
        f"{mode}: {what} {r[what]:.3f}x REF (more than {threshold:.0%} slower)"
        for mode, r in by_mode.items()
        for what in judge
        if what in r and r[what] > 1 + threshold
    ]


def block_line(b: Block, modes: Sequence[str]) -> str:
    """One block's figures per mode."""
    return f"{b.tree:>4}: " + ", ".join(
        f"{m} {b.wall[m]:.3f} s CPU {b.cpu[m]:.2f}" + (f" ({b.gloo[m]:.2f}x gloo)" if m in b.gloo else "")
        for m in modes
        if m in b.wall
    )


def report(blocks: Sequence[Block], modes: Sequence[str]) -> dict[str, dict[str, float]]:
    """Prints the paired ratios; returns them by mode."""
    pairs = paired(blocks)
    by_mode = {m: ratios(pairs, m) for m in modes}
    print(f"median of {len(pairs)} paired ratios (this tree / REF):")
    for m, r in by_mode.items():
        print(f"  {m}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    return by_mode


# -- the reference tree -----------------------------------------------------------------------
def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def native_lib(tree: Path) -> Path | None:
    """The tree's built native shim, if any."""
    found = sorted((tree / NATIVE_DIR).glob("libweightsync_native.*so"))
    found = [p for p in found if "cuda" not in p.name]
    return found[0] if found else None


def make_reference(ref: str, workdir: Path) -> Path:
    """A clone of this repository at `ref` in `workdir`/ref-<sha> (kept and reused), with a
    native shim: this tree's built one where native/ is the same at ref, else built there."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = workdir / f"ref-{sha[:12]}"
    if not (tree / ".git").exists():
        subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(ROOT), str(tree)], check=True)
        subprocess.run(["git", "checkout", "--quiet", "--detach", sha], cwd=tree, check=True)
    if native_lib(tree) is None:
        own = native_lib(ROOT)
        same = own is not None and not git("diff", "--name-only", sha, "--", "native/")
        if same:
            shutil.copy2(own, tree / NATIVE_DIR / own.name)
        else:
            build_native(tree)
    return tree


def build_native(tree: Path) -> None:
    """Builds `tree`'s native/ with CMake into its weightsync/_native/ (what setup.py does,
    without pip: the shared venv keeps pointing where it points)."""
    include = next((d for d in _xxhash_dirs() if Path(d, "xxhash.h").exists()), "")
    if not include:
        raise SystemExit("xxhash.h not found: set XXHASH_INCLUDE_DIR (make setup fetches it into build/xxhash-include)")
    ffi = subprocess.run(
        [sys.executable, "-c", "import jax.ffi; print(jax.ffi.include_dir())"], capture_output=True, text=True
    ).stdout.strip()
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or "cmake"
    with tempfile.TemporaryDirectory(prefix="compare-native-") as build:
        subprocess.run(
            [cmake, "-S", str(tree / "native"), "-B", build, f"-DXXHASH_INCLUDE_DIR={include}",
             f"-DJAX_FFI_INCLUDE_DIR={ffi}", "-DCMAKE_BUILD_TYPE=Release"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        subprocess.run([cmake, "--build", build, "-j", "2"], check=True, stdout=subprocess.DEVNULL)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        shutil.copy2(Path(build) / LIB, tree / NATIVE_DIR / f"libweightsync_native{suffix}")


def _xxhash_dirs() -> list[str]:
    """Where setup.py looks for xxhash.h, and the main checkout's build/ (a worktree has none)."""
    main = Path(git("rev-parse", "--path-format=absolute", "--git-common-dir")).parent
    return [os.environ.get("XXHASH_INCLUDE_DIR", ""), *XXHASH_CANDIDATES] + [
        str(d / "build" / "xxhash-include") for d in (ROOT, main)
    ]


# -- running ------------------------------------------------------------------------------------
def python_path(tree: Path) -> str:
    """`tree` first, then this process's own PYTHONPATH (a TPU host's kit holds the
    dependencies there, not in a venv)."""
    return os.pathsep.join([str(tree), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])


def run_block(tree: Path, label: str, args: argparse.Namespace, out: Path) -> Block:
    """bench/transfer.py in `tree` (its packages first), the block's figures from its JSON."""
    cmd = [
        sys.executable, str(tree / "bench" / "transfer.py"), "--rollouts", str(args.rollouts), "--modes", args.modes,
        "--runs", str(args.runs), "--peers", args.peers, "--delta-rollouts", "", "--streaming", "", "--vllm", "",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(tree)}
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.block_timeout_s)
    except subprocess.TimeoutExpired as e:  # a rollout killed (the kernel's OOM killer) leaves the bench waiting
        raise SystemExit(f"{label}: bench/transfer.py ran past {args.block_timeout_s} s:\n{_tail(e.stdout)}") from e
    if done.returncode != 0:
        raise SystemExit(
            f"{label}: bench/transfer.py failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return block_from_rows(label, json.loads(out.read_text()), args.rollouts)


def _tail(out: str | bytes | None) -> str:
    text = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
    return text[-2000:]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ref", help="the reference commit (a tag, a branch, a sha)")
    ap.add_argument("--against", default="", help="a second commit in place of this tree (cloned as REF is)")
    ap.add_argument("--blocks", type=int, default=3, help="blocks of each tree, run in turn (REF first)")
    ap.add_argument("--modes", default="shm,tcp")
    ap.add_argument("--rollouts", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5, help="rounds per row in a block (bench/transfer.py --runs)")
    ap.add_argument("--peers", default="gloo", help="'gloo' pairs each round with gloo's (the control); '' skips")
    ap.add_argument("--judge", default=",".join(JUDGED), help="ratios that fail the run: cpu, wall, vs_gloo")
    ap.add_argument("--threshold", type=float, default=0.10, help="fail above 1 + this")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "weightsync-compare"))
    ap.add_argument("--block-timeout-s", type=float, default=1200, help="one bench run's limit")
    ap.add_argument("--json", default="", help="write the blocks and ratios here")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ref_tree = make_reference(args.ref, workdir)
    this_tree = make_reference(args.against, workdir) if args.against else ROOT
    modes = [m for m in args.modes.split(",") if m]
    judge = [j for j in args.judge.split(",") if j]
    print(f"REF {args.ref} in {ref_tree}; against {this_tree}; {args.blocks} blocks each", flush=True)
    blocks: list[Block] = []
    for i in range(args.blocks):
        for label, tree in (("ref", ref_tree), ("this", this_tree)):
            blocks.append(run_block(tree, label, args, workdir / f"block-{i}-{label}.json"))
            print(f"block {i + 1} {block_line(blocks[-1], modes)}", flush=True)
    by_mode = report(blocks, modes)
    bad = verdicts(by_mode, judge, args.threshold)
    if args.json:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["bench/compare.py", *(argv if argv is not None else sys.argv[1:])]),
            "ref": args.ref,
            "ref_commit": git("rev-parse", "--short", "HEAD", cwd=ref_tree),
            "this_commit": git("rev-parse", "--short", "HEAD", cwd=this_tree),
            "this_tree_changed": bool(git("status", "--porcelain", "--untracked-files=no", cwd=this_tree)),
            "load_average": os.getloadavg(),
            "blocks": [b.__dict__ for b in blocks],
            "ratios": by_mode,
            "slower": bad,
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for line in bad:
        print(f"SLOWER {line}")
    print("FAIL" if bad else f"OK: no judged ratio ({', '.join(judge)}) above {1 + args.threshold:.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
