"""Importing sglang_rimuru.experts loads neither sglang nor triton (rimuru_kernels is lazy).

The static import rules of the package are rows of tests/test_layout.py."""

from __future__ import annotations

import sys


def test_importing_experts_loads_neither_sglang_nor_triton() -> None:
    import subprocess

    code = ("import sys, sglang_rimuru.experts; "
            "bad = [m for m in ('sglang', 'triton', 'rimuru_kernels') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
