"""Other models and TP=2 on CPU, each on its own server."""

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


def test_tensor_parallel_2(tmp_path, model_dir):
    path = ensure_model("tiny-qwen3-moe", cache_dir=model_dir)
    srv = start_server(["--model-path", str(path), "--tp-size", "2"], tmp_path / "server.log")
    try:
        out = generate(srv, "tensor parallel", max_new_tokens=4)
        assert len(out["output_ids"]) == 4
        again = generate(srv, "tensor parallel", max_new_tokens=4)
        assert again["output_ids"] == out["output_ids"]
        # two schedulers (one per rank) and the detokenizer installed the seams
        assert srv.log().count("seams installed") == 3
    finally:
        srv.stop()
