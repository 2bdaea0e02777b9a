"""Structured output in every mode on CPU, and refusals that never take the server down.

The request bodies and validators are ``bench/grammar_check.py``'s (the GPU
run sends the same): regex, EBNF, JSON schema (native and OpenAI), OpenAI
JSON mode, the frontend DSL's ``gen(regex=...)``, ``select`` and
``gen(choices=...)``. Outputs are validated, not just their status. One
server per mode (off, static, elastic with a small pool, so experts move
while grammars decode) and one with ``--grammar-backend none``.

Under load: a few long plain generations run while every bad request is
sent once; each must be a 400 naming its reason, ``/health`` must stay 200
and every generation must finish with all its tokens.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from bench import grammar_check as gc
from tests.conftest import generate, start_server

pytestmark = pytest.mark.server

STATIC = ["--rimuru-mode", "static", "--rimuru-resident-experts", "4", "--rimuru-expert-offload-limit", "4"]
# test_elastic.py's small pool: 200 tokens of KV beside every expert; longer runs evict experts
ELASTIC = ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4", "--max-total-tokens", "200",
           "--context-length", "512"]
MODES = {"off": [], "static": STATIC, "elastic": ELASTIC}

LOAD, LOAD_TOKENS = 4, 200


@pytest.fixture(scope="module", params=list(MODES))
def server(request, tmp_path_factory, model_dir):
    srv = start_server(MODES[request.param], tmp_path_factory.mktemp(request.param) / "server.log",
                       env={"SGLANG_RIMURU_CACHE": str(model_dir)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def backend_off(tmp_path_factory, model_dir):
    srv = start_server(["--grammar-backend", "none"], tmp_path_factory.mktemp("none") / "server.log",
                       env={"SGLANG_RIMURU_CACHE": str(model_dir)})
    yield srv
    srv.stop()


@pytest.mark.parametrize("case", gc.CASES, ids=lambda c: c.name)
def test_constrained_output_is_valid(server, case):
    ok, detail = gc.run_case(case, server.url)
    assert ok, detail


def refuse_under_load(srv, refusals: list[tuple[str, object, object]]) -> None:
    """Send each (name, send, reason) once while LOAD long generations run; all must go on."""
    import sglang  # noqa: F401 - the DSL cases' first import takes seconds; not while the load runs

    prompts = [f"load {i}: " + "word " * 8 for i in range(LOAD)]
    with cf.ThreadPoolExecutor(LOAD + 1) as pool:
        load = [pool.submit(generate, srv, p, LOAD_TOKENS) for p in prompts]
        health = pool.submit(poll_health, srv, load)  # SGLang's /health runs a 1-token generation
        for name, send, reason in refusals:
            ok, detail = gc.run_refusal(send, reason, srv.url)
            assert ok, (name, detail)
        in_flight = sum(not f.done() for f in load)
        outs = [f.result() for f in load]
        codes = health.result()
    assert in_flight > 0  # the refusals arrived while generations were running
    assert [len(o["output_ids"]) for o in outs] == [LOAD_TOKENS] * LOAD
    assert codes and set(codes) == {200}, codes
    assert "Traceback" not in srv.log()


def poll_health(srv, load) -> list[int]:
    codes = []
    while not all(f.done() for f in load):
        codes.append(requests.get(srv.url + "/health", timeout=30).status_code)
    return codes


def named(items, name):
    return next(item for item in items if item.name == name)


def test_bad_requests_under_load_are_400s_and_the_server_keeps_serving(server):
    refuse_under_load(server, [(r.name, r.send, r.reason) for r in gc.REFUSALS])
    assert gc.run_case(named(gc.CASES, "generate.regex"), server.url)[0]  # grammars still served
    # refused before the scheduler: it compiled (and aborted) only the structural tag
    log = server.log()
    assert "Failed to compile structural_tag grammar" in log
    assert "Failed to compile regex" not in log and "Failed to compile json" not in log


@pytest.mark.filterwarnings("ignore:Error in stream_executor")  # the DSL's report of the 400
def test_grammar_backend_none_refuses_every_kind_under_load(backend_off):
    kinds = [(c.name, c.send, gc.BACKEND_OFF_REASON) for c in gc.CASES if gc.needs_grammar(c)]
    bad = [(r.name, r.send, (r.reason, gc.BACKEND_OFF_REASON)) for r in gc.REFUSALS]
    refuse_under_load(backend_off, kinds + bad)
    assert "not supported when the server is launched" not in backend_off.log()  # the scheduler's own refusal
    # the DSL's select scores choices without a grammar: still served
    for case in gc.CASES:
        if not gc.needs_grammar(case):
            assert gc.run_case(case, backend_off.url)[0], case.name
