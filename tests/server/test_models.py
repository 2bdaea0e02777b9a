"""Qwen2-MoE (shared expert) on CPU. Mode off at TP=2 is served in
``test_static_pool.py::test_static_mode_with_tensor_parallel_2``."""

from __future__ import annotations

import pytest

from sglang_rimuru.models import ensure_model
from tests.conftest import generate, start_server

pytestmark = pytest.mark.server


def test_qwen2_moe_with_shared_expert(tmp_path, model_dir):
    path = ensure_model("tiny-qwen2-moe", cache_dir=model_dir)
    srv = start_server(["--model-path", str(path)], tmp_path / "server.log")
    try:
        a = generate(srv, ["shared expert", "second prompt"], max_new_tokens=6)
        assert [len(o["output_ids"]) for o in a] == [6, 6]
        b = generate(srv, ["shared expert", "second prompt"], max_new_tokens=6)
        assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
        assert "cpu.qwen2_moe_shared_expert_gate" in srv.log()
    finally:
        srv.stop()
