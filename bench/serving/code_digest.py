"""Which server code a run ran: a digest of the files the server imports.

    python3 bench/serving/code_digest.py [--commit REV]

Issue 12 asks for its tables "from runs at one commit". The device gets a copy of the
working tree without ``.git``, so a run cannot name its commit; it can hash what it runs.
The digest covers what the server imports or reads: ``sglang_rimuru/``, ``kernels/`` and
``patches/`` (Python sources and the tuned kernel tables), not ``bench/`` or ``tests/``, so
a commit that only changes a benchmark script or RESULTS keeps the digest. ``run_one.py``
writes it into every run's JSON; ``--commit REV`` computes it for a commit of this
repository (from git's objects, no checkout), so a digest can be matched to commits.

Runs from before this script carry no digest; ``run_digest`` recovers one, marked as
recovered, from what the run's folder or name says about the commit the device call copied:
a ``CODE_DIGEST.json`` beside the runs (``{"commit": REV, "why": ...}``, written after the
session from its notes), else a ``_<7 hex>`` commit tag at the end of the file name (how the
early sessions named their runs).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the folders the server's code comes from (SGLang itself is pinned: 0.5.17)
CODE_DIRS = ("sglang_rimuru", "kernels", "patches")
SUFFIXES = (".py", ".json")  # sources, and the kernels' tuned launch tables


def _counts(path: str) -> bool:
    return path.split("/", 1)[0] in CODE_DIRS and path.endswith(SUFFIXES) and "__pycache__" not in path


def digest_of(files: dict[str, bytes]) -> str:
    """12 hex digits over the sorted (path, bytes) pairs of the code files among ``files``."""
    h = hashlib.sha256()
    for path in sorted(p for p in files if _counts(p)):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()[:12]


def tree_digest(root: Path = ROOT) -> str:
    """The digest of the code under ``root`` as it is on disk (what a run imports)."""
    files = {}
    for d in CODE_DIRS:
        for f in (root / d).rglob("*"):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and _counts(rel):
                files[rel] = f.read_bytes()
    return digest_of(files)


@functools.lru_cache(maxsize=None)  # report.py asks once per run, often of one commit
def commit_digest(rev: str, root: Path = ROOT) -> str:
    """The digest of commit ``rev``'s code, read from git's objects."""
    listing = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", rev, "--", *CODE_DIRS],
                             capture_output=True, text=True, check=True).stdout.split()
    files = {p: subprocess.run(["git", "-C", str(root), "show", f"{rev}:{p}"], capture_output=True,
                               check=True).stdout for p in listing if _counts(p)}
    return digest_of(files)


COMMIT_TAG = re.compile(r"_([0-9a-f]{7,40})$")


def run_digest(path: Path, run: dict, root: Path = ROOT) -> tuple[str | None, str]:
    """The server code a run's JSON at ``path`` ran, and how that is known: ``"run"`` (the
    run wrote it), ``"recovered from CODE_DIGEST.json"`` or ``"recovered from the name's
    commit"``; ``(None, "")`` where nothing says."""
    if run.get("code_digest"):
        return run["code_digest"], "run"
    sidecar = path.parent / "CODE_DIGEST.json"
    if sidecar.exists():
        return commit_digest(json.loads(sidecar.read_text())["commit"], root), "recovered from CODE_DIGEST.json"
    m = COMMIT_TAG.search(path.stem)
    if m:
        try:
            return commit_digest(m.group(1), root), "recovered from the name's commit"
        except subprocess.CalledProcessError:  # a tag that is no commit of this repository
            pass
    return None, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", help="a commit of this repository (default: the files on disk)")
    args = ap.parse_args()
    print(commit_digest(args.commit) if args.commit else tree_digest())


if __name__ == "__main__":
    main()
