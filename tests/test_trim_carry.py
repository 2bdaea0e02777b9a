"""bench/device/trim_carry.py: the carried SGLang wheel loses the diffusion server and the
native gRPC extension (what sglang.srt never imports), and its RECORD their lines;
everything else is kept byte for byte, and a second run finds nothing to drop."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from tests.conftest import bench_module

trim_carry = bench_module("device/trim_carry.py")

KEPT = {
    "sglang/srt/server_args.py": b"# the runtime\n",
    "sglang/srt/grpc/__init__.py": b"# SGLang gRPC module\n",
    "sglang/srt/server/_core.cpython-312-x86_64-linux-gnu.so": b"\x7fELF server",
    "sglang/multimodal_gen_notes.txt": b"not under multimodal_gen/",
}
DROPPED = {
    "sglang/multimodal_gen/runtime/pipeline.py": b"# diffusion\n",
    "sglang/multimodal_gen/test/t.py": b"# diffusion test\n",
    "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so": b"\x7fELF grpc",
}


def _wheel(path: Path) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in {**KEPT, **DROPPED}.items())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in {**KEPT, **DROPPED}.items():
            z.writestr(name, data)
        z.writestr("sglang-0.5.17.dist-info/RECORD", record + "sglang-0.5.17.dist-info/RECORD,,\n")
    return path


def test_the_wheel_loses_what_sglang_srt_never_imports(tmp_path, capsys, monkeypatch):
    wheels = tmp_path / ".carry" / "wheels"
    wheels.mkdir(parents=True)
    wheel = _wheel(wheels / "sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl")
    assert trim_carry.trim_wheel(wheel) > 0
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {*KEPT, "sglang-0.5.17.dist-info/RECORD"}
        assert all(z.read(name) == data for name, data in KEPT.items())
        record = z.read("sglang-0.5.17.dist-info/RECORD").decode().splitlines()
    assert [line.split(",")[0] for line in record] == [*KEPT, "sglang-0.5.17.dist-info/RECORD"]
    monkeypatch.setattr(sys, "argv", ["trim_carry.py", str(tmp_path / ".carry")])
    trim_carry.main()
    assert capsys.readouterr().out.strip() == f"{wheel.name}: nothing left to drop"


def test_no_wheel_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trim_carry.py", str(tmp_path)])
    try:
        trim_carry.main()
    except SystemExit as exc:
        assert "no sglang wheel in" in str(exc) and "make-sglang-carry.sh" in str(exc)
    else:
        raise AssertionError("no error without a wheel")
