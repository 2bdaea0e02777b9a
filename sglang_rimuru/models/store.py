"""Writing model directories, atomically, and the on-disk cache.

Cache layout (root = $SGLANG_RIMURU_CACHE, else ~/.cache/sglang-rimuru):

    <root>/models/<name>            default seed
    <root>/models/<name>-seed<N>    other seeds
    <root>/tokenizers/qwen-bpe-v*-<hash>.json   converted Qwen BPE
    <root>/locks/<hash>.lock        one flock per target directory

A model directory is complete iff it exists: it is written under a hidden
sibling `.<dir>.tmp-*` and renamed into place, last file `rimuru_model.json`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

from .specs import ModelSpec, build_config, get_spec

logger = logging.getLogger(__name__)

DEFAULT_SEED = 0
STAMP_FILE = "rimuru_model.json"
# Bumped whenever the bytes written for a (name, seed) change; older caches are rebuilt.
FORMAT_VERSION = 2


def cache_root() -> Path:
    env = os.environ.get("SGLANG_RIMURU_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglang-rimuru"


def models_dir() -> Path:
    return cache_root() / "models"


def model_dir_name(name: str, seed: int = DEFAULT_SEED) -> str:
    return name if seed == DEFAULT_SEED else f"{name}-seed{seed}"


def read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((Path(path) / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _stamp(spec: ModelSpec, seed: int) -> dict:
    return {"name": spec.name, "seed": seed if spec.has_weights else None, "format": FORMAT_VERSION}


def is_current(path: Path, name: str, seed: int = DEFAULT_SEED) -> bool:
    """Whether `path` holds a complete model written by this version for (name, seed)."""
    return read_stamp(path) == _stamp(get_spec(name), seed)


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """An exclusive flock for everything that writes `target` (threads and processes)."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(str(target.resolve()).encode()).hexdigest()[:16]
    with open(lock_dir / f"{key}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Delete temp/old siblings of `target` left by an interrupted run (call under the lock)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in target.parent.glob(f".{target.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _generate(spec: ModelSpec, out: Path, seed: int) -> None:
    """Write every file of `spec` into the empty directory `out`."""
    from transformers import GenerationConfig

    from . import tokenizer as tk
    from .weights import write_tiny_weights

    config = build_config(spec)
    if spec.has_weights:
        write_tiny_weights(out, config, seed)
    else:
        config.save_pretrained(str(out))
    _use_checkpoint_key_names(out / "config.json")
    GenerationConfig(
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.generation_eos_token_ids,
        pad_token_id=spec.bos_token_id,
    ).save_pretrained(str(out))

    if spec.tokenizer == "bytes":
        tok = tk.byte_tokenizer(config.vocab_size)
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tk.qwen_tokenizer_json())
    tk.save_tokenizer(out, tok, eos_token=spec.eos_token, model_max_length=config.max_position_embeddings)
    (out / STAMP_FILE).write_text(json.dumps(_stamp(spec, seed), sort_keys=True) + "\n", encoding="utf-8")


def _use_checkpoint_key_names(config_json: Path) -> None:
    """Rename transformers 5's `num_local_experts` back to `num_experts`, the key the real
    Qwen3-MoE config.json files carry (transformers maps it back through `attribute_map`)."""
    config = json.loads(config_json.read_text(encoding="utf-8"))
    if "num_local_experts" in config and "num_experts" not in config:
        config["num_experts"] = config.pop("num_local_experts")
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_unlocked(spec: ModelSpec, target: Path, seed: int) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        _generate(spec, tmp, seed)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    weights = "weights" if spec.has_weights else "config only"
    logger.info("wrote %s (%s, %.1f MiB) to %s in %.1f s", spec.name, weights, size / 2**20, target, time.monotonic() - t0)
    return target


def write_model(name: str, out: str | os.PathLike, *, seed: int = DEFAULT_SEED) -> Path:
    """(Re)generate model `name` into directory `out`, replacing what is there. Returns `out`.

    Atomic: `out` is either the old directory or the complete new one, never a mix.
    """
    spec = get_spec(name)
    target = Path(out).expanduser().absolute()
    with _locked(target):
        return _write_unlocked(spec, target, seed)


def ensure_model(name: str, cache_dir: str | os.PathLike | None = None, *, seed: int = DEFAULT_SEED) -> Path:
    """Path of model `name` under `cache_dir` (default `models_dir()`), generated on first use.

    Idempotent: a complete, current directory is returned untouched. Safe under
    concurrent callers (one generates, the others wait and reuse it) and after an
    interrupted run (its temp directory is removed, nothing half-written is visible).
    Raises `UnknownModelError` for a name not in `MODELS`.
    """
    spec = get_spec(name)
    if not spec.has_weights:
        seed = DEFAULT_SEED  # a config-only model does not depend on the seed
    parent = Path(cache_dir).expanduser() if cache_dir is not None else models_dir()
    target = (parent / model_dir_name(name, seed)).absolute()
    if is_current(target, name, seed):
        return target
    with _locked(target):
        if is_current(target, name, seed):
            return target
        return _write_unlocked(spec, target, seed)


def default_model_path() -> Path:
    """The tiny Qwen3-MoE (known to load in SGLang 0.5.17 on CPU), generated on first use."""
    return ensure_model("tiny-qwen3-moe")
