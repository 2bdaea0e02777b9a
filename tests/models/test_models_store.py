"""ensure_model / write_model: cache paths, idempotence, atomicity, concurrency; CLI; imports."""

from __future__ import annotations

import json
import threading

import pytest

import sglang_rimuru.models as models
from sglang_rimuru.models import UnknownModelError, default_model_path, ensure_model, write_model
from sglang_rimuru.models import store
from sglang_rimuru.models.__main__ import main

NAME = "tiny-qwen3-moe"


def test_default_model_path_lives_in_the_cache_root(model_paths, rimuru_cache):
    path = default_model_path()
    assert path == rimuru_cache / "models" / NAME == model_paths[NAME]
    assert json.loads((path / "rimuru_model.json").read_text()) == {"name": NAME, "seed": 0, "format": store.FORMAT_VERSION}


def test_ensure_model_is_idempotent(tmp_path):
    first = ensure_model(NAME, tmp_path)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.iterdir()}
    second = ensure_model(NAME, tmp_path)
    assert second == first == tmp_path / NAME
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in second.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no temp or old siblings left
    assert ensure_model(NAME, tmp_path, seed=7) == tmp_path / f"{NAME}-seed7"
    assert ensure_model("qwen3-30b-a3b", tmp_path, seed=7) == tmp_path / "qwen3-30b-a3b"  # no weights: seed-free


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    real = store._generate

    def crash(spec, out, seed):
        (out / "config.json").write_text("{}")  # half a model
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_generate", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_model(NAME, tmp_path)
    assert list(tmp_path.iterdir()) == []

    # A run killed outright (no cleanup) leaves a temp sibling; the next run removes it.
    stale = tmp_path / f".{NAME}.tmp-99999-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(store, "_generate", real)
    path = ensure_model(NAME, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]
    assert store.is_current(path, NAME)


def test_failed_rewrite_keeps_the_old_model(tmp_path, monkeypatch):
    path = write_model(NAME, tmp_path / "m")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def crash(spec, out, seed):
        raise RuntimeError("disk full")

    monkeypatch.setattr(store, "_generate", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        write_model(NAME, path, seed=3)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_concurrent_callers_generate_once(tmp_path, monkeypatch):
    real = store._generate
    calls = []

    def counting(spec, out, seed):
        calls.append(spec.name)
        real(spec, out, seed)

    monkeypatch.setattr(store, "_generate", counting)
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_model(NAME, tmp_path))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / NAME] * 4
    assert calls == [NAME]


def test_stale_cache_entry_is_rebuilt(tmp_path):
    path = ensure_model(NAME, tmp_path)
    (path / "rimuru_model.json").write_text(json.dumps({"name": NAME, "seed": 0, "format": 0}))
    assert not store.is_current(path, NAME)
    assert ensure_model(NAME, tmp_path) == path
    assert store.is_current(path, NAME)
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]


def test_unknown_name_lists_the_known_ones(tmp_path, capsys):
    with pytest.raises(UnknownModelError) as err:
        ensure_model("mixtral-8x7b", tmp_path)
    message = str(err.value)
    assert "mixtral-8x7b" in message
    for name in models.MODELS:
        assert name in message
    assert isinstance(err.value, KeyError)
    assert main(["write", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "known models: tiny-qwen3-moe" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_write_list_and_ensure(tmp_path, capsys, rimuru_cache, model_paths):
    assert main(["write", NAME, "--out", str(tmp_path / "mine"), "--seed", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(tmp_path / "mine")
    assert f"wrote {NAME}" in out.err and out.err.count("\n") == 1
    assert json.loads((tmp_path / "mine" / "rimuru_model.json").read_text())["seed"] == 2

    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "qwen3-30b-a3b" in listing and "9.0 MiB" in listing and "16.5 MiB" in listing
    assert str(model_paths[NAME]) in listing

    assert main(["ensure", NAME]) == 0
    out = capsys.readouterr()
    assert (out.out.strip(), out.err) == (str(rimuru_cache / "models" / NAME), "")


def test_cli_write_all(tmp_path, capsys, model_paths):
    assert main(["write", "all", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / name) for name in models.MODELS]
    for name in models.MODELS:
        assert (tmp_path / name / "tokenizer.json").read_bytes() == (model_paths[name] / "tokenizer.json").read_bytes()
