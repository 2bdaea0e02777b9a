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


def test_the_sgl_kernel_archive_becomes_xz_with_the_same_members(tmp_path, capsys, monkeypatch):
    """The .tgz make-sglang-carry.sh writes is rewritten as .tar.xz: every member's name, type,
    mode and bytes kept, the .tgz gone; a second run finds no .tgz and saves nothing. The
    Python one-liner setup_device.sh unpacks it with gives back the same files."""
    import io
    import subprocess
    import tarfile

    carry = tmp_path / ".carry"
    (carry / "wheels").mkdir(parents=True)
    _wheel(carry / "wheels" / "sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl")
    files = {"./sgl_kernel/__init__.py": b"from .ops import *\n",
             "./sgl_kernel/common_ops.abi3.so": bytes(range(256)) * 4096,
             "./sglang_kernel-0.4.5.dist-info/RECORD": b"sgl_kernel/__init__.py,,\n"}
    with tarfile.open(carry / "sgl_kernel_sm90.tgz", "w:gz") as t:
        for d in ("./", "./sgl_kernel/", "./sglang_kernel-0.4.5.dist-info/"):
            info = tarfile.TarInfo(d.rstrip("/") or ".")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            t.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(sys, "argv", ["trim_carry.py", str(carry)])
    trim_carry.main()
    assert "sgl_kernel_sm90.tgz -> sgl_kernel_sm90.tar.xz" in capsys.readouterr().out
    assert not (carry / "sgl_kernel_sm90.tgz").exists()
    with tarfile.open(carry / "sgl_kernel_sm90.tar.xz", "r:xz") as t:
        assert {m.name: t.extractfile(m).read() for m in t if m.isfile()} == files
    assert trim_carry.recompress_sgl_kernel(carry) == 0
    setup = (Path(trim_carry.__file__).parent / "setup_device.sh").read_text()
    one_liner = next(line for line in setup.splitlines() if "tarfile.open" in line).strip()
    code = one_liner.split("'")[1]
    out = tmp_path / "site"
    subprocess.run([sys.executable, "-c", code, str(carry / "sgl_kernel_sm90.tar.xz"), str(out)], check=True)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == {
        k[2:]: v for k, v in files.items()}
