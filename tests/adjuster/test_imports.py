"""Importing sglang_rimuru.adjuster (or decoding an order) loads neither torch nor sglang.

The static import rules of the package are rows of tests/test_layout.py."""

from __future__ import annotations

import subprocess
import sys


def test_decoding_orders_loads_neither_torch_nor_sglang() -> None:
    code = ("import sys\n"
            "from sglang_rimuru.adjuster import ExpertMove, MigrationOrder, decode, encode\n"
            "o = MigrationOrder(1, 1, 0, (ExpertMove(0, 1, (1, 2, 3)),), (), 'x')\n"
            "assert decode(encode(o)) == o\n"
            "bad = [m for m in ('torch', 'sglang') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
