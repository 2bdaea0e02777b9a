"""Shared test helpers: servers started through the project's launcher.

Servers come from ``sglang_rimuru.serving`` (own process group, log file under
pytest's tmp dir, stopped by killing the whole group).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from sglang_rimuru.serving import LocalServer, launcher_cmd, start_local_server  # noqa: F401 (re-exported)

STARTUP_TIMEOUT_S = float(os.environ.get("RIMURU_TEST_STARTUP_TIMEOUT", "300"))


#: a server started for a test (url, proc, log_path; .log(), .stop())
Server = LocalServer


#: SGLang's own range checks on KV writes (``set_kv_buffer``: ``0 <= loc < size + page_size``).
#: On a GPU the JIT KV store asserts the same; on CPU nothing would, so a pool that
#: hands SGLang an id past its KV pool would pass every CPU test (it did, at 0dafc5d).
CHECKED_SGLANG = {"SGLANG_ENABLE_ASYNC_ASSERT": "1"}


def start_server(args: list[str], log_path: Path, env: dict | None = None) -> Server:
    return start_local_server(args, log_path, timeout=STARTUP_TIMEOUT_S, env={**CHECKED_SGLANG, **(env or {})})


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """Where the tests' generated models live (shared by the whole session)."""
    return Path(os.environ.get("SGLANG_RIMURU_CACHE", tmp_path_factory.mktemp("models")))


def generate(server: Server, text, max_new_tokens: int = 8, **params) -> dict | list:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **params}}
    resp = requests.post(server.url + "/generate", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()
