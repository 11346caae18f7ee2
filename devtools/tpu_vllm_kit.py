"""The vLLM TPU engine's part of the offline kit: `.tpu-kit/vllm/` (docs/install-tpu.md).

    python -m devtools.tpu_vllm_kit            # `make tpu-kit` runs it after devtools/tpu_kit.sh

The closure is `devtools/tpu_vllm_lock.txt`: a `kit` row is downloaded here and carried, a
`host` row is already in the host's wheel folders and is only named. Two kit wheels are
edited on the way, each recorded in its RECORD so pip installs them as any other:

- vllm-tpu is built for CPython 3.12 but declares Python >=3.10 and its only native files
  are abi3: its WHEEL `Tag:` lines (and the file name) are rewritten to cp311;
- torchax 0.0.13 names op overloads torch 2.13 removed (the Dimname ones) in its op tables,
  and fails at import: each table line naming an overload this venv's torch (the host's
  release, 2.13.0+cpu) lacks is dropped, a patched wheel under the same name.

It also writes a wheel with no code, `weightsync_vllm_plugins`, whose entry points are the
project's `vllm.general_plugins` (pyproject.toml): the project runs from its source tree on
the host, and vLLM finds plugins by installed metadata only. `.tpu-kit/activate-vllm`
installs the closure (`closure.txt`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "devtools" / "tpu_vllm_lock.txt"
PLUGINS_DIST = "weightsync_vllm_plugins"
# the host's glibc is 2.36; the newest manylinux tag first (as devtools/tpu_kit.sh)
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(36, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64", "any"]
_TABLE_LINE = re.compile(r"^\s*torch\.ops\.aten\.(\w+)\.(\w+)\s*(:[^#]*)?,\s*(#.*)?$")
_WHEEL_NAME = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def read_lock(path: Path = LOCK) -> list[tuple[str, str]]:
    """(where, wheel file name) of every row: where is `kit` or `host`."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        where, wheel = line.split("\t")[:2]
        if where not in ("kit", "host"):
            raise ValueError(f"{path.name}: {where!r} is neither kit nor host ({line!r})")
        rows.append((where, wheel))
    return rows


def pin_of(wheel: str) -> str:
    """`name==version` of a wheel file name (the project names of PyPI)."""
    m = _WHEEL_NAME.match(wheel)
    if m is None:
        raise ValueError(f"{wheel!r} is not a wheel file name")
    return f"{m['name'].replace('_', '-')}=={m['version']}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_wheel(src: Path, dst: Path, edit: Callable[[str, bytes], bytes | None]) -> list[str]:
    """Copies wheel `src` to `dst`, each member through `edit(name, data)` (None: unchanged),
    with RECORD's hash and size lines for every changed member rewritten; the changed
    members' names."""
    changed: dict[str, bytes] = {}
    with zipfile.ZipFile(src) as zin:
        members = [(info, zin.read(info)) for info in zin.infolist()]
    record_name = next(i.filename for i, _ in members if i.filename.endswith(".dist-info/RECORD"))
    for info, data in members:
        new = edit(info.filename, data) if info.filename != record_name else None
        if new is not None and new != data:
            changed[info.filename] = new
    lines = []
    record = next(data for info, data in members if info.filename == record_name).decode()
    for line in record.splitlines():
        name = line.rsplit(",", 2)[0]
        if name in changed:
            line = f"{name},{_record_hash(changed[name])},{len(changed[name])}"
        lines.append(line)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, data in members:
            if info.filename == record_name:
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, changed.get(info.filename, data))
    return sorted(changed)


def retag(src: Path, dst_dir: Path, python: str) -> Path:
    """vllm-tpu's cp312 wheel as a `python` (cp311) one: the WHEEL file's Tag lines and the
    file name. Refused where the wheel holds a native file that is not abi3."""
    m = _WHEEL_NAME.match(src.name)
    assert m is not None
    with zipfile.ZipFile(src) as z:
        native = [n for n in z.namelist() if n.endswith(".so") and ".abi3." not in n]
    if native:
        raise ValueError(f"{src.name} holds native files built for one Python ({native[0]}): it cannot be retagged")
    old = f"{m['py']}-{m['abi']}"
    new = f"{python}-{python}"

    def edit(name: str, data: bytes) -> bytes | None:
        if name.endswith(".dist-info/WHEEL"):
            return data.decode().replace(f"Tag: {old}-", f"Tag: {new}-").encode()
        return None

    dst = dst_dir / src.name.replace(f"-{old}-", f"-{new}-")
    changed = rewrite_wheel(src, dst, edit)
    if not changed:
        raise ValueError(f"{src.name}: no 'Tag: {old}-' line to rewrite")
    return dst


def missing_overload(op: str, overload: str) -> bool:
    """Whether this venv's torch lacks `torch.ops.aten.<op>.<overload>`."""
    import torch

    packet = getattr(torch.ops.aten, op, None)
    return packet is None or not hasattr(packet, overload)


def drop_missing_overloads(src: Path, dst: Path, missing: Callable[[str, str], bool] = missing_overload) -> list[str]:
    """torchax's wheel with every op-table line (`torch.ops.aten.OP.OVERLOAD[: value],`)
    naming an overload `missing` says the running torch lacks dropped; the dropped lines
    as `file: line`."""
    dropped: list[str] = []

    def edit(name: str, data: bytes) -> bytes | None:
        if not name.endswith(".py"):
            return None
        keep = []
        for line in data.decode().splitlines(keepends=True):
            m = _TABLE_LINE.match(line)
            if m and missing(m[1], m[2]):
                dropped.append(f"{name}: {line.strip()}")
                continue
            keep.append(line)
        return "".join(keep).encode()

    rewrite_wheel(src, dst, edit)
    return dropped


def plugins_wheel(dst_dir: Path, pyproject: Path = ROOT / "pyproject.toml") -> Path:
    """A wheel of metadata alone whose entry points are the project's vLLM plugins."""
    project = tomllib.loads(pyproject.read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    version = project["version"]
    info = f"{PLUGINS_DIST}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PLUGINS_DIST}\nVersion: {version}\n"
        "Summary: weightsync's vLLM general plugins, for the project run from its source tree\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: devtools.tpu_vllm_kit\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{info}/entry_points.txt": "[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in plugins.items()),
    }
    record = "".join(f"{n},{_record_hash(d.encode())},{len(d.encode())}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    dst = dst_dir / f"{PLUGINS_DIST}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), data)
    dst.write_bytes(buf.getvalue())
    return dst


def _download(pin: str, dst: Path, python: str) -> Path:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    before = set(dst.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", *platforms, "-d", str(dst), pin]  # fmt: skip
    subprocess.run(cmd, check=True)
    new = sorted(set(dst.iterdir()) - before)
    if len(new) != 1:
        raise RuntimeError(f"pip download {pin}: expected one new wheel, got {[p.name for p in new]}")
    return new[0]


def build(kit: Path, lock: Path = LOCK) -> dict[str, object]:
    """Writes `kit/vllm/`: wheels/ (the kit rows, edited as the module says, and the
    plugins wheel) and closure.txt (every row as the host installs it)."""
    out = kit / "vllm"
    shutil.rmtree(out, ignore_errors=True)
    wheels, scratch = out / "wheels", out / "download"
    wheels.mkdir(parents=True)
    scratch.mkdir()
    rows = []
    dropped: list[str] = []
    for where, wheel in read_lock(lock):
        if where == "host":
            rows.append((where, wheel))
            continue
        pin = pin_of(wheel)
        if pin.startswith("vllm-tpu=="):
            got = retag(_download(pin, scratch, "3.12"), wheels, "cp311")
        elif pin.startswith("torchax=="):
            src = _download(pin, scratch, "3.11")
            got = wheels / src.name
            dropped = drop_missing_overloads(src, got)
        else:
            got = wheels / _download(pin, scratch, "3.11").name
            shutil.move(str(scratch / got.name), got)
        if got.name != wheel:
            raise RuntimeError(f"the lock names {wheel}, the kit made {got.name}")
        rows.append((where, wheel))
    rows.append(("kit", plugins_wheel(wheels).name))
    shutil.rmtree(scratch)
    shutil.copy(ROOT / "devtools" / "tpu_activate_vllm.sh", kit / "activate-vllm")
    (out / "closure.txt").write_text(
        "# where\twheel  (kit: in wheels/ beside this file; host: in the host's wheel folders)\n"
        + "".join(f"{w}\t{n}\n" for w, n in rows)
    )
    size = sum(p.stat().st_size for p in wheels.iterdir())
    return {"wheels": len(rows), "kit": sum(w == "kit" for w, _ in rows), "kit_bytes": size, "torchax_dropped": dropped}


CARRY_LIMIT = 64 << 20  # what one device call carries: the project's files and the kit


def carry_bytes(root: Path, kit: Path) -> int:
    """The bytes one device call carries: the project's tracked files (git's list; every
    file under `root` outside the kit where there is no .git) and the whole kit."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=False)
    if listed.returncode == 0:
        files = [root / n for n in listed.stdout.decode().split("\0") if n]
    else:
        files = [p for p in root.rglob("*") if kit not in p.parents]
    tree = sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())
    return tree + sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.tpu_vllm_kit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--kit", default=str(ROOT / ".tpu-kit"), help="the kit's folder (default .tpu-kit)")
    args = p.parse_args(argv)
    made = build(Path(args.kit))
    for line in made["torchax_dropped"]:  # type: ignore[attr-defined]
        print(f"tpu-vllm-kit: torchax: dropped {line}")
    print(
        f"tpu-vllm-kit: {made['wheels']} wheels in the closure, {made['kit']} carried "
        f"({int(made['kit_bytes']) / 2**20:.1f} MiB in {args.kit}/vllm/wheels), "
        f"{len(made['torchax_dropped'])} torchax lines dropped"  # type: ignore[arg-type]
    )
    carried = carry_bytes(ROOT, Path(args.kit))
    print(f"tpu-vllm-kit: one device call carries {carried / 2**20:.1f} MiB (the project's files and the kit)")
    if carried > CARRY_LIMIT:
        print(
            f"tpu-vllm-kit: that is over the {CARRY_LIMIT >> 20} MiB a call carries: build the kit with fewer"
            " TPU_KIT_EXTRAS (make tpu-kit TPU_KIT_EXTRAS=...)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
