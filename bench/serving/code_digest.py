"""Which server code a run ran: a digest of the files the server imports.

    python3 bench/serving/code_digest.py [--commit REV]

Issue 12 asks for its tables "from runs at one commit". The device gets a copy of the
working tree without ``.git``, so a run cannot name its commit; it can hash what it runs.
The digest covers what the server imports or reads: ``sglang_rimuru/``, ``kernels/`` and
``patches/`` (Python sources and the tuned kernel tables), not ``bench/`` or ``tests/``, so
a commit that only changes a benchmark script or RESULTS keeps the digest. ``run_one.py``
writes it into every run's JSON; ``--commit REV`` computes it for a commit of this
repository (from git's objects, no checkout), so a digest can be matched to commits.

Since the thirty-third session a run's digest leaves out the kernels' tables tuned for other
GPUs (``--device``; run_one.py passes the GPU it ran on): a table added for the H100 does not
move the H200 runs' digest. While every table in the tree was the H200's this changed no H200
digest; an H100 run's digest before it counted the H200's tables (`f5c7aed6cf59` on both).

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
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the folders the server's code comes from (SGLang itself is pinned: 0.5.17)
CODE_DIRS = ("sglang_rimuru", "kernels", "patches")
SUFFIXES = (".py", ".json")  # sources, and the kernels' tuned launch tables


#: a tuned launch table named for one GPU (SGLang's naming, which the kernel's tables keep):
#: ".../E=60,N=1408,device_name=NVIDIA_H200.json", "..._down.json"
DEVICE_TABLE = re.compile(r"device_name=(.+?)(?:_down)?\.json$")


def device_of(gpu_name: str | None) -> str | None:
    """A GPU's name as the tables spell it ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3",
    ``rimuru_kernels.moe_config.device_name``); None for None."""
    return gpu_name.replace(" ", "_") if gpu_name else None


def _counts(path: str, device: str | None = None) -> bool:
    """Whether ``path`` is server code; with ``device``, a table tuned for another GPU is not:
    the server on this one never reads it, so adding an H100 table leaves the H200's digest
    (and the runs that count as one server code there) where it was."""
    if not (path.split("/", 1)[0] in CODE_DIRS and path.endswith(SUFFIXES) and "__pycache__" not in path):
        return False
    m = DEVICE_TABLE.search(path) if device else None
    return m is None or m.group(1) == device


def digest_of(files: dict[str, bytes], device: str | None = None) -> str:
    """12 hex digits over the sorted (path, bytes) pairs of the code files among ``files``
    (with ``device``, less the tables tuned for other GPUs)."""
    h = hashlib.sha256()
    for path in sorted(p for p in files if _counts(p, device)):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()[:12]


#: where the kernel's own tables live: a table read from RIMURU_KERNELS_CONFIG_DIR counts as
#: if it were there (the server reads it first, under the same name)
KERNEL_CONFIGS = "kernels/rimuru_kernels/configs"


def tree_digest(root: Path = ROOT, device: str | None = None, config_dirs: str | None = None) -> str:
    """The digest of the code under ``root`` as it is on disk (what a run on ``device``
    imports and reads; every GPU's tables where None). ``config_dirs``: the server's
    ``RIMURU_KERNELS_CONFIG_DIR`` (os.pathsep-separated): each table there counts as the
    kernel's own of that name, the first folder's over the later ones', as the lookup reads
    them, so a run on a table under trial has the digest of the commit that ships it."""
    files = {}
    for d in CODE_DIRS:
        for f in (root / d).rglob("*"):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and _counts(rel, device):
                files[rel] = f.read_bytes()
    for d in reversed([Path(x) for x in (config_dirs or "").split(os.pathsep) if x]):
        for f in sorted(d.glob("*.json")):
            files[f"{KERNEL_CONFIGS}/{f.name}"] = f.read_bytes()
    return digest_of(files, device)


@functools.lru_cache(maxsize=None)  # report.py asks once per run, often of one commit
def commit_digest(rev: str, root: Path = ROOT, device: str | None = None) -> str:
    """The digest of commit ``rev``'s code, read from git's objects (on ``device``, as above)."""
    listing = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", rev, "--", *CODE_DIRS],
                             capture_output=True, text=True, check=True).stdout.split()
    files = {p: subprocess.run(["git", "-C", str(root), "show", f"{rev}:{p}"], capture_output=True,
                               check=True).stdout for p in listing if _counts(p, device)}
    return digest_of(files, device)


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
    ap.add_argument("--device", help="the GPU the runs ran on, as the tables name it (NVIDIA_H200, "
                    "NVIDIA_H100_80GB_HBM3): tables tuned for other GPUs do not count, as run_one.py records it")
    args = ap.parse_args()
    print(commit_digest(args.commit, device=args.device) if args.commit else tree_digest(device=args.device))


if __name__ == "__main__":
    main()
