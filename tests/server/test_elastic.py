"""``--rimuru-mode elastic``: a burst evicts experts, a quiet period brings them back.

The pool is deliberately small: every expert resident plus 200 tokens of KV
(``--max-total-tokens 200``), offload limit 4 of 8 per layer. A burst of 16
concurrent requests of ~60 tokens each cannot fit, so the adjuster evicts
experts to make room, up to the offload limit; once the queue is empty the
free pages exceed the high water and the experts come back. Every request
must finish with the same greedy ids as a plain (mode off) server; the pool
invariants are checked after every completed order inside the server
(``SGLANG_RIMURU_CHECK_INVARIANTS=1``: a violation kills the scheduler, so
requests would fail).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import pytest
import requests

from sglang_rimuru.models import ensure_model
from tests.conftest import generate, start_server

pytestmark = pytest.mark.server

ELASTIC = ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4", "--max-total-tokens", "200",
           "--context-length", "512"]
CHECKED = {"SGLANG_RIMURU_CHECK_INVARIANTS": "1"}
BURST = [f"request {i}: " + "word " * 30 for i in range(16)]


def burst(srv) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(BURST)) as ex:
        return list(ex.map(lambda p: generate(srv, p, max_new_tokens=24)["output_ids"], BURST))


def read_trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_all_resident(trace_path, total: int, timeout: float = 60.0) -> list[dict]:
    """The trace once its last line shows every expert resident again."""
    deadline = time.time() + timeout
    while True:
        lines = read_trace(trace_path)
        if lines and lines[-1]["resident"] == total:
            return lines
        if time.time() > deadline:
            raise AssertionError(f"experts did not come back within {timeout}s; trace: {lines[-3:]}")
        time.sleep(0.5)


def test_burst_evicts_experts_quiet_restores_them_outputs_equal_off(tmp_path, model_dir):
    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    off = start_server(["--model-path", path, "--max-total-tokens", "4096", "--context-length", "512"],
                       tmp_path / "off.log")
    try:
        expected = burst(off)
    finally:
        off.stop()

    trace = tmp_path / "trace.jsonl"
    srv = start_server([*ELASTIC, "--model-path", path, "--rimuru-adjuster-trace", str(trace), "--enable-metrics"],
                       tmp_path / "elastic.log", env=CHECKED)
    try:
        got = burst(srv)
        lines = wait_all_resident(trace, total=16)
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        again = burst(srv)  # the server keeps serving after the split moved both ways
    finally:
        srv.stop()

    assert got == expected
    assert again == expected
    # experts left under the burst, down to the offload limit, and all came back
    assert min(line["resident"] for line in lines) == 8
    assert sum(len(line["evicted"]) for line in lines) >= 8
    assert sum(len(line["restored"]) for line in lines) >= 8
    assert any(line["reason"].startswith("kv_short") for line in lines)
    assert any(line["waiting"] > 0 for line in lines)
    for line in lines:  # the offload limit holds in every round
        assert all(len(experts) >= 4 for experts in line["resident_sets"].values()), line
    log = srv.log()
    rounds = [ln for ln in log.splitlines() if "sglang-rimuru round" in ln]
    assert len(rounds) >= len(lines)  # one log line per changed round (the second burst adds more)
    assert "experts out [" in rounds[0] and "waiting requests" in rounds[0]
    assert "Traceback" not in log
    # counters on SGLang's metrics endpoint
    assert 'sglang_rimuru:resident_experts{tp_rank="0"}' in metrics
    evictions = [ln for ln in metrics.splitlines() if ln.startswith("sglang_rimuru:evictions{")]
    assert evictions and float(evictions[0].split()[-1]) >= 8


def test_elastic_tp2_ranks_hold_the_same_experts_after_every_round(tmp_path, model_dir):
    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    trace = tmp_path / "trace.jsonl"
    srv = start_server([*ELASTIC, "--model-path", path, "--tp-size", "2", "--rimuru-adjuster-trace", str(trace)],
                       tmp_path / "elastic_tp2.log", env=CHECKED)
    try:
        outs = burst(srv)
        rank0 = wait_all_resident(trace, total=16)
        time.sleep(1.0)  # rank 1 writes its line for the same order at the same point of its loop
        rank1 = read_trace(tmp_path / "trace.jsonl.tp1")
    finally:
        srv.stop()

    assert len(outs) == len(BURST) and all(len(o) == 24 for o in outs)
    assert min(line["resident"] for line in rank0) == 8
    strip = lambda lines: [(x["seq"], x["evicted"], x["restored"], x["resident_sets"]) for x in lines]  # noqa: E731
    assert strip(rank1)[: len(rank0)] == strip(rank0)
