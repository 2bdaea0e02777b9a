"""Drop from the carried SGLang wheel what a language-model server never imports, so a
Triton cache fits beside it in a device call's 64 MiB.

    python3 bench/device/trim_carry.py .carry

A cold call compiles the project's Triton kernels again (~60 s of a Qwen3-30B-A3B
server's start: bench/README.md); ``setup_device.sh`` seeds Triton's cache from
``.carry/triton_cache_sm90.tgz`` when there, but the carry of
``../shared/device/make-sglang-carry.sh`` leaves ~1.8 MiB of the 64 MiB, and one
shape's cache takes 2.0-2.7 MiB. The SGLang 0.5.17 wheel holds two parts SGLang's
runtime (``sglang.srt``) does not import:

* ``sglang/multimodal_gen/``: the diffusion server (``sglang generate``/``serve`` of
  image and video models and the diffusion kernels import it; ``sglang.srt`` does not);
* ``sglang/srt/grpc/_core*.so``: the native gRPC server, imported only when it is
  asked for (``http_server.py`` imports it lazily and says so when absent).

Together ~4.8 MB compressed. The wheel is rewritten in place without them, its
``RECORD`` without their lines; run it again and it finds nothing left to drop.

That left ~0.4 MiB beside this project's tree and ``.devdata``, short of the 1.3 MB cache
of both shapes' kernels (thirty-second session). So the sgl-kernel archive
(``sgl_kernel_sm90.tgz``, 18.2 MB of gzip) is rewritten as ``sgl_kernel_sm90.tar.xz``
(13.6 MB: the same members, byte for byte), which ``setup_device.sh`` unpacks with
Python's ``tarfile`` (``lzma`` is in CPython's standard library).
"""

from __future__ import annotations

import argparse
import lzma
import re
import sys
import tarfile
import zipfile
from pathlib import Path

#: paths in the wheel that sglang.srt never imports (see the module docstring)
DROP = (re.compile(r"^sglang/multimodal_gen/"), re.compile(r"^sglang/srt/grpc/_core[^/]*\.so$"))


def dropped(name: str) -> bool:
    return any(p.search(name) for p in DROP)


def trim_wheel(path: Path) -> int:
    """Rewrite the wheel at ``path`` without the ``DROP`` paths; returns the bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".trimmed")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [i for i in src.infolist() if not dropped(i.filename)]
        if len(names) == len(src.infolist()):
            tmp.unlink()
            return 0
        for info in names:
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # pip reads it: no lines for absent files
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(path)
    return before - path.stat().st_size


def recompress_sgl_kernel(carry: Path) -> int:
    """``sgl_kernel_sm90.tgz`` in ``carry`` rewritten as ``sgl_kernel_sm90.tar.xz`` with the
    same members and bytes (checked before the .tgz goes); returns the bytes saved, 0 where
    there is no .tgz left."""
    src = carry / "sgl_kernel_sm90.tgz"
    if not src.exists():
        return 0
    dst = carry / "sgl_kernel_sm90.tar.xz"
    tmp = dst.with_suffix(".partial")
    with tarfile.open(src, "r:gz") as tin, \
            tarfile.open(tmp, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tout:
        for info in tin:
            tout.addfile(info, tin.extractfile(info) if info.isfile() else None)
    with tarfile.open(src, "r:gz") as a, tarfile.open(tmp, "r:xz") as b:
        for x, y in zip(a, b, strict=True):
            same = (x.name, x.type, x.mode, x.size) == (y.name, y.type, y.mode, y.size)
            if not same or (x.isfile() and a.extractfile(x).read() != b.extractfile(y).read()):
                tmp.unlink()
                raise SystemExit(f"{dst.name}: member {x.name} differs from {src.name}; kept {src.name}")
    saved = src.stat().st_size - tmp.stat().st_size
    tmp.replace(dst)
    src.unlink()
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("carry", type=Path, help="the folder make-sglang-carry.sh built (.carry)")
    args = ap.parse_args()
    wheels = sorted((args.carry / "wheels").glob("sglang-*.whl"))
    if not wheels:
        sys.exit(f"no sglang wheel in {args.carry / 'wheels'}: build the carry first "
                 "(../shared/device/make-sglang-carry.sh)")
    for wheel in wheels:
        saved = trim_wheel(wheel)
        print(f"{wheel.name}: {saved / 1e6:.2f} MB dropped" if saved else f"{wheel.name}: nothing left to drop")
    saved = recompress_sgl_kernel(args.carry)
    if saved:
        print(f"sgl_kernel_sm90.tgz -> sgl_kernel_sm90.tar.xz: {saved / 1e6:.2f} MB saved")


if __name__ == "__main__":
    main()
