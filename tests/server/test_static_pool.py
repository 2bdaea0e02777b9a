"""``--rimuru-mode static``: experts and KV cache in one pool, greedy outputs equal mode ``off``.

Half of each layer's experts are offloaded to host memory (4 of 8 resident,
offload limit 4), so every forward pass loads experts through the load
buffers (and, with one load-buffer slot, reads the overflow in place). The
same requests go to a plain (mode off) server first; the static server must
return the same token ids (the same text, for OpenAI and the DSL):
single requests, batches of 4 and 16, requests that hit the radix cache, an
OpenAI completion and a frontend DSL program (``gen``, ``select``, ``fork``).
"""

from __future__ import annotations

import re

import pytest

from sglang_rimuru.models import ensure_model
from tests.conftest import generate, openai_completion, run_dsl_program, start_server

pytestmark = pytest.mark.server

STATIC = ["--rimuru-mode", "static", "--rimuru-resident-experts", "4", "--rimuru-expert-offload-limit", "4",
          "--rimuru-zero-copy-max-tokens", "0"]  # every pass copies: the load-buffer path under test
SYSTEM = "You are a helpful assistant that answers briefly about paged experts. "

PROMPTS_16 = [f"prompt {i}: " + "tokens " * (i % 5 + 1) + chr(65 + i) for i in range(16)]


def workload(srv) -> dict:
    """Every request kind whose output ids must not depend on the mode."""
    out = {
        "single": generate(srv, "The unified page pool", max_new_tokens=16)["output_ids"],
        "batch4": [o["output_ids"] for o in generate(srv, PROMPTS_16[:4], max_new_tokens=12)],
        "batch16": [o["output_ids"] for o in generate(srv, PROMPTS_16, max_new_tokens=8)],
    }
    first = generate(srv, SYSTEM + "First question?", max_new_tokens=10)
    second = generate(srv, SYSTEM + "Second question?", max_new_tokens=10)
    out["radix"] = [first["output_ids"], second["output_ids"]]
    out["radix_cached"] = second["meta_info"]["cached_tokens"]
    out["openai"] = openai_completion(srv, "Once upon a time", max_tokens=8)["choices"][0]["text"]
    out["dsl"] = run_dsl_program(srv, ["paged experts"])
    return out


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_static_mode_matches_mode_off(tmp_path, model_dir, model):
    path = str(ensure_model(model, cache_dir=model_dir))
    base = ["--model-path", path, "--max-total-tokens", "8192"]

    off = start_server(base, tmp_path / "off.log")
    try:
        expected = workload(off)
    finally:
        off.stop()

    static = start_server(base + STATIC, tmp_path / "static.log", env={"SGLANG_RIMURU_PROBE_IN_PLACE": "1"})
    try:
        got = workload(static)
        log = static.log()
    finally:
        static.stop()

    assert got == expected
    assert got["radix_cached"] >= len(SYSTEM.encode()) - 1  # the shared prefix came from the pool's KV pages
    # the in-place read probe ran at start (SGLANG_RIMURU_PROBE_IN_PLACE): 2 layers, 4 experts out each
    probe = re.search(r"in-place read probe: 2 MoE layers x 100 tokens read (\d+) offloaded experts", log)
    assert probe and int(probe.group(1)) == 8, log[-3000:]
    summary = re.search(r"sglang-rimuru static pool: .* (\d+) resident experts \(4 of 8 per layer x 2 layers\), "
                        r"load buffers 2 x 4, KV now (\d+) tokens, at most \d+", log)
    assert summary, log[-3000:]
    assert int(summary.group(1)) == 8
    capacity = int(summary.group(2))
    assert capacity >= 8192
    # SGLang's "KV Cache is allocated ... #tokens" counts the KV id space; the next line says so
    note = re.search(r"KV Cache is allocated\. .*#tokens: (\d+),.*\n.*sglang-rimuru: the KV cache line above counts "
                     r"the unified pool's KV id space \((\d+) token slots over [\d.]+ GiB shared with expert "
                     r"weights\); KV can hold (\d+) tokens now, at most (\d+)\n", log)
    assert note, log[-3000:]
    assert note.group(1) == note.group(2) and int(note.group(2)) > capacity
    assert int(note.group(3)) == int(note.group(4)) == capacity  # static: what it has is all it gets
    # SGLang's scheduler sized itself to the pool's KV capacity (clamped by --max-total-tokens)
    assert f"max_total_num_tokens={min(capacity, 8192)}" in log

    if model == "tiny-qwen3-moe":
        # One load-buffer slot under an offload limit of 4, every pass on the copy path: a
        # layer's routed offloaded experts beyond the one slot are read in place from host
        # memory; the same outputs, and the log counts the overflow (the path was taken).
        one = start_server(base + STATIC + ["--rimuru-load-buffer-slots", "1"], tmp_path / "one_slot.log",
                           env={"SGLANG_RIMURU_STATS_EVERY": "4"})
        try:
            assert workload(one) == expected
            log = one.log()
        finally:
            one.stop()
        assert "Traceback" not in log
        assert "load buffers 2 x 1" in log
        overflow = [int(n) for n in re.findall(r"(\d+) routed experts read in place past full load buffers", log)]
        assert overflow and max(overflow) > 0


def test_radix_eviction_returns_pages_to_a_small_pool(tmp_path, model_dir):
    """More distinct prompts than the pool's KV pages: the radix cache must evict into the pool."""
    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    # 0.006 GiB: ~6k tokens of KV beside 8 resident experts and the load buffers
    srv = start_server(["--model-path", path, *STATIC, "--rimuru-pool-gb", "0.006", "--context-length", "1024"],
                       tmp_path / "static.log", env={"SGLANG_RIMURU_STATS_EVERY": "50"})
    try:
        capacity = int(re.search(r"KV now (\d+) tokens", srv.log()).group(1))
        prompts = [f"{i:03d} " + "distinct filler text " * 30 for i in range(3 * capacity // 600 + 2)]
        first = generate(srv, prompts[0], max_new_tokens=6)
        for p in prompts[1:]:
            generate(srv, p, max_new_tokens=6)
        again = generate(srv, prompts[0], max_new_tokens=6)
        assert again["output_ids"] == first["output_ids"]
        # prompt 0's prefix was evicted to make room (total prompt tokens > 3x capacity)
        assert again["meta_info"]["cached_tokens"] < len(prompts[0].encode()) - 1
        # experts really came through the load buffers (4 of 8 per layer are offloaded)
        traffic = re.findall(r"experts after (\d+) forwards: (\d+) prefetched, (\d+) prefetch hits .*?, "
                             r"(\d+) on-demand loads", srv.log())
        assert traffic, srv.log()[-2000:]
        forwards, prefetched, hits, misses = map(int, traffic[-1])
        assert forwards >= 50 and hits + misses > 0 and prefetched >= hits
    finally:
        srv.stop()


def test_ranking_command_output_is_served_by_static_mode(tmp_path, model_dir):
    """python -m sglang_rimuru.rank writes a ranking; a static server keeps its hottest experts resident.

    Two prompts too long for the tiny model's 4096-token context are skipped, counted, and the ranking finishes:
    one over the server's input limit is never sent, one under it is refused by the server (prompt + 8 new tokens
    over the context).
    """
    import json
    import subprocess
    import sys

    from sglang_rimuru.experts import load_ranking
    from sglang_rimuru.plan import ModelFacts

    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([*PROMPTS_16[:3], "long " * 1000, *PROMPTS_16[3:6], "y" * 4089]) + "\n")
    out = tmp_path / "ranking.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_rimuru.rank", "--model-path", path, "--out", str(out),
         "--prompts", str(prompts), "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = re.search(r"MoE layers, 6 of 8 prompts ranked \(\d+ tokens\), 2 skipped for length \(1 not sent: "
                        r">= (\d+) tokens, the server's input limit; 1 refused by the server: prompt \+ 8 new "
                        r"tokens over its context\)", proc.stderr)
    assert summary, proc.stderr[-3000:]
    assert 4089 < int(summary.group(1)) < 4096
    assert "Traceback" not in proc.stderr
    ranking = load_ranking(out, ModelFacts.from_model_path(path).moe_shape())
    data = json.loads(out.read_text())
    for layer in ("0", "1"):
        # top-2 routing: frequencies per token sum to 2 over the experts
        assert abs(sum(data["layers"][layer]["probability"]) - 2.0) < 1e-9

    srv = start_server(["--model-path", path, *STATIC, "--rimuru-expert-ranking", str(out)], tmp_path / "static.log")
    try:
        assert len(generate(srv, "ranked experts", max_new_tokens=4)["output_ids"]) == 4
        log = srv.log()
    finally:
        srv.stop()
    assert f"ranking: {out}" in log
    for layer in (0, 1):
        assert f"layer {layer} resident experts: {ranking.order(layer)[:4]}" in log


def test_static_mode_with_tensor_parallel_2(tmp_path, model_dir):
    """Mode off serves at TP=2 (deterministic, seams in both ranks and the detokenizer); each
    TP rank builds its own pool from its shard; static outputs equal mode off at TP=2."""
    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    base = ["--model-path", path, "--tp-size", "2", "--max-total-tokens", "4096"]
    prompts = PROMPTS_16[:3]
    off = start_server(base, tmp_path / "off.log")
    try:
        expected = [o["output_ids"] for o in generate(off, prompts, max_new_tokens=4)]
        assert [len(ids) for ids in expected] == [4, 4, 4]
        assert [o["output_ids"] for o in generate(off, prompts, max_new_tokens=4)] == expected  # deterministic
        # two schedulers (one per rank) and the detokenizer installed the seams
        assert off.log().count("seams installed") == 3
    finally:
        off.stop()
    static = start_server(base + STATIC, tmp_path / "static.log")
    try:
        got = [o["output_ids"] for o in generate(static, prompts, max_new_tokens=4)]
        log = static.log()
    finally:
        static.stop()
    assert got == expected
    assert_both_ranks_built_one_pool(log, "static")


def assert_both_ranks_built_one_pool(log: str, mode: str) -> None:
    """TP ranks 0 and 1 each logged their pool, and the two lines match: both ranks sized
    and filled their pools the same way."""
    pools = re.findall(rf"\[[^\]]* TP(\d)\] sglang-rimuru {mode} pool: (.*)", log)
    assert sorted(rank for rank, _ in pools) == ["0", "1"], pools
    assert pools[0][1] == pools[1][1], pools


def test_dummy_weights_serve_alike_in_static_mode(tmp_path, model_dir):
    """``--load-format dummy`` (what every H200 benchmark runs): the routed experts are
    made in host memory and drawn by the ``experts.dummy_weights`` seam; greedy ids
    equal mode off's, whose experts SGLang draws itself."""
    path = str(ensure_model("tiny-qwen2-moe", cache_dir=model_dir))
    base = ["--model-path", path, "--max-total-tokens", "4096", "--load-format", "dummy"]

    def run(args, name):
        srv = start_server(base + args, tmp_path / f"{name}.log")
        try:
            out = [generate(srv, "The unified page pool", max_new_tokens=12)["output_ids"],
                   [o["output_ids"] for o in generate(srv, PROMPTS_16[:4], max_new_tokens=8)]]
            return out, srv.log()
        finally:
            srv.stop()

    expected, _ = run([], "off")
    got, log = run(STATIC, "static")
    assert got == expected
    assert "Traceback" not in log


def light_workload(srv) -> dict:
    return {
        "single": generate(srv, "The unified page pool", max_new_tokens=16)["output_ids"],
        "batch16": [o["output_ids"] for o in generate(srv, PROMPTS_16, max_new_tokens=8)],
        "radix": [generate(srv, SYSTEM + q, max_new_tokens=8)["output_ids"] for q in ("First?", "Second?")],
    }


def test_static_with_every_expert_resident_runs_sglangs_own_moe_on_the_pool(tmp_path, model_dir):
    """Every expert resident: the layers sit in the pool in SGLang's layout and SGLang's own
    MoE reads them there (``RimuruRuntime.use_sglang_moe``); ``SGLANG_RIMURU_PAGED_ONLY=1``
    keeps the paged path. Both equal mode off."""
    path = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    base = ["--model-path", path, "--max-total-tokens", "4096"]
    every = ["--rimuru-mode", "static", "--rimuru-resident-experts", "8", "--rimuru-expert-offload-limit", "4"]
    off = start_server(base, tmp_path / "off.log")
    try:
        expected = light_workload(off)
    finally:
        off.stop()
    got, logs = {}, {}
    for name, env in (("sglang", {}), ("paged", {"SGLANG_RIMURU_PAGED_ONLY": "1"})):
        srv = start_server(base + every, tmp_path / f"{name}.log", env=env)
        try:
            got[name] = light_workload(srv)
            logs[name] = srv.log()
        finally:
            srv.stop()
    assert got["sglang"] == expected and got["paged"] == expected
    words = "2 of 2 layers keep every expert in SGLang's layout and run SGLang's own MoE on the pool's pages"
    assert words in logs["sglang"], logs["sglang"][-3000:]
    assert "SGLang's layout" not in logs["paged"]
    assert re.search(r"static pool: .* 16 resident experts \(8 of 8 per layer x 2 layers\)", logs["sglang"])
