"""The pool core imports the standard library and torch only -- never sglang."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import sglang_rimuru.pool as pool

POOL_DIR = Path(pool.__file__).parent
ALLOWED_THIRD_PARTY = {"torch"}


def _top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_pool_imports_only_stdlib_and_torch() -> None:
    files = sorted(POOL_DIR.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        bad = {n for n in _top_level_imports(path)
               if n not in sys.stdlib_module_names and n not in ALLOWED_THIRD_PARTY}
        assert not bad, f"{path.name} imports {sorted(bad)}; the pool may import stdlib and torch only"


def test_only_buffer_imports_torch() -> None:
    users = {p.name for p in POOL_DIR.glob("*.py") if "torch" in _top_level_imports(p)}
    assert users == {"buffer.py"}
