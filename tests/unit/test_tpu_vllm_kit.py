"""The vLLM part of the TPU kit (devtools/tpu_vllm_kit.py) on small wheels made here: the
lock's rows, vllm-tpu's retag to cp311, torchax's op-table lines dropped with RECORD kept
true, the plugins wheel carrying the project's entry points; and the check's verdict line
(devtools/tpu_vllm_check.py)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from devtools import tpu_vllm_kit as kit


def _wheel(path: Path, files: dict[str, str], info: str, tag: str) -> Path:
    files = {**files, f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n"}
    record = ""
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(text.encode())}\n"
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _record_true(path: Path) -> bool:
    """Every file RECORD lists has the hash and size RECORD gives."""
    with zipfile.ZipFile(path) as z:
        record = next(n for n in z.namelist() if n.endswith("RECORD"))
        for line in z.read(record).decode().splitlines():
            name, digest, size = line.rsplit(",", 2)
            if not digest:
                continue
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if digest != f"sha256={want}" or int(size) != len(data):
                return False
    return True


def test_the_lock_names_every_wheel_once_with_its_place() -> None:
    rows = kit.read_lock()
    names = [w for _, w in rows]
    assert len(names) == len(set(names)) and {where for where, _ in rows} == {"kit", "host"}
    pins = dict(kit.pin_of(w).split("==") for w in names)
    assert pins["vllm-tpu"] == "0.25.0" and pins["tpu-inference"] == "0.25.0" and pins["torchax"] == "0.0.13"
    assert pins["numba"] == "0.68.0" and pins["llvmlite"] == "0.50.0"  # 0.62.1 refuses NumPy 2.4
    assert not {"jax", "jaxlib", "libtpu", "numpy"} & set(pins)  # the host's own, never shadowed
    host = {kit.pin_of(w).split("==")[0] for where, w in rows if where == "host"}
    assert {"torch", "numba"} <= host  # in the host's folders: not carried
    # the host's 5.18 makes tpu-inference's model registry import Gemma4's image processor,
    # which needs torchvision: the engine did not start on the v5e host with it
    assert pins["transformers"] == "5.25.0" and "transformers" not in host


def test_vllm_tpu_is_retagged_cp311(tmp_path: Path) -> None:
    info = "vllm_tpu-0.25.0.dist-info"
    src = _wheel(tmp_path / "vllm_tpu-0.25.0-cp312-cp312-manylinux_2_24_x86_64.whl",
                 {"vllm/__init__.py": "", "vllm/fs_io_C.abi3.so": "elf"}, info,
                 "cp312-cp312-manylinux_2_24_x86_64")  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    got = kit.retag(src, out, "cp311")
    assert got.name == "vllm_tpu-0.25.0-cp311-cp311-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(got) as z:
        assert "Tag: cp311-cp311-manylinux_2_24_x86_64" in z.read(f"{info}/WHEEL").decode()
    assert _record_true(got)
    native = _wheel(tmp_path / "x-1.0-cp312-cp312-linux_x86_64.whl", {"x/_c.cpython-312-x86_64-linux-gnu.so": "elf"},
                    "x-1.0.dist-info", "cp312-cp312-linux_x86_64")  # fmt: skip
    with pytest.raises(ValueError, match="native files built for one Python"):
        kit.retag(native, out, "cp311")


def test_torchax_loses_only_the_table_lines_of_missing_overloads(tmp_path: Path) -> None:
    table = (
        "TABLE = {\n"
        "  torch.ops.aten.prod.dim_Dimname: CastPolicy.FP32,\n"
        "  torch.ops.aten.prod.default: CastPolicy.FP32,\n"
        "}\n"
        "DECOMPS = [\n"
        "    torch.ops.aten.unbind.Dimname,\n"
        "    torch.ops.aten.unbind.int,\n"
        "]\n"
        "x = torch.ops.aten.unbind.Dimname  # not a table line: left for the import to say\n"
    )
    src = _wheel(tmp_path / "torchax-0.0.13-py3-none-any.whl", {"torchax/amp.py": table}, "torchax-0.0.13.dist-info",
                 "py3-none-any")  # fmt: skip
    dst = tmp_path / "patched.whl"
    dropped = kit.drop_missing_overloads(src, dst, missing=lambda op, overload: "imname" in overload)
    assert dropped == ["torchax/amp.py: torch.ops.aten.prod.dim_Dimname: CastPolicy.FP32,",
                       "torchax/amp.py: torch.ops.aten.unbind.Dimname,"]  # fmt: skip
    with zipfile.ZipFile(dst) as z:
        text = z.read("torchax/amp.py").decode()
    assert "prod.default" in text and "unbind.int" in text and "dim_Dimname" not in text
    assert _record_true(dst)


def test_the_plugins_wheel_carries_the_projects_vllm_entry_points(tmp_path: Path) -> None:
    import tomllib

    got = kit.plugins_wheel(tmp_path)
    plugins = tomllib.loads((kit.ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    with zipfile.ZipFile(got) as z:
        names = z.namelist()
        points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert all(n.startswith(f"{kit.PLUGINS_DIST}-") for n in names)  # metadata only: no code
    for name, target in plugins["vllm.general_plugins"].items():
        assert f"{name} = {target}" in points
    assert "weightsync-no-inet = rollout_agent.vllm_plugin:no_inet" in points
    assert _record_true(got)


def test_the_check_s_verdict_line() -> None:
    from devtools.tpu_vllm_check import verdict

    rows = [{"version": v, "applied": True, "state": "COMMITTED", "update_seconds": 0.1 * v,
             "logprob_max_diff": 0.01 * v, "stale_logprob_max_diff": 0.4} for v in (1, 2, 3)]  # fmt: skip
    good = {"versions": rows, "corrupted": {"refused": True, "served_unchanged": True, "audit_exact": True}}
    line, ok = verdict(good, 0.05)
    assert ok and line == (
        "vllm: 3 of 3 committed, corrupted refused: yes, logprob max diff 0.03 (stale 0.4), apply 0.200 s"
    )
    changed = {**good, "corrupted": {"refused": True, "served_unchanged": False, "audit_exact": True}}
    assert verdict(changed, 0.05) == (line.replace("refused: yes", "refused: no"), False)
    assert not verdict(good, 0.02)[1]  # past the tolerance
    cut = verdict({"versions": rows[:1], "error": "TimeoutError: past the deadline"}, 0.05)
    assert cut[0].startswith("vllm: 1 of 3 committed, corrupted refused: no") and "stopped: TimeoutError" in cut[0]
