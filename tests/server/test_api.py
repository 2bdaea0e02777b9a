"""The HTTP and OpenAI APIs, the frontend DSL and the radix cache, through the launcher.

One server for the module, started with no ``--model-path``: the launcher
generates and serves the default tiny Qwen3-MoE model.
"""

from __future__ import annotations

import json
import re

import pytest
import requests

from tests.conftest import generate, start_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    srv = start_server(
        ["--max-running-requests", "16"],
        tmp_path_factory.mktemp("srv") / "server.log",
        env={"SGLANG_RIMURU_CACHE": str(model_dir)},
    )
    yield srv
    srv.stop()


def test_default_model_is_the_tiny_qwen3_moe(server):
    info = requests.get(server.url + "/model_info", timeout=10).json()
    assert "tiny-qwen3-moe" in info["model_path"]


def test_patches_installed_in_every_spawned_process(server):
    # One scheduler (TP=1) and one detokenizer each announce their seams.
    lines = re.findall(r"\[sglang-rimuru\] pid (\d+): (\d+) seams installed \(([^)]*)\)", server.log())
    assert len({pid for pid, _, _ in lines}) == 2, server.log()[-3000:]
    for _, count, names in lines:
        assert int(count) >= 1 and "cpu.no_pynccl" in names


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
    body = {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    chunks = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) >= 2
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6
    # the stream ends with the same tokens a non-streamed greedy request gets
    assert chunks[-1]["output_ids"][-6:] == generate(server, "stream me", max_new_tokens=6)["output_ids"]


def test_greedy_is_deterministic(server):
    a = generate(server, "determinism check", max_new_tokens=12)
    b = generate(server, "determinism check", max_new_tokens=12)
    assert a["output_ids"] == b["output_ids"]


def test_openai_completions(server):
    resp = requests.post(
        server.url + "/v1/completions",
        json={"model": "default", "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    resp.raise_for_status()
    body = resp.json()
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
    body = {"model": "default", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 4, "stream": True}
    events = []
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
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
    import sglang as sgl

    @sgl.function
    def program(s, topic):
        s += "Topic: " + topic + "\n"
        s += "Answer: " + sgl.gen("answer", max_tokens=6, temperature=0)
        s += "\nVerdict: " + sgl.select("verdict", choices=["yes", "no", "maybe"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}: " + sgl.gen("idea", max_tokens=4, temperature=0)
        forks.join()
        s["ideas"] = [f["idea"] for f in forks]

    backend = sgl.RuntimeEndpoint(server.url)
    state = program.run(topic="paged experts", backend=backend)
    assert isinstance(state["answer"], str)
    assert state["verdict"] in ("yes", "no", "maybe")
    assert len(state["ideas"]) == 2

    states = program.run_batch([{"topic": "a"}, {"topic": "b"}], backend=backend)
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
