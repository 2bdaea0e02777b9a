"""Import rules between the project's folders (checked with ast, not by convention).

- the core (`sglang_rimuru/`) never imports `sglang`; only the launcher module
  may reach into `rimuru_patches`;
- `rimuru_kernels` imports only torch, triton and the standard library;
- nothing is importable as a bare `kernels` or `patches` package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_never_imports_sglang():
    offenders = {}
    for path in (ROOT / "sglang_rimuru").rglob("*.py"):
        roots = imported_roots(path)
        bad = roots & {"sglang", "sgl_kernel"}
        if path.name != "launch_server.py":
            bad |= roots & {"rimuru_patches"}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_kernels_import_only_torch_and_triton():
    allowed = {"torch", "triton", "rimuru_kernels", *sys.stdlib_module_names}
    offenders = {}
    for path in (ROOT / "kernels" / "rimuru_kernels").rglob("*.py"):
        bad = imported_roots(path) - allowed
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_no_bare_kernels_or_patches_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "patches" / "__init__.py").exists()
    import kernels  # the PyPI package SGLang depends on

    assert "site-packages" in (kernels.__file__ or ""), kernels.__file__


def test_every_folder_has_a_readme():
    for folder in ("sglang_rimuru", "kernels", "patches", "tests", "bench"):
        assert (ROOT / folder / "README.md").is_file(), folder
