"""Fixtures: one throw-away cache root per session, models generated once into it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_rimuru.models import MODELS, ensure_model

TINY = [name for name, spec in MODELS.items() if spec.has_weights]
SHAPES = [name for name, spec in MODELS.items() if not spec.has_weights]


@pytest.fixture(scope="session")
def rimuru_cache(tmp_path_factory) -> Path:
    """SGLANG_RIMURU_CACHE for the whole session, so tests never touch ~/.cache."""
    root = tmp_path_factory.mktemp("rimuru-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SGLANG_RIMURU_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="session")
def model_paths(rimuru_cache) -> dict[str, Path]:
    return {name: ensure_model(name) for name in MODELS}
