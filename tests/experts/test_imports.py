"""sglang_rimuru.experts imports torch, the standard library and sglang_rimuru.pool only;
rimuru_kernels only inside a function (lazily); never sglang."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import sglang_rimuru.experts as experts

DIR = Path(experts.__file__).parent


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, level) of every import under ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level))
    return out


def test_experts_import_rules() -> None:
    files = sorted(DIR.glob("*.py"))
    assert {p.name for p in files} >= {"shapes.py", "ranking.py", "host_store.py", "residency.py",
                                       "load_buffers.py", "manager.py", "__init__.py"}
    lazy = set()
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        nested = [imp for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for imp in _imports(fn)]
        for module, level in _imports(tree):
            if level > 0:
                continue  # this package
            root = module.split(".")[0]
            if root in sys.stdlib_module_names or root == "torch" or module == "sglang_rimuru.pool":
                continue
            if root == "rimuru_kernels" and (module, level) in nested:
                lazy.add(path.name)
                continue
            raise AssertionError(f"{path.name} imports {module!r}")
    assert lazy == {"manager.py"}


def test_importing_experts_loads_neither_sglang_nor_triton() -> None:
    import subprocess

    code = ("import sys, sglang_rimuru.experts; "
            "bad = [m for m in ('sglang', 'triton', 'rimuru_kernels') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
