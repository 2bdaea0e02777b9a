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
"""

from __future__ import annotations

import argparse
import re
import sys
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


if __name__ == "__main__":
    main()
