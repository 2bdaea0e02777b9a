"""sglang_rimuru.adjuster: policy, selection and orders import the standard library only;
adjuster.py adds sglang_rimuru.pool and sglang_rimuru.experts; nothing imports sglang or
torch directly, and importing the package (or decoding an order) loads neither."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sglang_rimuru.adjuster as adjuster

DIR = Path(adjuster.__file__).parent
CORE = {"sglang_rimuru.pool", "sglang_rimuru.experts", "sglang_rimuru.experts.residency"}


def _runtime_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, level) of every import, except inside ``if TYPE_CHECKING:``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level))
    return out


def test_adjuster_import_rules() -> None:
    files = {p.name: p for p in DIR.glob("*.py")}
    assert set(files) == {"__init__.py", "policy.py", "selection.py", "orders.py", "adjuster.py"}
    for name, path in files.items():
        for module, level in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if level > 0 or module.split(".")[0] in sys.stdlib_module_names:
                continue
            assert name == "adjuster.py" and module in CORE, f"{name} imports {module!r}"
    assert (DIR / "README.md").is_file()


def test_decoding_orders_loads_neither_torch_nor_sglang() -> None:
    code = ("import sys\n"
            "from sglang_rimuru.adjuster import ExpertMove, MigrationOrder, decode, encode\n"
            "o = MigrationOrder(1, 1, 0, (ExpertMove(0, 1, (1, 2, 3)),), (), 'x')\n"
            "assert decode(encode(o)) == o\n"
            "bad = [m for m in ('torch', 'sglang') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
