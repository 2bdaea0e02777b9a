"""Pool modes at a real model's byte geometry: every KV id stays inside SGLang's bounds.

The tiny models here have the KV-token to expert-page byte ratio of
Qwen1.5-MoE-A2.7B (88/3: 29 or 28 KV slots per expert page, holes between)
and of Qwen3-30B-A3B (32). At 0dafc5d the pool handed SGLang KV ids equal to
byte offset / token bytes, far past SGLang's KV pool ``size``; on the GPU the
JIT KV store asserted ``index < size + page_size`` and the server died at the
first long prefill. On CPU nothing in SGLang looked, so every test passed.
Now every server here runs with SGLang's own bounds check on each KV write
(``SGLANG_ENABLE_ASYNC_ASSERT=1``: ``set_kv_buffer`` asserts
``0 <= loc < size + page_size``) and the pool's invariants after every
completed order (``SGLANG_RIMURU_CHECK_INVARIANTS=1``); either failing kills
the scheduler, and the requests below would fail.

Static: half of each layer's experts offloaded. Elastic: no residency flag and
a pool too small for every expert, so the server starts with the experts that
fit (the rest spread over layers), a burst evicts more, and the quiet period
brings them back. Greedy ids must equal mode off throughout (up to a bf16
near-tie another batch tipped: ``tests.conftest.TIE_LOGPROB_GAP``). At
``--tp-size 2`` (issue 14) a rank holds shards: tiny-qwen3-moe-q3-ratio-tp2 has
Qwen3-30B-A3B's per-rank ratio there, and both ranks must write the same orders.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import pytest

from sglang_rimuru.models import ensure_model
from tests.conftest import (assert_all_greedy_equal_up_to_ties, assert_greedy_equal_up_to_ties,
                            greedy_ids_or_reference, start_server)
from tests.server.test_elastic import orders, read_trace
from tests.server.test_static_pool import assert_both_ranks_built_one_pool

pytestmark = pytest.mark.server

CHECKED = {"SGLANG_ENABLE_ASYNC_ASSERT": "1", "SGLANG_RIMURU_CHECK_INVARIANTS": "1"}
BASE = ["--context-length", "512"]
STATIC = ["--rimuru-mode", "static", "--rimuru-resident-experts", "4", "--rimuru-expert-offload-limit", "4",
          "--max-total-tokens", "2048"]
LONG = "a long prompt that fills many KV pages " * 9  # ~350 tokens: more than 10 expert pages of KV
BURST = [f"request {i}: " + "word " * 30 for i in range(12)]

#: model -> (elastic pool in GiB, experts resident at start): fewer than all fit, so the
#: server starts with some experts in host memory (one per layer first: ties spread).
#: q15: 45,056 B expert pages; 153 = 1 dummy + 24 load-buffer + 126 for 42 of 48 experts + 2 free
#: q3:  16,384 B expert pages;  66 = 1 dummy + 24 load-buffer +  39 for 13 of 16 experts + 2 free
ELASTIC_POOL = {
    "tiny-qwen2-moe-q15-ratio": (153 * 45_056 / (1 << 30), 42),
    "tiny-qwen3-moe-q3-ratio": (66 * 16_384 / (1 << 30), 13),
}


def elastic_flags(pool_gb: float, trace) -> list[str]:
    """Elastic in a pool of ``pool_gb`` (one rank's; ELASTIC_POOL), offload limit 4, with a trace."""
    return ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4",
            "--rimuru-load-buffer-slots", "4",  # the page arithmetic above (the default would size them to 0)
            "--rimuru-pool-gb", f"{pool_gb + 1e-9:.9f}", "--rimuru-adjuster-trace", str(trace)]


def assert_spread(lines: list[dict]) -> None:
    """Evictions spread over layers (none has two more out than another), within the offload limit."""
    for line in lines:
        out = [8 - len(experts) for experts in line["resident_sets"].values()]
        assert max(out) - min(out) <= 1, line
        assert max(out) <= 4, line  # the offload limit


def workload(srv, reference: bool = False) -> dict:
    """The burst, then the long prompt; as a reference (mode off) each answer keeps its
    steps' best two tokens, for ``matches``."""
    with cf.ThreadPoolExecutor(len(BURST)) as ex:
        burst = list(ex.map(lambda p: greedy_ids_or_reference(srv, p, 16, reference), BURST))
    return {"long": greedy_ids_or_reference(srv, LONG, 8, reference), "burst": burst}


def matches(got: dict, reference: dict) -> None:
    """Greedy ids equal mode off's, but for a bf16 near-tie that another batch tipped
    (a pool mode's KV budget admits the burst in other batches)."""
    assert_greedy_equal_up_to_ties(got["long"], reference["long"])
    assert_all_greedy_equal_up_to_ties(got["burst"], reference["burst"])


@pytest.mark.parametrize("model", list(ELASTIC_POOL))
def test_pool_modes_at_real_geometry_keep_kv_ids_in_bounds(tmp_path, model_dir, model):
    path = str(ensure_model(model, cache_dir=model_dir))
    off = start_server(["--model-path", path, *BASE, "--max-total-tokens", "4096"], tmp_path / "off.log")
    try:
        expected = workload(off, reference=True)
    finally:
        off.stop()

    static = start_server(["--model-path", path, *BASE, *STATIC], tmp_path / "static.log", env=CHECKED)
    try:
        matches(workload(static), expected)
        assert "Traceback" not in static.log()
    finally:
        static.stop()

    pool_gb, at_start = ELASTIC_POOL[model]
    trace = tmp_path / "trace.jsonl"
    elastic = start_server(["--model-path", path, *BASE, *elastic_flags(pool_gb, trace)], tmp_path / "elastic.log",
                           env=CHECKED)
    try:
        log = elastic.log()
        started = re.search(r"sglang-rimuru elastic pool: .*?; (\d+) resident experts \(([\d-]+) of 8 per layer", log)
        assert started and int(started.group(1)) == at_start, log[-3000:]
        assert "in host memory, at most 4 a layer out of the pool (--rimuru-expert-offload-limit)" in log
        matches(workload(elastic), expected)
        lines = read_trace(trace)
        assert any(line["evicted"] for line in lines), lines[-3:]
        assert_spread(lines)
        matches(workload(elastic), expected)  # still serving after the split moved
        assert "Traceback" not in elastic.log()
    finally:
        elastic.stop()


def test_pool_modes_at_tp2_real_geometry_keep_kv_ids_in_bounds_and_the_ranks_agree(tmp_path, model_dir):
    """Issue 14's shape on CPU: Qwen3-30B-A3B's per-rank ratio at ``--tp-size 2`` (each
    rank's pool holds its shards: 16,384 B pages over 512 B of KV a token, as 1.5 MiB over
    48 KiB), SGLang's KV bounds checked on every write and the pool's invariants after every
    order, on both ranks. Static and elastic greedy ids equal mode off's at TP=2; elastic's
    two ranks write the same orders, resident sets and all."""
    path = str(ensure_model("tiny-qwen3-moe-q3-ratio-tp2", cache_dir=model_dir))
    base = ["--model-path", path, *BASE, "--tp-size", "2"]
    off = start_server([*base, "--max-total-tokens", "4096"], tmp_path / "off.log")
    try:
        expected = workload(off, reference=True)
    finally:
        off.stop()

    static = start_server([*base, *STATIC], tmp_path / "static.log", env=CHECKED)
    try:
        matches(workload(static), expected)
        log = static.log()
        assert "Traceback" not in log
    finally:
        static.stop()
    assert_both_ranks_built_one_pool(log, "static")

    # one rank's pool: the page arithmetic of ELASTIC_POOL's q3 entry (same page bytes a rank)
    pool_gb, at_start = ELASTIC_POOL["tiny-qwen3-moe-q3-ratio"]
    trace = tmp_path / "trace.jsonl"
    elastic = start_server([*base, *elastic_flags(pool_gb, trace)], tmp_path / "elastic.log", env=CHECKED)
    try:
        started = re.findall(r"TP(\d)\] sglang-rimuru elastic pool: [\d.]+ GiB in 66 expert pages of 16384 B; "
                             r"(\d+) resident experts", elastic.log())
        assert sorted(started) == [("0", str(at_start)), ("1", str(at_start))], elastic.log()[-3000:]
        matches(workload(elastic), expected)
        matches(workload(elastic), expected)  # still serving after the split moved
        rank0, rank1 = quiet_traces(trace, tmp_path / "trace.jsonl.tp1")
        assert "Traceback" not in elastic.log()
    finally:
        elastic.stop()
    assert any(line["evicted"] for line in rank0) and any(line["restored"] for line in rank0), rank0[-3:]
    assert orders(rank1) == orders(rank0)
    assert_spread(rank0)  # and so on rank 1, whose resident sets are the same


def quiet_traces(*paths, quiet_s: float = 3.0, timeout: float = 60.0) -> list[list[dict]]:
    """Each rank's trace once none has grown for ``quiet_s`` (the pool has settled: the
    idle server's split moves no more)."""
    deadline = time.time() + timeout
    last, since = None, time.time()
    while True:
        traces = [read_trace(p) for p in paths]
        sizes = [len(t) for t in traces]
        if sizes != last:
            last, since = sizes, time.time()
        elif time.time() - since >= quiet_s:
            return traces
        if time.time() > deadline:
            raise AssertionError(f"the traces kept growing for {timeout}s: {sizes} lines")
        time.sleep(0.5)
