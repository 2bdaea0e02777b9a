"""A CPU dry run of the serving benchmark (bench/serving/run_one.py, report.py).

The H200 runs of issues 10 and 12 go through these two scripts, and device time
is short: a crash in the harness would waste a whole call. Here the same path
runs end to end on the tiny model in elastic mode: the launcher, SGLang's
bench_serving with ShareGPT-format traffic, the log and trace summaries, the
JSON, and the report's tables (plots need matplotlib, which CI may lack).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_rimuru.models import ensure_model

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
#: 153 expert pages of 45,056 B: 42 of 48 experts resident at start and 85 KV tokens,
#: so the traffic makes the adjuster evict (tests/server/test_real_geometry.py)
POOL_GB = 153 * 45_056 / (1 << 30) + 1e-9


def sharegpt_file(path: Path, n: int) -> Path:
    """``n`` two-turn conversations in ShareGPT's format (bench_serving keeps turn 1 and 2)."""
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + "tell me about the weather and the sea " * (1 + i % 3)},
        {"from": "gpt", "value": "It is calm and blue today, friend."},
    ]} for i in range(n)]
    path.write_text(json.dumps(convs))
    return path


def test_run_one_and_report_on_cpu(tmp_path, model_dir):
    model = str(ensure_model("tiny-qwen2-moe-q15-ratio", cache_dir=model_dir))
    data = sharegpt_file(tmp_path / "sharegpt.json", 12)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench/serving/run_one.py"), "--name", "elastic_cpu", "--model", model,
           "--card-gb", "0", "--device-flags", "", "--rate", "8", "--num-prompts", "12", "--dataset", str(data),
           "--context-len", "512", "--out", str(out), "--budget-s", "240", "--",
           "--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4", "--rimuru-pool-gb", f"{POOL_GB:.9f}",
           "--context-length", "512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "elastic_cpu.json").read_text())
    assert res["all_completed"], res["bench_log_tail"]
    assert res["bench"]["completed"] == 12 and res["bench"]["output_throughput"] > 0
    assert res["stopped_at_budget"] is False and res["tracebacks"] == 0
    assert res["log"]["peak_running"] >= 1 and res["log"]["kv_tokens"] is not None
    assert res["trace"]["evicted"] > 0 and res["trace"]["rounds"] >= 1  # the adjuster trace was kept
    assert res["peak_gpu_mib"] == 0  # no nvidia-smi here: nothing sampled, nothing made up
    assert res["peak_host_rss_mib"] > 100  # the server's processes (SGLang alone is hundreds of MiB)
    assert "elastic_cpu: completed 12/12" in proc.stdout

    rep = subprocess.run([sys.executable, str(ROOT / "bench/serving/report.py"), str(out / "elastic_cpu.json"),
                          "--baseline", "elastic_cpu"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    assert "| elastic_cpu | 0 GB | 12/12 |" in rep.stdout
    assert "| elastic_cpu | 1.00x | 1.00x | 1.00x | 1.00x |" in rep.stdout


def test_log_stats_weighs_decode_throughput_by_time():
    """A run stopped at its budget keeps SGLang's own decode rate: per log line, the
    tokens of its running requests over the rate (a slow interval counts for longer)."""
    sys.path.insert(0, str(ROOT / "bench" / "serving"))
    try:
        from run_one import log_stats
    finally:
        sys.path.pop(0)
    log = "\n".join([
        "[t] server_args=ServerArgs(decode_log_interval=40, ...)",
        "[t] Decode batch, #running-req: 10, #token: 100, token usage: 0.1, cuda graph: True, "
        "gen throughput (token/s): 1000.00, #queue-req: 0",
        "[t] Decode batch, #running-req: 40, #token: 400, token usage: 0.4, cuda graph: True, "
        "gen throughput (token/s): 100.00, #queue-req: 3",
        "[t] Decode batch, #running-req: 1, #token: 4, token usage: 0.0, cuda graph: True, "
        "gen throughput (token/s): 0.00, #queue-req: 0",  # an idle start: no rate
    ])
    s = log_stats(log)
    # 10 + 40 tokens a step over 10/1000 + 40/100 s a step
    assert s["gen_tok_s_mean"] == round(50 / (0.01 + 0.4), 1) and s["gen_tok_s_lines"] == 2
    assert s["peak_running"] == 40 and s["peak_queued"] == 3 and s["decode_steps_est"] == 120
    assert log_stats("")["gen_tok_s_mean"] is None


def test_report_shows_a_stopped_run_by_its_decode_log():
    """A run stopped at its budget has no bench_serving summary: its row gives SGLang's
    decode-log rate, marked so, and its ratios are '-' (not 0.00x, as if it served nothing)."""
    sys.path.insert(0, str(ROOT / "bench" / "serving"))
    try:
        from report import ratios, table
    finally:
        sys.path.pop(0)
    common = {"card_gib": 24.0, "num_prompts": 500, "peak_process_mib": 23516, "peak_host_rss_mib": 36436}
    done = {**common, "name": "off24", "stopped_at_budget": False, "log": {"peak_running": 20},
            "bench": {"completed": 500, "duration": 90.0, "output_throughput": 1000.0, "median_ttft_ms": 5000.0,
                      "p99_ttft_ms": 9000.0, "median_tpot_ms": 8.0, "p99_tpot_ms": 20.0}}
    stopped = {**common, "name": "static24", "stopped_at_budget": True, "bench": {},
               "log": {"peak_running": 26, "gen_tok_s_mean": 87.6}}
    t = table([done, stopped])
    assert "| static24 | 24 GB | 0/500 (stopped) | 0.0 | ~88 (decode log) |" in t
    assert "| off24 | 24 GB | 500/500 | 90.0 | 1000 |" in t
    r = ratios([done, stopped], "off24")
    assert "| static24 | - | - | 1.30x | - |" in r


def test_skew_is_independent_of_the_router_logits_scale():
    """The benchmark's skewed routing standardizes each token's logits before the bias:
    dummy weights give logits of ~1e-5, and an unstandardized bias of s = 2 sent every
    token of the Qwen1.5 shape to the same 4 experts (H200). The picks must not depend
    on the logits' scale, and must still vary with the token."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "rimuru_bench_skew", ROOT / "bench" / "serving" / "skew" / "sitecustomize.py")
    skew = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(skew)  # no RIMURU_BENCH_ROUTER_SKEW here: no hook installed
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 60, generator=g)
    bias = -1.0 * torch.log1p(torch.arange(60, dtype=torch.float64))
    picks = skew.skewed_logits(logits, bias).topk(4, dim=-1).indices
    tiny = skew.skewed_logits(logits * 1e-5, bias).topk(4, dim=-1).indices
    assert torch.equal(picks, tiny)
    p = torch.bincount(picks.flatten(), minlength=60).double() / len(logits)
    # s = 1 on independent N(0, 1) logits (the table in the module's docstring):
    # rank 0 ~0.85, rank 9 ~0.096, rank 59 ~0.0013
    assert 0.80 < p[0] < 0.90 and 0.07 < p[9] < 0.13 and p[59] < 0.01
    assert len(set(map(tuple, picks.tolist()))) > 100  # the picks still vary by token
    unskewed = skew.skewed_logits(logits * 1e-5, torch.zeros(60, dtype=torch.float64))
    assert torch.equal(unskewed.topk(4, dim=-1).indices, logits.topk(4, dim=-1).indices)
