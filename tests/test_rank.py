"""``python -m sglang_rimuru.rank`` against a stub HTTP server: length refusals are skips, other errors one line.

The stub answers like SGLang 0.5.17 (messages copied from its tokenizer
manager and scheduler): ``/server_info`` gives an input limit of 10 tokens,
``/tokenize`` counts characters, ``/generate`` refuses or fails on cue. The
real server's path is ``tests/server/test_static_pool.py``.
"""

from __future__ import annotations

import json
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_rimuru import rank
from sglang_rimuru.models import ensure_model
from sglang_rimuru.serving import free_port

REFUSALS = {  # prompt -> (status, message)
    "ctx": (400, "The input (5000 tokens) is longer than the model's context length (4096 tokens)."),
    "total": (400, "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested "
                   "a total of 4097 tokens: 4089 tokens from the input messages and 8 tokens for the completion."),
    "sched": (400, "Input length (4095 tokens) exceeds the maximum allowed length (4090 tokens). Use a shorter "
                   "input or enable --allow-auto-truncate."),
    "neg": (400, "max_new_tokens must be at least 0, got -1."),
    "boom": (500, "Internal server error"),
}


class Stub(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(200, {"max_req_input_len": 10})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/tokenize":
            return self._reply(200, {"count": [len(p) for p in body["prompt"]], "max_model_len": 4096})
        prompt = body["text"]
        if prompt in REFUSALS:
            status, message = REFUSALS[prompt]
            return self._reply(status, {"error": {"message": message}})
        self._reply(200, {"meta_info": {"prompt_tokens": len(prompt), "completion_tokens": 2}})


@pytest.fixture(scope="module")
def stub_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.mark.parametrize("prompt", ["ctx", "total", "sched"])
def test_a_400_for_length_is_a_skip(stub_url, prompt):
    assert rank.route(stub_url, 0, prompt, 8) is None


@pytest.mark.parametrize("prompt, error", [
    ("neg", "prompt 3: HTTP 400: max_new_tokens must be at least 0, got -1."),
    ("boom", "prompt 3: HTTP 500: Internal server error"),
])
def test_any_other_error_is_one_line(stub_url, prompt, error):
    with pytest.raises(rank.RequestFailed) as info:
        rank.route(stub_url, 3, prompt, 8)
    assert str(info.value) == error


def test_no_answer_is_one_line():
    with pytest.raises(rank.RequestFailed, match=r"^prompt 0: no answer from the server \(ConnectionError\)$"):
        rank.route(f"http://127.0.0.1:{free_port()}", 0, "hi", 8)


def test_prompts_over_the_input_limit_are_not_sent(stub_url):
    fit, too_long, limit = rank._fitting(stub_url, ["short", "x" * 10, "x" * 9, "ok"])
    assert (fit, too_long, limit) == ([(0, "short"), (2, "x" * 9), (3, "ok")], 1, 10)


class _StubServer:
    def __init__(self, url: str):
        self.url = url

    def stop(self) -> None:
        pass


@pytest.mark.parametrize("prompts, message", [
    (["ok", "boom", "fine"], r"^\[rank\] error: prompt 1: HTTP 500: Internal server error \(server log: \S+\)$"),
    (["x" * 11, "ctx"], r"^\[rank\] error: no prompt was ranked, 2 skipped for length \(1 not sent: >= 10 tokens, "
                        r"the server's input limit; 1 refused by the server: prompt \+ 32 new tokens over its "
                        r"context\)$"),
])
def test_main_ends_with_one_line(stub_url, tmp_path, model_dir, monkeypatch, prompts, message):
    monkeypatch.setattr(rank, "start_local_server", lambda *args, **kwargs: _StubServer(stub_url))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # main's server log
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    model = ensure_model("tiny-qwen3-moe", cache_dir=model_dir)
    with pytest.raises(SystemExit, match=message):
        rank.main(["--model-path", str(model), "--out", str(tmp_path / "r.json"), "--prompts", str(path),
                   "--concurrency", "1"])
