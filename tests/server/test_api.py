"""The HTTP and OpenAI APIs, the frontend DSL and the radix cache, through the launcher, in every mode.

One server per ``--rimuru-mode`` (off, static, elastic) for the module, each
started with no ``--model-path``: the launcher generates and serves the default
tiny Qwen3-MoE model. Static offloads half of each layer's experts (every
forward pass loads experts through the load buffers); elastic starts with every
expert resident and 512 tokens of KV, so the concurrent burst at the end
evicts experts to make room (pool invariants checked inside the server). That
greedy outputs in static and elastic mode equal mode off is asserted in
``test_static_pool.py`` and ``test_elastic.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest
import requests

from tests.conftest import generate, openai_completion, run_dsl_program, start_server

pytestmark = pytest.mark.server

MODES = {
    "off": [],
    "static": ["--rimuru-mode", "static", "--rimuru-resident-experts", "4", "--rimuru-expert-offload-limit", "4"],
    # 512 tokens of KV: the radix test's ~400-token prompt fits, the burst does not (evictions);
    # the cost-aware adjuster (on CPU an expert's PCIe time is ~0: its evictions pay, as the paper's)
    "elastic": ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4", "--max-total-tokens", "512",
                "--context-length", "1024", "--rimuru-adjuster-policy", "cost"],
}


@pytest.fixture(scope="module", params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(mode, tmp_path_factory, model_dir):
    srv = start_server(
        ["--max-running-requests", "16", *MODES[mode]],
        tmp_path_factory.mktemp(f"srv-{mode}") / "server.log",
        env={"SGLANG_RIMURU_CACHE": str(model_dir), "SGLANG_RIMURU_CHECK_INVARIANTS": "1"},
    )
    yield srv
    srv.stop()


def stream_events(url: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request (``data: ...`` lines, without ``[DONE]``)."""
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=300) as resp:
        resp.raise_for_status()
        lines = [line for line in resp.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return [json.loads(line[6:]) for line in lines]


def test_default_model_is_the_tiny_qwen3_moe(server):
    info = requests.get(server.url + "/model_info", timeout=10).json()
    assert "tiny-qwen3-moe" in info["model_path"]


def test_patches_installed_in_every_spawned_process(server, mode):
    # One scheduler (TP=1) and one detokenizer each announce their seams; the mode's own are among them.
    lines = re.findall(r"\[sglang-rimuru\] pid (\d+): (\d+) seams installed \(([^)]*)\)", server.log())
    assert len({pid for pid, _, _ in lines}) == 2, server.log()[-3000:]
    mode_seam = {"off": "cpu.no_pynccl", "static": "pool.build", "elastic": "elastic.round"}
    for _, count, names in lines:
        assert int(count) >= 1 and "cpu.no_pynccl" in names
        assert mode_seam[mode] in names.split(", ")


def test_generate_single(server):
    out = generate(server, "The capital of France is", max_new_tokens=8)
    assert len(out["output_ids"]) == 8
    assert out["meta_info"]["completion_tokens"] == 8
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_batch(server):
    prompts = ["one", "two two", "three three three"]
    outs = generate(server, prompts, max_new_tokens=5)
    assert isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p.encode()) for p in prompts]  # byte-level
    assert all(len(o["output_ids"]) == 5 for o in outs)


def test_generate_stream(server):
    body = {"text": "stream me", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    chunks = stream_events(server.url + "/generate", body)
    assert len(chunks) >= 2
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6
    # the stream ends with the same tokens a non-streamed greedy request gets
    assert chunks[-1]["output_ids"][-6:] == generate(server, "stream me", max_new_tokens=6)["output_ids"]


def test_greedy_is_deterministic(server):
    a = generate(server, "determinism check", max_new_tokens=12)
    b = generate(server, "determinism check", max_new_tokens=12)
    assert a["output_ids"] == b["output_ids"]


def test_openai_completions(server):
    body = openai_completion(server, "Once upon a time", max_tokens=7)
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 7
    assert isinstance(body["choices"][0]["text"], str)


def test_openai_chat_completions(server):
    resp = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
        timeout=120,
    )
    resp.raise_for_status()
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 5


def test_openai_chat_stream(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 4}
    events = stream_events(server.url + "/v1/chat/completions", body)
    assert events and all(e["object"] == "chat.completion.chunk" for e in events)


def test_radix_cache_reuses_shared_prefix(server):
    prefix = "A long shared system prompt about mixture-of-experts serving. " * 6
    first = generate(server, prefix + "Question one?", max_new_tokens=2)
    second = generate(server, prefix + "Question two?", max_new_tokens=2)
    assert first["meta_info"]["cached_tokens"] == 0
    # byte-level tokenizer: the shared prefix is len(prefix) tokens + "Question " (9 bytes)
    shared = len(prefix.encode()) + len("Question ")
    cached = second["meta_info"]["cached_tokens"]
    assert shared - 1 <= cached <= shared, (cached, shared)


def test_frontend_dsl_gen_select_fork(server):
    (state,) = run_dsl_program(server, ["paged experts"])
    assert isinstance(state["answer"], str)
    assert state["verdict"] in ("yes", "no", "maybe")
    assert len(state["ideas"]) == 2
    states = run_dsl_program(server, ["a", "b"])
    assert [s["verdict"] in ("yes", "no", "maybe") for s in states] == [True, True]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"text": "x", "sampling_params": {"max_new_tokens": "many"}}',
        b'{"text": "x", "sampling_params": {"temperature": -3}}',
        b'{"sampling_params": {}}',
    ],
)
def test_malformed_request_is_an_http_error_and_server_keeps_serving(server, body):
    resp = requests.post(
        server.url + "/generate", data=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    assert len(generate(server, "still alive?", max_new_tokens=3)["output_ids"]) == 3


def test_concurrent_burst_over_every_api(server, mode):
    """16 requests at once, four of each API; in elastic mode they overflow the KV pages and evict experts."""
    def one(i: int) -> int:
        prompt = f"burst {i}: " + "filler words " * 12  # ~170 tokens: three of them fill elastic's KV
        sampling = {"temperature": 0, "ignore_eos": True}
        kind = i % 4
        if kind == 0:
            return generate(server, prompt, max_new_tokens=16)["meta_info"]["completion_tokens"]
        if kind == 1:
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, **sampling}}
            return stream_events(server.url + "/generate", body)[-1]["meta_info"]["completion_tokens"]
        if kind == 2:
            return openai_completion(server, prompt, max_tokens=16)["usage"]["completion_tokens"]
        body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                "stream_options": {"include_usage": True}, **sampling}
        return stream_events(server.url + "/v1/chat/completions", body)[-1]["usage"]["completion_tokens"]

    with cf.ThreadPoolExecutor(16) as ex:
        assert list(ex.map(one, range(16))) == [16] * 16
    log = server.log()
    assert "Traceback" not in log
    if mode == "elastic":  # a round short of KV sent experts out
        assert "sglang-rimuru cost-aware adjuster" in log
        rounds = [ln for ln in log.splitlines() if "sglang-rimuru round" in ln]
        assert any("kv_short" in ln and "experts out [L" in ln for ln in rounds), rounds
