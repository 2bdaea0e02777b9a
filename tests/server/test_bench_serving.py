"""A CPU dry run of the serving benchmark (bench/serving/run_one.py, report.py).

The H200 runs of issues 10 and 12 go through these two scripts, and device time
is short: a crash in the harness would waste a whole call. Here the same path
runs end to end on the tiny model in elastic mode: the launcher, SGLang's
bench_serving with ShareGPT-format traffic, the log and trace summaries, the
JSON, and the report's tables and plots (matplotlib comes with the test extra).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_rimuru.adjuster.cost import touched
from sglang_rimuru.models import ensure_model
from tests.conftest import zipf_layer

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
#: 153 expert pages of 45,056 B: 42 of 48 experts resident at start and 85 KV tokens,
#: so the traffic makes the adjuster evict (tests/server/test_real_geometry.py)
POOL_GB = 153 * 45_056 / (1 << 30) + 1e-9


def _serving_module(name: str):
    """A script of bench/serving (not a package), imported by its module name."""
    sys.path.insert(0, str(ROOT / "bench" / "serving"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


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
           "--context-len", "512", "--out", str(out), "--budget-s", "240", "--router-noise", "1", "--",
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
    # the server code it ran (the device has no .git: the digest names it), and the model
    assert res["code_digest"] == _serving_module("code_digest").tree_digest(ROOT)  # no GPU: every table
    assert res["model"] == Path(model).name
    # independent routings (--router-noise 1): the hook is in every server process, graphs or not
    assert res["router_noise"] == 1.0 and res["router_skew"] == 0.0
    assert "[bench] router skew 0.0, noise 1.0 installed" in (out / "elastic_cpu.log").read_text()
    # SGLang's bench_serving still prints the line its traffic's start is read from, and the
    # pass record counts from there, not from bench_serving's launch. The step record is
    # written every 256 rounds or 20 s (patches/rimuru_patches/elastic.py), so these 12
    # requests may end before any write after their start: then there is no pass record
    assert 0 < res["traffic_began_s"] < res["traffic_s"]
    pt = res["pass_tokens"]
    assert pt is None or pt["seconds"] <= res["traffic_s"] - res["traffic_began_s"] + 1

    rep = subprocess.run([sys.executable, str(ROOT / "bench/serving/report.py"), str(out / "elastic_cpu.json"),
                          "--baseline", "elastic_cpu"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    assert "| elastic_cpu | 0 GB | 12/12 |" in rep.stdout
    assert "| elastic_cpu | 1.00x | 1.00x | 1.00x | 1.00x |" in rep.stdout


def _decode_line(t: float, running: int, rate: float) -> str:
    """One of SGLang's decode log lines, stamped as it stamps them (local time, whole seconds)."""
    return (f"[{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))}] Decode batch, #running-req: {running}, "
            f"#token: {running * 10}, token usage: 0.1, cuda graph: True, gen throughput (token/s): {rate:.2f}, "
            "#queue-req: 3")


def test_log_stats_weighs_decode_throughput_by_time():
    """A run stopped at its budget keeps SGLang's own decode rate: per log line, the
    tokens of its running requests over the rate (a slow interval counts for longer),
    without the first line, which SGLang times from the scheduler's start."""
    log_stats = _serving_module("decode_log").log_stats
    t = 1_800_000_000.0
    log = "\n".join([
        "[t] server_args=ServerArgs(decode_log_interval=40, ...)",
        _decode_line(t, 1, 1.0),  # timed from the scheduler's start: dropped
        _decode_line(t + 10, 10, 1000.0),
        _decode_line(t + 20, 40, 100.0),
        _decode_line(t + 30, 1, 0.0),  # an idle start: no rate
        "[2026-12-05 16:24:11 TP0] Decode batch, #running-req: 40, #token: 1, token usage: 0.0, cuda graph: True, "
        "gen throughput (token/s): 100.00, #queue-req: 0",  # a rank's line (--tp-size 2) counts too
    ])
    s = log_stats(log)
    # 10 + 40 + 40 tokens a step over 10/1000 + 40/100 + 40/100 s a step
    assert s["gen_tok_s_mean"] == round(90 / (0.01 + 0.8), 1) and s["gen_tok_s_lines"] == 3
    assert s["peak_running"] == 40 and s["peak_queued"] == 3 and s["decode_steps_est"] == 200
    assert "lone_step_ms" not in s
    assert log_stats("")["gen_tok_s_mean"] is None


def test_the_decode_rate_is_the_traffics_and_the_warmup_gives_the_lone_step(tmp_path):
    """At --decode-log-interval 10 bench_serving's warm-up request fills several decode lines
    at one running request before the traffic begins (SGLang's --cpu-offload-gb 50 for Qwen3:
    three at 1.01 tok/s stood as the rate of a run whose traffic window held only prefill).
    Given when the traffic began, only lines from its second on count; the warm-up's lines
    (the log's first apart) give the lone decode step. decode_log.py re-derives a stored run's
    figures from its log, keeping those it was written with."""
    decode_log = _serving_module("decode_log")
    t = 1_800_000_000.0
    log = "\n".join(["decode_log_interval=10", _decode_line(t, 1, 0.3), _decode_line(t + 4, 1, 2.5),
                     _decode_line(t + 8, 1, 2.5), _decode_line(t + 12, 1, 2.0),
                     _decode_line(t + 30, 100, 250.0), _decode_line(t + 34, 50, 125.0)])
    s = decode_log.log_stats(log, since=t + 20.6)
    assert s["gen_tok_s_mean"] == round(150 / (0.4 + 0.4), 1) and s["gen_tok_s_lines"] == 2
    assert s["lone_step_ms"] == 400.0  # median of 400, 400, 500 ms
    assert decode_log.log_stats(log)["gen_tok_s_lines"] == 5  # without it: every line after the first
    # the traffic's window held no decode: no rate, the lone step still measured
    empty = decode_log.log_stats("\n".join(log.splitlines()[:5]), since=t + 20.6)
    assert empty["gen_tok_s_mean"] is None and empty["lone_step_ms"] == 400.0
    run = tmp_path / "offload24_20.json"
    run.write_text(json.dumps({"name": "offload24_20", "log": decode_log.log_stats(log)}))
    (tmp_path / "offload24_20.log").write_text(log)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t + 21))
    out = subprocess.run([sys.executable, str(ROOT / "bench/serving/decode_log.py"), str(run),
                          str(tmp_path / "offload24_20.log"), "--since", since],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(run.read_text())
    assert got["log"] == s and got["log_since"] == since
    assert got["log_as_run"]["gen_tok_s_lines"] == 5


def test_report_shows_a_stopped_run_by_its_decode_log():
    """A run stopped at its budget has no bench_serving summary: its row gives SGLang's
    decode-log rate, marked so, and its throughput ratio sets decode-log rates side by side
    ('-' without them; never 0.00x, as if it served nothing)."""
    report = _serving_module("report")
    ratios, table = report.ratios, report.table
    common = {"card_gib": 24.0, "num_prompts": 500, "peak_process_mib": 23516, "peak_host_rss_mib": 36436}
    done = {**common, "name": "off24", "stopped_at_budget": False, "log": {"peak_running": 20},
            "bench": {"completed": 500, "duration": 90.0, "output_throughput": 1000.0, "median_ttft_ms": 5000.0,
                      "p99_ttft_ms": 9000.0, "median_tpot_ms": 8.0, "p99_tpot_ms": 20.0}}
    stopped = {**common, "name": "static24", "stopped_at_budget": True, "bench": {},
               "log": {"peak_running": 26, "gen_tok_s_mean": 87.6}}
    t = table([done, stopped])
    assert "| static24 | 24 GB | 0/500 (stopped) | 0.0 | ~88 (decode log) |" in t
    # ended by the device call's timeout before its budget (run_one.py's SIGTERM path)
    assert "| static24 | 24 GB | 0/500 (cut) | 0.0 | ~88 (decode log) |" in table([{**stopped, "cut": True}])
    assert "| off24 | 24 GB | 500/500 | 90.0 | 1000 |" in t
    # the card check in the row: a peak past the card (the process's, or the whole GPU's) says so
    over = {**stopped, "name": "elastic24", "peak_gpu_mib": 24600, "card_cap": True}
    assert "| 26 | 23.0 / 24 **over the card** (capped) | 35.6 |" in table([over])
    assert "| 26 | 23.0 / 24 | 35.6 |" in table([stopped])
    r = ratios([done, stopped], "off24")
    assert "| static24 | - | - | 1.30x | - |" in r  # the completed run's log gave no rate
    # against a stopped baseline, both sides by their decode logs
    done["log"]["gen_tok_s_mean"] = 876.0
    r = ratios([done, stopped], "static24")
    assert "| off24 | ~10.00x (decode log) | - | 0.77x | - |" in r
    assert "| static24 | ~1.00x (decode log) | - | 1.00x | - |" in r


def test_the_floor_replays_bench_servings_own_arrivals(monkeypatch):
    """makespan.py's arrivals are the intervals SGLang's bench_serving sleeps between
    requests after seeding numpy, so the floor is of the traffic the H200 runs sent."""
    import asyncio

    import numpy as np
    from sglang.benchmark import serving

    slept = []

    async def record(dt):
        slept.append(dt)

    monkeypatch.setattr(serving.asyncio, "sleep", record)

    async def drain():
        return [r async for r in serving.get_request(list(range(40)), 10.0)]

    np.random.seed(3)  # bench_serving's main: np.random.seed(args.seed), no draw before the loop
    assert asyncio.run(drain()) == list(range(40))
    ours = _serving_module("makespan").arrivals(41, 10.0, 3)
    assert np.allclose(np.diff(ours), slept, rtol=0, atol=1e-12)


def test_the_floor_is_set_by_the_latest_finishing_request():
    """A request arriving at a asking for o tokens ends no sooner than a + (o - 1) * step;
    the floor is the latest such end, the ceiling total output over it; a run of another
    sample (its total output differs from the lens file's) has none."""
    ms = _serving_module("makespan")
    arr = ms.arrivals(3, 2.0, 1)
    f = ms.floor([100, 1001, 5], 2.0, 1, step_ms=10.0)
    ends = [arr[0] + 0.99, arr[1] + 10.0, arr[2] + 0.04]
    assert f.makespan_s == pytest.approx(max(ends)) and f.binding == ends.index(max(ends))
    assert f.total_output == 1106 and f.ceiling_tok_s == pytest.approx(1106 / max(ends))
    assert f.last_arrival_s == arr[2] and arr[0] == 0.0
    with pytest.raises(ValueError, match="step_ms"):
        ms.floor([1], 1.0, 1, step_ms=0)


def test_report_compares_each_rate_with_the_baseline_at_that_rate(tmp_path):
    """Below saturation throughput is the traffic's: NAME_rRATE is compared with the
    baseline's run at RATE, and the floor table marks a run whose traffic is not the
    lens file's sample."""
    report = _serving_module("report")
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps([[5, 100], [5, 1001], [5, 5]]))

    def run(name, rate, tput, total=1106):
        return {"name": name, "rate": rate, "num_prompts": 3, "log": {"peak_running": 10},
                "bench": {"output_throughput": tput, "median_ttft_ms": 10.0, "median_tpot_ms": 5.0,
                          "duration": total / tput, "total_output_tokens": total}}

    rs = [run("off", 10.0, 100.0), run("off_r1", 1.0, 50.0), run("el", 10.0, 130.0), run("el_r1", 1.0, 50.0),
          run("el_r5", 5.0, 80.0)]
    r = report.ratios(rs, "off")
    assert "| el | 1.30x |" in r and "| el_r1 | 1.00x |" in r and "| el_r5 | no off_r5 |" in r
    fl = report.floors([*rs[:1], run("other", 10.0, 100.0, total=7)], 10.0, lens)
    ceiling = _serving_module("makespan").floor([100, 1001, 5], 10.0, 1, 10.0).ceiling_tok_s
    assert f"| 100 | {ceiling:.0f} | {100 / ceiling:.0%} |" in fl
    assert "| other | 0.1 | - (not the lens file's sample) |" in fl
    stopped = {**run("static", 10.0, 1.0), "bench": {}}  # stopped at its budget: no summary
    assert "| static | - | - (no bench_serving summary) |" in report.floors([stopped], 10.0, lens)


def test_the_phase_table_sets_each_phase_beside_its_own_floor(tmp_path):
    """A phased run has no one rate, but each phase has: its floor replays that phase's
    arrivals at the run's seed with its own requests' output lengths (bench_serving's
    details beside the JSON, plain or gzipped), and the sum of the phases' floors bounds
    what any server could serve of the whole run. A phase without details gets none."""
    import gzip

    report, ms = _serving_module("report"), _serving_module("makespan")
    phases = [{"rate": 1.0, "num_prompts": 3, "completed": 3, "duration": 5.0},
              {"rate": 20.0, "num_prompts": 2, "completed": 2, "duration": 4.0}]
    run = {"name": "el_ph", "seed": 2, "phases": phases, "bench": {"duration": 9.0}}
    (tmp_path / "el_ph.json").write_text(json.dumps(run))
    (tmp_path / "el_ph_bench_phase1.jsonl").write_text(json.dumps({"output_lens": [10, 400, 30]}) + "\n")
    with gzip.open(tmp_path / "el_ph_bench_phase2.jsonl.gz", "wt") as f:
        f.write(json.dumps({"output_lens": [200, 1000]}) + "\n")
    [loaded] = report.load([str(tmp_path / "el_ph.json")])
    f1, f2 = ms.floor([10, 400, 30], 1.0, 2, 5.0), ms.floor([200, 1000], 20.0, 2, 5.0)
    table = report.phase_table([loaded], 5.0)
    assert f"| el_ph | 1 | 1 | 3/3 | 5.0 | 0 | 0.00 / 0.00 | 0.00 / 0.00 | {f1.makespan_s:.1f} | " \
           f"{5.0 / f1.makespan_s:.2f}x |" in table
    assert f"| {f2.makespan_s:.1f} | {4.0 / f2.makespan_s:.2f}x |" in table
    assert f"more than {9.0 / (f1.makespan_s + f2.makespan_s):.2f}x its output throughput" in table
    (tmp_path / "el_ph_bench_phase1.jsonl").unlink()
    table = report.phase_table([loaded], 5.0)
    assert "| 0.00 / 0.00 | - | - |" in table and "no server serves" not in table


def _run(name, card, tput=None, *, rate=10.0, skew=0.0, num=500, ttft=100.0, tpot=5.0, running=10, queued=50,
         log_rate=None, pass_rate=None, peak=1000, digest=None, phases=None, server_args=(), kv=None):
    """A run_one.py result as targets.py reads it: finished (tput) or stopped at its budget."""
    r = {"name": name, "card_gib": card, "rate": None if phases else rate, "router_skew": skew,
         "num_prompts": num, "seed": 1, "peak_process_mib": peak, "peak_gpu_mib": peak,
         "server_args": list(server_args),
         "log": {"peak_running": running, "peak_queued": queued, "gen_tok_s_mean": log_rate, "kv_tokens": kv},
         "bench": {} if tput is None else {"output_throughput": tput, "median_ttft_ms": ttft,
                                           "median_tpot_ms": tpot, "duration": 100.0,
                                           "total_output_tokens": int(tput * 100)}}
    if pass_rate:
        r["pass_tokens"] = {"tok_s": pass_rate}
    if digest:
        r["code_digest"] = digest
    if phases:
        r["phases"] = phases
    return r


def _rows(table: str, target: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith(f"| {target} |")]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def test_all_at_once_runs_pair_with_their_own_traffic(tmp_path):
    """RATE=inf (h200.sh's NAME_rinf: every request sent at once) is a traffic of its own: its
    runs pair with each other, never with a finite rate's, the table says "all at once", and
    the rate plot puts it one step past the largest finite rate under that label."""
    targets, report = _serving_module("targets"), _serving_module("report")
    inf = float("inf")
    rs = [_run("off32-skew_rinf", 32, 1200.0, rate=inf, skew=1, ttft=30_000, running=33, queued=460),
          _run("static32-skew_rinf", 32, 1700.0, rate=inf, skew=1),
          _run("elastic32-skew_rinf", 32, 2300.0, rate=inf, skew=1, ttft=9_000, running=80),
          _run("off32-skew_r20", 32, 1000.0, rate=20, skew=1, ttft=10_000, running=30, queued=200),
          _run("elastic32-skew_r20", 32, 1450.0, rate=20, skew=1, ttft=800, running=74)]
    assert report.baseline_for(rs[2], "off32-skew") == "off32-skew_rinf"
    table = targets.targets_table(rs, 3.75, tmp_path / "missing.json")
    tput = _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    assert [_cells(r)[1:5] for r in tput] == [
        ["32 GB, Qwen1.5-MoE, skewed, 20 req/s x 500", "elastic32-skew_r20 / off32-skew_r20", "1.45x", "**met**"],
        ["32 GB, Qwen1.5-MoE, skewed, all at once x 500", "elastic32-skew_rinf / off32-skew_rinf", "1.92x",
         "**met**"]]
    [static] = _rows(table, "elastic >= 1.3x the best static budget")
    assert "elastic32-skew_rinf / static32-skew_rinf (best of 2, plain as every expert resident) | 1.35x" in static
    # the rate plot: one line a system over its finished runs; the stopped uniform run is no point
    stopped = _run("elastic32_rinf", 32, rate=inf, pass_rate=1300.0)
    series = report.rate_series([*rs, stopped, _run("elastic32", 32, 1010.0)])
    assert {s: [r["name"] for r in runs] for s, runs in series.items()} == {
        "off32-skew": ["off32-skew_rinf", "off32-skew_r20"], "elastic32-skew": ["elastic32-skew_rinf", "elastic32-skew_r20"]}
    assert report.rate_positions([1.0, 20.0, inf]) == ([1.0, 20.0, 40.0], [1.0, 20.0, 40.0], ["1", "20", "all at once"])
    assert report.rate_positions([1.0, 20.0]) == ([1.0, 20.0], [1.0, 20.0], ["1", "20"])


def test_targets_pair_runs_by_traffic_and_take_the_best_baseline(tmp_path):
    """Issue 12's targets: each elastic run against plain SGLang on the same traffic (the
    same routing, rate, requests), against the best of several static budgets, with the
    issue's thresholds (1.3x plain skewed, 1.15x uniform); a target without a pair says so."""
    targets = _serving_module("targets")
    lens = tmp_path / "missing.json"  # no lens file: no traffic ceilings
    rs = [_run("off32-skew_r20", 32, 1000.0, rate=20, skew=1, ttft=10_000, running=30, queued=200),
          _run("elastic32-skew_r20", 32, 1450.0, rate=20, skew=1, ttft=800, running=74),
          _run("off32", 32, 1000.0, running=30, queued=60),  # uniform: another traffic
          _run("elastic32", 32, 1010.0, running=31),
          _run("static24-skew", 24, 600.0, skew=1), _run("static24r39-skew", 24, 640.0, skew=1),
          _run("elastic24d-skew", 24, 700.0, skew=1)]
    table = targets.targets_table(rs, 3.75, lens)
    tput = _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    assert [_cells(r)[2:5] for r in tput] == [
        ["elastic32 / off32", "1.01x", "not met"], ["elastic32-skew_r20 / off32-skew_r20", "1.45x", "**met**"]]
    assert _rows(table, "32 GB Qwen1.5: TTFT median <= 0.6x plain")[1].endswith("| 0.08x | **met** |")
    assert _rows(table, "32 GB Qwen1.5: peak running >= 2x plain")[1].endswith("| 2.47x | **met** |")
    [static] = _rows(table, "elastic >= 1.3x the best static budget")
    assert "elastic24d-skew / static24r39-skew (best of 2) | 1.09x | not met |" in static
    # plain SGLang is the budget with every expert resident: a static run that offloads
    # does not make elastic's tie with plain a win over "the best static budget"
    table = targets.targets_table([*rs, _run("static32r58", 32, 690.0)], 3.75, lens)
    assert "| elastic32 / off32 (best of 2, plain as every expert resident) | 1.01x | not met |" in table
    assert _rows(table, "1 req/s: TPOT within 5 % of plain") == [
        "| 1 req/s: TPOT within 5 % of plain | - | - | no pair among these runs | not measured |"]
    assert "- peak GPU memory within the card: every run" in table


def test_targets_say_where_the_traffic_not_the_server_bounds_a_ratio(tmp_path):
    """Below saturation the arrivals set the duration: a throughput target under what the
    traffic allows (makespan.py's ceiling over plain) is light load, as are TTFT and running
    where plain never queued more requests than it ran; at 1 req/s TPOT is the target."""
    targets, ms = _serving_module("targets"), _serving_module("makespan")
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps([[5, 100], [5, 1001], [5, 5]]))
    total = 1106
    ceiling = ms.floor([100, 1001, 5], 10.0, 1, 3.75).ceiling_tok_s
    plain = _run("off32", 32, ceiling / 1.1, num=3, queued=40, running=10)
    plain["bench"]["total_output_tokens"] = total
    elastic = _run("elastic32", 32, ceiling, num=3, running=12)
    light_plain = _run("off32_r1", 32, 300.0, rate=1, num=60, tpot=4.43, queued=0, running=7)
    light_el = _run("elastic32_r1", 32, 300.0, rate=1, num=60, tpot=4.20, running=7)
    table = targets.targets_table([plain, elastic, light_plain, light_el], 3.75, lens)
    tput = {_cells(r)[2]: _cells(r)[3:5] for r in
            _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")}
    assert tput == {"elastic32 / off32": ["1.10x", "light load: the traffic allows at most 1.10x"],
                    "elastic32_r1 / off32_r1": ["1.00x", "light load: plain's queue peaked at 0, its running at 7"]}
    running = {_cells(r)[2]: _cells(r)[3:5] for r in _rows(table, "32 GB Qwen1.5: peak running >= 2x plain")}
    assert running["elastic32 / off32"] == ["1.20x", "not met"]  # plain queued 40 with 10 running
    assert _rows(table, "1 req/s: TPOT within 5 % of plain")[0].endswith("| TPOT 0.95x | **met** |")


def test_targets_compare_stopped_runs_by_named_sources_and_flag_a_borrowed_anchor(tmp_path):
    """A run stopped at its budget has no bench_serving figures: a pool-mode run's pass
    record (it counts the decodes mixed prefill passes carry), else SGLang's decode log,
    each named, against the other side's bench_serving figure where that side finished.
    SGLang's offload streams whole layers whatever the routing, so a skewed elastic run
    without its own anchor is set against the anchor of another traffic, flagged; a phased
    run never is. Over-card runs and code digests are listed."""
    targets = _serving_module("targets")
    rs = [_run("q3offload32_34_less2560_cap", 32, log_rate=62.0, digest="aaaaaaaaaaaa", running=56, kv=32_819,
               server_args=["--cpu-offload-gb", "34", "--mem-fraction-static", "0.18413"]),
          _run("q3elastic32d_cap", 32, log_rate=118.0, pass_rate=218.7, digest="aaaaaaaaaaaa"),
          _run("q3elastic32-skew", 32, log_rate=295.0, skew=1, num=150, peak=33_000),
          _run("elastic24d-skew_ph", 24, 637.0, skew=1, phases=[{"rate": 1.0, "num_prompts": 45}]),
          _run("offload24-skew", 24, log_rate=91.0, skew=1, num=150, running=24, kv=13_077,
               server_args=["--cpu-offload-gb", "8"]),
          # finished: its bench_serving figure, not a pass record whose window opened at
          # bench_serving's launch (~25 s before its first request)
          _run("elastic24d-skew", 24, 1222.0, skew=1, num=150, pass_rate=650.0)]
    rs[0]["model"] = "q3"
    table = targets.targets_table(rs, 3.75, tmp_path / "missing.json")
    q3 = {_cells(r)[2]: _cells(r)[3:5]
          for r in _rows(table, "32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb")}
    sweep = _serving_module("offload_sweep").sweep
    best_q3, best_24 = sweep(rs[0])["best"], sweep(rs[4])["best"]
    # one --cpu-offload-gb setting is not the best one: the verdict is against the estimate of it
    assert q3 == {
        "q3elastic32-skew / q3offload32_34_less2560_cap (anchor on 32 GB, Qwen3-30B-A3B, uniform, 10 req/s x 500)":
            ["~4.76x (decode log / decode log)",
             f"met against the one setting measured (34 GiB); against offload_sweep.py's estimate of the best "
             f"({best_q3['gb']:g} GiB, {best_q3['tok_s']:.0f} tok/s): ~{295 / best_q3['tok_s']:.2f}x, **not met** "
             f"(estimated, not measured)"],
        "q3elastic32d_cap / q3offload32_34_less2560_cap": [
            "~3.53x (pass record / decode log)",
            f"met against the one setting measured (34 GiB); against offload_sweep.py's estimate of the best "
            f"({best_q3['gb']:g} GiB, {best_q3['tok_s']:.0f} tok/s): ~{218.7 / best_q3['tok_s']:.2f}x, **not met** "
            f"(estimated, not measured)"]}
    assert best_q3["gb"] == 54 and 218.7 / best_q3["tok_s"] < 2
    assert [_cells(r)[2:5] for r in _rows(table, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb")] == [
        ["elastic24d-skew / offload24-skew", "~13.43x (bench_serving / decode log)",
         f"met against the one setting measured (8 GiB); against offload_sweep.py's estimate of the best "
         f"({best_24['gb']:g} GiB, {best_24['tok_s']:.0f} tok/s): ~{1222 / best_24['tok_s']:.2f}x, "
         f"{'met' if 1222 / best_24['tok_s'] >= 5 else '**not met**'} (estimated, not measured)"]]
    # a second setting measured: the best measured one is the baseline, no estimate
    rs.append(_run("offload24_20-skew", 24, log_rate=200.0, skew=1, num=150, running=140, kv=78_613,
                   server_args=["--cpu-offload-gb", "20"]))
    table2 = targets.targets_table(rs, 3.75, tmp_path / "missing.json")
    assert [_cells(r)[2:5] for r in _rows(table2, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb")] == [
        ["elastic24d-skew / offload24_20-skew", "~6.11x (bench_serving / decode log)", "**met**"]]
    # a setting whose run ended before its traffic held two requests (the warm-up alone) is no
    # measurement of it: left out, named, and the one measured setting's estimate stands
    rs[-1] = _run("offload24_16-skew", 24, log_rate=2.5, skew=1, num=150, running=1, kv=61_000,
                  server_args=["--cpu-offload-gb", "16"])
    table3 = targets.targets_table(rs, 3.75, tmp_path / "missing.json")
    assert [_cells(r)[2] for r in _rows(table3, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb")] == [
        "elastic24d-skew / offload24-skew"]
    assert _rows(table3, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb") == \
        _rows(table, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb")
    assert "- left out, their traffic never ran (ended before two requests ran at once): offload24_16-skew" in table3
    assert "left out" not in table
    assert "**over the card**: q3elastic32-skew" in table
    assert "**2 digests**: `aaaaaaaaaaaa`: q3offload32_34_less2560_cap, q3elastic32d_cap; " \
           "`unknown (run before code_digest.py)`: q3elastic32-skew, elastic24d-skew_ph, offload24-skew, " \
           "elastic24d-skew" in table
    # the pool modes at one digest, SGLang's offload at others: said apart (its runs stand)
    at_one = [r for r in rs if r["name"] in ("q3elastic32d_cap", "q3offload32_34_less2560_cap", "offload24-skew")]
    assert targets.digest_line(at_one) == (
        "the pool modes at one digest, `aaaaaaaaaaaa`: q3elastic32d_cap; SGLang's own path (mode off, "
        "`--cpu-offload-gb`) at `aaaaaaaaaaaa`: q3offload32_34_less2560_cap; "
        "`unknown (run before code_digest.py)`: offload24-skew")
    assert targets.digest_line(at_one[:2]).startswith("one digest, `aaaaaaaaaaaa`: ")


def test_offload_settings_of_either_routing_count_and_a_window_of_prefill_alone_is_no_rate(tmp_path):
    """SGLang's offload copies the same bytes whatever the routing, so its uniform runs on the
    same requests are settings of the skewed traffic's sweep too (flagged as an anchor of the
    other traffic). A stopped run that held its traffic but decoded none of it in its window
    has no rate to pair: it is listed with what its lone step lets it serve of the whole
    traffic at most (makespan.py's floor at that step), as is each stopped baseline with a
    lone step beside its ratio, and where the pool run served its whole traffic, its
    bench_serving figure over that ceiling (at least, as the ceiling is a bound)."""
    targets = _serving_module("targets")
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps([[100, 10], [100, 1001], [100, 5]]))
    rs = [_run("elastic24d-skew", 24, 1222.0, skew=1, num=3),
          _run("offload24-skew", 24, log_rate=95.9, skew=1, num=3, server_args=["--cpu-offload-gb", "8"]),
          _run("offload24_16", 24, log_rate=206.8, num=3, running=114, server_args=["--cpu-offload-gb", "16"]),
          _run("q3offload32_50_less2560_cap", 32, log_rate=None, num=3, running=466,
               server_args=["--cpu-offload-gb", "50"]),
          _run("q3elastic32d_cap", 32, pass_rate=233.1, num=3)]
    rs[2]["log"]["lone_step_ms"] = 325.7
    rs[3]["log"]["lone_step_ms"] = 990.1
    table = targets.targets_table(rs, 3.75, lens)
    arrive = _serving_module("makespan").arrivals(3, 10.0, 1)[1]  # request #1 sets the floor
    end16, end50 = arrive + 1000 * 0.3257, arrive + 1000 * 0.9901
    assert [_cells(r)[2:5] for r in _rows(table, "24 GB Qwen1.5: >= 5x the best --cpu-offload-gb")] == [[
        "elastic24d-skew / offload24_16 (anchor on 24 GB, Qwen1.5-MoE, uniform, 10 req/s x 3)",
        f"~5.91x (bench_serving / decode log); over the whole traffic offload24_16 serves at most "
        f"{1016 / end16:.0f} tok/s (its lone step 326 ms: request #1's 1001 tokens end at {end16:.0f} s "
        f"at the earliest); elastic24d-skew served the whole traffic at 1222 tok/s: >= {1222 / (1016 / end16):.2f}x "
        "that", "**met**"]]
    assert (f"- left out, no decode of their traffic within their window (prefill only): q3offload32_50_less2560_cap: "
            f"serves at most {1016 / end50:.0f} tok/s (its lone step 990 ms: request #1's "
            f"1001 tokens end at {end50:.0f} s at the earliest)") in table
    assert _rows(table, "32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb") == [
        "| 32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb | - | - | no pair among these runs "
        "| not measured |"]


def test_out_steps_sets_each_step_with_experts_out_beside_the_resident_line(tmp_path):
    """out_steps.py: a decode step taken while the trace says experts were out is set against
    the median resident step at its batch; the extra time is fitted on expected reads alone and
    with the layers out beside them, and tabulated by how long after a round that moved
    experts its record was written. A stall (5x the line and 20 ms over it) and a batch the
    resident line does not cover are left out."""
    out_steps = _serving_module("out_steps")
    trace = [{"t": 10.0, "evicted": [[0, 1], [1, 2]], "restored": []},
             {"t": 20.0, "evicted": [], "restored": [[0, 1], [1, 2]]}]
    records = [{"t": 5.0, "steps": [[4, 2.0, 0]] * 6},
               {"t": 10.02, "steps": [[4, 2.5, 0.1], [4, 3.0, 0.2], [4, 100.0, 0.0], [9, 7.0, 0.3]]},
               {"t": 25.0, "steps": [[4, 2.0, 0]]}]
    res = out_steps.analyse(trace, records)
    assert res["resident_steps"] == 7 and res["out_steps"] == 2 and res["rounds_moving_experts"] == 2
    assert res["fit_reads"] == {"ms_per_read": 5.0, "rms_ms": 0.0}
    assert res["fit_both"] == {"us_per_layer_out": 0.0, "ms_per_read": 5.0, "rms_ms": 0.0}
    assert res["by_time_after_a_round"] == [
        {"after_s": [0, 0.05], "steps": 2, "extra_ms_median": 0.75, "reads_median": 0.15}]
    name = tmp_path / "elastic32-skew"
    (tmp_path / "elastic32-skew_trace.jsonl").write_text("\n".join(json.dumps(e) for e in trace))
    (tmp_path / "elastic32-skew_trace.steps.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    out = subprocess.run([sys.executable, str(ROOT / "bench/serving/out_steps.py"), str(name),
                          "--out", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "o.json").read_text()) == res
    assert "| 0-0.05 | 2 | 0.75 | 0.15 |" in out.stdout


def test_out_steps_sets_every_step_beside_the_price_the_adjuster_held_then(tmp_path):
    """out_steps.py with the run's log beside its trace: each decode step against the price the
    adjuster held when it ran (its StepClock replayed on the record from the logged start,
    refitted at each record line), in bins of 20 requests. Here the second line is priced with
    the resident line refitted through the first line's one resident step (too few for a slope:
    the prior's, 6.0 - 0.5 x 3 = 4.5 ms). On the stored 24 GB uniform H200 run, where no step
    ran with every expert resident, the price reads 1.21x the steps at batch 20-39 and 0.95x at
    100-119, and the read price sat at its floor (0.252 ms) for some of the steps."""
    out_steps = _serving_module("out_steps")
    records = [{"t": 1.0, "steps": [[1, 10.0, 4.0], [3, 6.0, 0.0]]}, {"t": 2.0, "steps": [[25, 40.0, 20.0]]}]
    assert out_steps.price_by_batch((5.0, 0.5, 0.25), records) == [
        {"batch": [0, 19], "steps": 2, "measured_ms": 8.0, "priced_ms": 6.5, "priced_over_measured": 0.81, "reads": 2.0,
         "read_price_ms": [0.25, 0.25]},
        {"batch": [20, 39], "steps": 1, "measured_ms": 40.0, "priced_ms": 22.0, "priced_over_measured": 0.55,
         "reads": 20.0, "read_price_ms": [0.25, 0.25]}]
    assert out_steps.prior_of("x\n[t] sglang-rimuru cost-aware adjuster: decode step 5.90 ms + 0.170 ms per request "
                              "+ 0.336 ms per offloaded expert read (0 timed steps)\n") == (5.9, 0.17, 0.336)
    base = ROOT / "bench/results/device_h200_2026-12-06/elastic24d"
    out = subprocess.run([sys.executable, str(ROOT / "bench/serving/out_steps.py"), str(base), "--out",
                          str(tmp_path / "o.json")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "o.json").read_text())
    assert res["resident_steps"] == 0 and "the card never held every expert" in out.stdout
    assert res["price_by_batch"]["prior"] == [5.9, 0.17, 0.336]
    rows = {tuple(r["batch"]): r for r in res["price_by_batch"]["rows"]}
    assert (rows[(20, 39)]["priced_over_measured"], rows[(100, 119)]["priced_over_measured"]) == (1.21, 0.95)
    assert rows[(20, 39)]["read_price_ms"] == [0.252, 0.326]
    assert "| 100-119 | 27 | 400.8 | 378.8 | 0.95x | 1057.5 | 0.252-0.35 |" in out.stdout


def test_out_steps_replays_the_curve_where_the_server_fitted_one(tmp_path):
    """price_by_batch with the run's RoutedExperts replays the server since 281aef5: the
    resident step a curve in routed experts, each fit its tangent at the last batch timed.
    On steps that follow such a curve (a ramp at batch 1-20, then a burst at 30-45 reading
    offloaded experts at 0.5 ms) the curve prices the burst at its time and the line through
    the ramp over it; out_steps.py picks the curve from the log's own words."""
    from sglang_rimuru.adjuster.cost import RoutedExperts

    out_steps = _serving_module("out_steps")
    routed = RoutedExperts(zipf_layer() * 24)
    resident = lambda b: 3.0 + 0.01 * routed(b)  # noqa: E731
    ramp = [[1 + i % 20, resident(1 + i % 20), 0.0] for i in range(300)]
    burst = [[b, resident(b) + 0.5 * 0.2 * b, 0.2 * b] for b in (30 + i // 40 for i in range(600))]
    records = [{"t": float(i), "steps": (ramp + burst)[i * 50:(i + 1) * 50]} for i in range(18)]
    curve = {tuple(r["batch"]): r for r in out_steps.price_by_batch((5.9, 0.17, 0.34), records, routed=routed)}
    line = {tuple(r["batch"]): r for r in out_steps.price_by_batch((5.9, 0.17, 0.34), records)}
    assert curve[(40, 59)]["priced_over_measured"] == pytest.approx(1.0, abs=0.02)
    assert line[(40, 59)]["priced_over_measured"] > 1.1
    # the command: a log that says "the line is the tangent at batch" and the run's JSON beside
    name = tmp_path / "elastic32-skew-ind_r20"
    (tmp_path / "elastic32-skew-ind_r20_trace.steps.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "elastic32-skew-ind_r20_trace.jsonl").write_text("")
    log = ("[t] sglang-rimuru cost-aware adjuster: decode step 5.90 ms + 0.170 ms per request + 0.340 ms per "
           "offloaded expert read (0 timed steps)\n[t] sglang-rimuru cost-aware adjuster: decode step 7.93 ms + "
           "0.047 ms per request + 0.285 ms per offloaded expert read (562 timed steps); the line is the tangent "
           "at batch 54 to the resident step's curve in the experts a batch routes to\n")
    (tmp_path / "elastic32-skew-ind_r20.log").write_text(log)
    cmd = [sys.executable, str(ROOT / "bench/serving/out_steps.py"), str(name), "--out", str(tmp_path / "o.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "its replay needs" in out.stderr + out.stdout  # no JSON: no guess
    (tmp_path / "elastic32-skew-ind_r20.json").write_text(json.dumps({"name": name.name, "model": "q15",
                                                                      "server_args": []}))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "o.json").read_text())["price_by_batch"]
    assert res["fit"] == "curve" and "priced at its tangent" in out.stdout
    uniform = RoutedExperts([4 / 60] * 60 * 24)  # no ranking in its arguments: the default, uniform
    assert res["rows"] == out_steps.price_by_batch((5.9, 0.17, 0.34), records, routed=uniform)


def test_the_tail_bounds_a_stopped_runs_whole_traffic_from_its_step_record(tmp_path):
    """tail.py: with every request admitted by the cut, each running one decoded in every
    decode pass after the last prefill pass (6 here, so 7 tokens each with its prefill's);
    the longest still running at the slowest step of the cut's batch bounds the traffic's
    end, and on uniform routing the estimate decodes the rest at the adjuster's own step
    price as the batch falls. A queue at the cut, or fewer long requests than the batch
    running, voids the premise."""
    tail = _serving_module("tail")
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps([[10, 5], [10, 40], [10, 12]]))
    reads_at_cut = 100 * (1 - (15 / 16) ** 2)  # 100 experts out; Qwen3: top 8 of 128
    run = {"name": "q3elastic32d_cap", "model": "q3", "num_prompts": 3, "rate": 10.0, "seed": 1,
           "router_skew": 0.0, "traffic_began_wall": 1000.0,
           "trace": {"cost_ms": {"base": 5.0, "per_request": 1.0, "expert": 0.5}}}
    records = [{"t": 999.0, "steps": [[1, 50.0, 6.25]], "gpu": [[1, 50.0]], "passes": [["extend", 1, 9.0]]},
               {"t": 1001.0, "steps": [], "gpu": [], "passes": [["mixed", 3, 10.0]]},
               {"t": 1003.0, "steps": [[3, 20.0, 30.0]] * 4, "gpu": [[3, 20.0]] * 4, "passes": []},
               {"t": 1004.0, "steps": [[2, 15.0, reads_at_cut], [2, 16.0, reads_at_cut]],
                "gpu": [[2, 15.0]] * 2, "passes": []}]
    log = "Decode batch, #running-req: 2, #token: 90, token usage: 0.1, gen throughput (token/s): 99.0, #queue-req: 0\n"
    res = tail.tail(run, records, log, lens)
    assert (res["elapsed_s"], res["tokens"], res["batch_at_cut"], res["decodes_after_last_prefill"],
            res["longest_left"], res["slowest_step_at_cut_ms"]) == (4.0, 3 + 12 + 4, 2, 6, 33, 16.0)
    assert res["makespan_at_most_s"] == round(4.0 + 33 * 0.016, 1)
    assert res["whole_tok_s_at_least"] == round(57 / (4.0 + 33 * 0.016), 1)
    # 5 steps at batch 2 (5 + 2 + 0.5 x 100 x (1 - (15/16)^2) ms), then 28 at batch 1
    tail_ms = 5 * (7 + 50 * (1 - (15 / 16) ** 2)) + 28 * (6 + 50 / 16)
    assert res["experts_out"] == 100 and res["estimate_tail_s"] == round(tail_ms / 1e3, 1)
    assert res["estimate_whole_tok_s"] == round(57 / (4.0 + tail_ms / 1e3), 1)
    assert res["estimate_lone_step_ms"] == round(6 + 50 / 16, 1)
    assert "estimate_whole_tok_s" not in tail.tail({**run, "router_skew": 1.0}, records, log, lens)
    with pytest.raises(ValueError, match="still queued"):
        tail.tail(run, records, log.replace("#queue-req: 0", "#queue-req: 4"), lens)
    lens.write_text(json.dumps([[10, 5], [10, 40], [10, 7]]))
    with pytest.raises(ValueError, match="fewer than the 2 running"):
        tail.tail(run, records, log, lens)


#: the [prompt, output] lengths of the first 150 requests of the anchors' ShareGPT sample
#: (../shared/data/sharegpt_1000_seed1_ctx8192.json.lens.json, which a clone on its own lacks)
LENS_150 = Path(__file__).parent / "data" / "sharegpt_1000_seed1_ctx8192_lens_first150.json"


@pytest.fixture
def device_clock(monkeypatch):
    """The device's log stamps (UTC) read as this machine's local time: TZ pinned to UTC for
    the test, and restored after it (monkeypatch's undo, then tzset to apply it)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_tail_backtested_on_a_run_that_served_its_whole_traffic(device_clock):
    """tail.py --cut on the thirty-second session's 24 GB uniform H200 run (all 150 served,
    201.1 tok/s over 167.8 s): cut at 60, 80 and 128 s, the bound and the estimate each stay
    below what the run measured, as both are built to err, and the estimate nears it as the
    cut moves later (0.74x, 0.79x, 0.94x). The log keeps only lines stamped by the cut (the
    device's clock, UTC, read as this machine's local time: ``device_clock``)."""
    tail = _serving_module("tail")
    window = _serving_module("window")
    decode_log = _serving_module("decode_log")
    base = ROOT / "bench/results/device_h200_2026-12-06/elastic24d"
    run = json.loads(base.with_name(base.name + ".json").read_text())
    records = decode_log.read_lines(base.with_name(base.name + "_trace.steps.jsonl.gz"))
    log = decode_log.read_log(base.with_name(base.name + ".log.gz"))
    began = window.began_of(run, base, records)
    measured = run["bench"]["output_throughput"]
    assert run["all_completed"] and round(measured, 1) == 201.1
    got = []
    for seconds in (60, 80, 128):
        recs, cut_log = tail.cut_at(records, log, began, seconds)
        assert recs[-1]["t"] <= began + seconds < records[len(recs)]["t"]
        assert len(cut_log) < len(log) and cut_log.startswith(log[:1000])
        res = tail.tail(run, recs, cut_log, LENS_150, began=began)
        got.append((res["elapsed_s"], res["batch_at_cut"], res["whole_tok_s_at_least"], res["estimate_whole_tok_s"]))
        assert res["whole_tok_s_at_least"] < res["estimate_whole_tok_s"] < measured
    assert got == [(59.7, 78, 63.4, 149.7), (79.9, 65, 76.1, 158.2), (127.7, 23, 123.6, 189.3)]


def _prefill_line(t: float, new_seq: int) -> str:
    return (f"[{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))}] Prefill batch, #new-seq: {new_seq}, "
            "#new-token: 2048, #cached-token: 0, token usage: 0.1, #running-req: 0, #queue-req: 9")


def test_two_stopped_runs_are_compared_over_the_same_first_seconds(tmp_path):
    """window.py: SGLang's timeline counts each decode line's running requests times the log
    interval and a first token per admitted sequence, from the first prefill after the
    warm-up's decode line; a pool mode's counts its step record's passes. The pair is taken
    at the earlier window's end, interpolated, with the bound from the points beside; the
    fastest decode line is SGLang's rate at full batch."""
    window = _serving_module("window")
    t = 1_800_000_000.0
    log = "\n".join(["decode_log_interval=10", _prefill_line(t - 9, 1), _decode_line(t - 5, 1, 2.0),
                     _prefill_line(t, 5), _prefill_line(t + 30, 3), _decode_line(t + 40, 8, 50.0),
                     _decode_line(t + 50, 6, 70.0)])
    assert window.traffic_start(log) == t
    assert window.log_timeline(log, t) == [[40.0, 5 + 3 + 80], [50.0, 5 + 3 + 80 + 60]]
    assert window.best_line(log, t) == {"tok_s": 70.0, "running": 6}
    records = [{"t": t - 1, "gpu": [[1, 9.0]], "passes": []},
               {"t": t + 20, "gpu": [[4, 9.0]] * 10, "passes": [["mixed", 5, 9.0]]},
               {"t": t + 60, "gpu": [[5, 9.0]] * 20, "passes": []}]
    assert window.pass_timeline(records, t) == [[20.0, 45], [60.0, 145]]
    el = {"timeline": {"points": window.pass_timeline(records, t)}}
    off = {"timeline": {"points": window.log_timeline(log, t)}}
    w = window.same_window(el, off)
    assert w["seconds"] == 50.0 and w["tokens"] == round(45 + 100 * 30 / 40) and w["other_tokens"] == 148
    assert w["ratio"] == (45 + 100 * 30 / 40) / 148 and w["ratio_at_least"] == 45 / 148
    assert window.interpolate([[10.0, 100]], 5.0) == 50.0 and window.interpolate([[10.0, 100]], 20.0) == 100
    assert window.same_window(el, {"timeline": {"points": []}}) is None
    # stored: run_one.py's JSON without traffic_began_wall, its log beside (the first prefill after the warm-up)
    (tmp_path / "offload24_16.log.gz").write_bytes(__import__("gzip").compress(log.encode()))
    got = window.timeline_of({"name": "offload24_16"}, tmp_path / "offload24_16")
    assert got == {"source": "decode log", "began_wall": t, "points": off["timeline"]["points"],
                   "best_line": {"tok_s": 70.0, "running": 6}}


def _held_line(t: float, running: int, kv: int, rate: float, queued: int = 0) -> str:
    """A decode line with the KV its running requests hold (SGLang's ``#token``)."""
    return (f"[{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))}] Decode batch, #running-req: {running}, "
            f"#token: {kv}, token usage: 0.1, cuda graph: True, gen throughput (token/s): {rate:.2f}, "
            f"#queue-req: {queued}")


def test_plain_stopped_on_its_last_request_alone_bounds_the_whole_traffic(tmp_path):
    """A plain run stopped while its traffic's last request decoded alone: that request held
    the KV its last line says, so it is one of the sample's requests whose prompt fits under
    it and whose prompt and output pass it; the fewest tokens any such had left, at the
    fastest rate it decoded alone (not the first lone line's, which still counts the steps
    before it), end the traffic no sooner than that. An elastic run that served the whole
    traffic is set against that ceiling: a floor on the ratio, which meets the target."""
    window, targets = _serving_module("window"), _serving_module("targets")
    t = 1_800_000_000.0
    log = "\n".join(["decode_log_interval=40", _prefill_line(t - 9, 1), _decode_line(t - 5, 1, 2.0),
                     _prefill_line(t, 5), _held_line(t + 10, 3, 900, 500.0, queued=2),
                     _held_line(t + 20, 3, 1000, 520.0), _held_line(t + 30, 1, 600, 400.0),
                     _held_line(t + 31, 1, 640, 200.0), _held_line(t + 40, 1, 1000, 180.0)])
    tail = {"seconds": 40.0, "kv_tokens": 1000, "tok_s": 200.0, "lines": 3}
    assert window.lone_tail(log, t) == tail
    assert window.timeline(None, log, t)["lone_tail"] == tail
    # a queued request, or a prefill after the lone lines: no tail
    assert window.lone_tail(log + "\n" + _prefill_line(t + 41, 1), t) is None
    assert window.lone_tail(log.replace("#token: 1000, token usage: 0.1, cuda graph: True, gen throughput "
                                        "(token/s): 180.00, #queue-req: 0", "#token: 1000, token usage: 0.1, "
                                        "cuda graph: True, gen throughput (token/s): 180.00, #queue-req: 1"), t) is None
    # the sample: (prompt, output); requests 1 and 3 pass 1,000 tokens, 2's prompt is longer
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps([[100, 50], [20, 3000], [1200, 40], [500, 1600], [7, 9]]))
    base = {**_run("off32-skew_r20", 32, log_rate=900.0, rate=20, skew=1, num=5), "timeline": {"points": [[40.0, 2000]],
            "lone_tail": tail}}
    el = _run("elastic32-skew_r20", 32, 150.0, rate=20, skew=1, num=5)
    c = targets.lone_tail_ceiling(base, lens)
    left = 500 + 1600 - 1000 - 2  # request 3, the fewer of the two, less the tokenizer's slack
    assert c == {"tok_s": 4699 / (40 + left / 200), "left": left, "end_s": 40 + left / 200, "at_s": 40.0,
                 "alone_tok_s": 200.0}
    table = targets.targets_table([base, el], 3.75, lens)
    [row] = _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    # 4,699 tokens no sooner than 45.5 s: at most 103 tok/s, against elastic's 150 (the means' ratio,
    # 150 / 900 over plain's own window, would say not met)
    bound = 150.0 / c["tok_s"]
    assert round(c["tok_s"]) == 103 and round(bound, 2) == 1.45
    whole = (f"; over the whole traffic off32-skew_r20 serves at most 103 tok/s (its last request alone at 200 "
             f"tok/s with >= {left} tokens to go at 40 s: done no sooner than 45 s), elastic32-skew_r20 served it "
             f"at 150: **>= 1.45x**")
    assert _cells(row)[3:5] == ["~0.17x (bench_serving / decode log)" + whole,
                                "**met** (over the whole traffic, by the bound)"]
    [floor_row] = _rows(table, "at no rate below 0.97x plain")
    assert _cells(floor_row)[3:5] == _cells(row)[3:5]
    # no bound where the lens file is not the run's sample: the means decide
    [row2] = _rows(targets.targets_table([base, el], 3.75, tmp_path / "missing.json"),
                   "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    assert _cells(row2)[3:5] == ["~0.17x (bench_serving / decode log)", "not met"]


def test_a_stopped_plain_pair_is_taken_over_the_same_seconds_with_its_lowest_point_on_the_way():
    """A plain pair where both stopped at their budget (uniform 10 req/s on an H100, forty-fifth
    session): the throughput and no-rate-below targets compare the same first seconds of the
    traffic, not each run's mean over its own window, and say the lowest ratio at each quarter
    of it: level at the end but trailing on the way is met over the window, below on the way."""
    window, targets = _serving_module("window"), _serving_module("targets")
    el = {**_run("elastic32", 32, pass_rate=1100.0), "timeline": {"points": [[20.0, 18000], [40.0, 45000],
                                                                            [60.0, 70000], [80.0, 96000]]}}
    base = {**_run("off32", 32, log_rate=1090.0), "timeline": {"points": [[20.0, 20000], [40.0, 48000],
                                                                         [60.0, 72000], [90.0, 105000]]}}
    # base at 80 s: 72000 + 33000 * 20 / 30 = 94000; el leads there, trailed 0.90x at 20 s
    assert window.along(el, base) == [[20.0, 0.9], [40.0, 45000 / 48000], [60.0, 70000 / 72000],
                                      [80.0, 96000 / 94000]]
    assert window.along(el, {"timeline": {"points": []}}) == []
    table = targets.targets_table([el, base], 3.75)
    [tput] = _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    measured = ("~1.02x over the same first 80 s of the traffic (96000 against 94000 tokens), lowest along it "
                "0.90x at 20 s; means over each run's own window ~1.01x (pass record / decode log)")
    assert _cells(tput)[3:5] == [measured, "not met"]
    [floor_row] = _rows(table, "at no rate below 0.97x plain")
    assert _cells(floor_row)[3:5] == [measured, "**met** over the window; below it (0.90x) at 20 s"]
    # never below 0.97x on the way: the verdict alone
    el["timeline"]["points"][0][1], el["timeline"]["points"][1][1] = 19800, 47000
    [floor_row] = _rows(targets.targets_table([el, base], 3.75), "at no rate below 0.97x plain")
    assert _cells(floor_row)[4] == "**met**"


def test_the_offload_target_takes_the_setting_elastic_leads_least_over_the_same_window(tmp_path):
    """Against SGLang's offload settings that stopped, the offload target compares over the
    same first seconds (window.py), picks the setting elastic leads least there, and sets the
    setting's fastest decode line beside: the verdict says where full batch falls short."""
    targets = _serving_module("targets")
    el = {**_run("q3elastic32d_cap", 32, pass_rate=250.0), "timeline": {"points": [[50.0, 10000], [100.0, 25000]]}}
    a = {**_run("q3offload32_50_less2560_cap", 32, log_rate=80.0, server_args=["--cpu-offload-gb", "50"], kv=200000),
         "timeline": {"points": [[90.0, 5000], [100.0, 9000]], "best_line": {"tok_s": 400.0, "running": 400}}}
    b = {**_run("q3offload32_34_less2560_cap", 32, log_rate=60.0, server_args=["--cpu-offload-gb", "34"], kv=150000),
         "timeline": {"points": [[40.0, 2000]], "best_line": {"tok_s": 60.0, "running": 50}}}
    rows = _rows(targets.targets_table([el, a, b], 3.75), "32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb")
    assert len(rows) == 1
    runs, measured, verdict = _cells(rows[0])[2:5]
    assert runs == "q3elastic32d_cap / q3offload32_50_less2560_cap"  # 25000 / 9000 at 100 s, below 8000 / 2000 at 40 s
    assert measured.startswith("~2.78x over the same first 100 s of the traffic (25000 against 9000 tokens; "
                               "at least 2.78x between the records' points); means over each run's own window ~3.12x")
    assert "q3offload32_50_less2560_cap's fastest decode line 400 tok/s at 400 running, q3elastic32d_cap's rate 0.62x" in measured
    assert verdict == "**met** over the window; below it (0.62x) against q3offload32_50_less2560_cap at full batch"


def test_runs_on_the_same_requests_share_one_tokens_plot(tmp_path):
    """report.py --plots: one plot of output tokens against time for each set of requests two
    or more runs with a timeline served, whatever their routing; a lone run gets none."""
    report = _serving_module("report")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = {"source": "pass record", "points": [[10.0, 100], [20.0, 300]]}
    rs = [{**_run("q3elastic32d-skew_cap", 32, pass_rate=300.0, skew=1), "model": "q3", "timeline": tl},
          {**_run("q3offload32_50_less2560_cap", 32, log_rate=80.0), "model": "q3", "timeline": tl},
          {**_run("elastic24d", 24, pass_rate=200.0, num=150), "timeline": tl}]
    made = report.token_plots(rs, tmp_path, plt)
    assert [p.name for p in made] == ["tokens_q3_32GB_r10_x500_H200.png"] and made[0].stat().st_size > 0


def test_a_card_emulated_on_an_h100_pairs_only_with_runs_on_an_h100(tmp_path):
    """An H100 holds the same emulated card on slower memory and another host's PCIe: its
    runs pair with each other, never with the H200's (runs before run_one.py wrote the GPU
    ran on the H200), and the traffic says which GPU."""
    targets = _serving_module("targets")
    h100 = {"name": "NVIDIA H100 80GB HBM3", "total_mib": 81559}
    rs = [_run("q3elastic32d_cap", 32, pass_rate=233.1),
          _run("q3offload32_34_less2560_cap", 32, log_rate=62.0, kv=160000, server_args=["--cpu-offload-gb", "34"]),
          {**_run("q3elastic32d_cap", 32, pass_rate=253.8), "gpu": h100},
          {**_run("q3offload32_50_less2560_cap", 32, log_rate=77.2, kv=208414,
                  server_args=["--cpu-offload-gb", "50"]), "gpu": h100},
          {**_run("q3offload32_34_less2560_cap", 32, log_rate=500.0, kv=160000,
                  server_args=["--cpu-offload-gb", "34"]), "gpu": {"name": "NVIDIA H200", "total_mib": 143771}}]
    rows = _rows(targets.targets_table(rs, 3.75), "32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb")
    assert [_cells(r)[1:4] for r in rows] == [
        ["32 GB, Qwen3-30B-A3B, uniform, 10 req/s x 500, on an H100",
         "q3elastic32d_cap / q3offload32_50_less2560_cap", "~3.29x (pass record / decode log)"],
        ["32 GB, Qwen3-30B-A3B, uniform, 10 req/s x 500", "q3elastic32d_cap / q3offload32_34_less2560_cap",
         "~0.47x (pass record / decode log)"]]


def test_the_code_digest_covers_the_servers_code_only(tmp_path):
    """code_digest.py hashes what the server imports (sglang_rimuru/, kernels/, patches/:
    sources and tuned tables), so a benchmark or RESULTS change keeps it and a kernel table
    change moves it; a commit's digest read from git equals its checkout's."""
    cd = _serving_module("code_digest")
    for rel, text in {"sglang_rimuru/a.py": "x = 1\n", "kernels/pkg/cfg.json": "{}", "bench/b.py": "y\n",
                      "sglang_rimuru/__pycache__/a.pyc": "junk", "patches/README.md": "doc"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    first = cd.tree_digest(tmp_path)
    (tmp_path / "bench/b.py").write_text("changed\n")
    (tmp_path / "patches/README.md").write_text("changed")
    assert cd.tree_digest(tmp_path) == first and len(first) == 12
    (tmp_path / "kernels/pkg/cfg.json").write_text('{"BLOCK_M": 16}')
    assert cd.tree_digest(tmp_path) != first
    # a table tuned for another GPU: part of the code for the GPU it names, not for the others
    h200 = cd.tree_digest(tmp_path, device="NVIDIA_H200")
    assert h200 == cd.tree_digest(tmp_path)  # no GPU's table yet: the device changes nothing
    (tmp_path / "kernels/pkg/E=60,N=1408,device_name=NVIDIA_H100_80GB_HBM3_down.json").write_text("{}")
    assert cd.tree_digest(tmp_path, device="NVIDIA_H200") == h200
    assert cd.tree_digest(tmp_path, device=cd.device_of("NVIDIA H100 80GB HBM3")) != h200
    assert cd.tree_digest(tmp_path) != h200  # every GPU's tables without a device
    (tmp_path / "kernels/pkg/E=60,N=1408,device_name=NVIDIA_H200.json").write_text("{}")
    assert cd.tree_digest(tmp_path, device="NVIDIA_H200") != h200
    assert cd.device_of(None) is None
    # a table under trial in RIMURU_KERNELS_CONFIG_DIR counts as the kernel's own of that name:
    # the run's digest is that of the commit that ships it
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "E=60,N=1408,device_name=NVIDIA_H200.json").write_text('{"1": {}}')
    with_trial = cd.tree_digest(tmp_path, device="NVIDIA_H200", config_dirs=str(trial))
    assert with_trial != cd.tree_digest(tmp_path, device="NVIDIA_H200")
    (tmp_path / "kernels/rimuru_kernels/configs").mkdir(parents=True)
    (tmp_path / "kernels/rimuru_kernels/configs/E=60,N=1408,device_name=NVIDIA_H200.json").write_text('{"1": {}}')
    assert cd.tree_digest(tmp_path, device="NVIDIA_H200") == with_trial
    assert cd.commit_digest("HEAD", ROOT) == cd.tree_digest(ROOT) or subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", *cd.CODE_DIRS], capture_output=True,
        text=True).stdout.strip()  # a working tree with uncommitted server code differs from HEAD


def _skew_module(monkeypatch, noise: str | None = None):
    """bench/serving/skew's module, loaded here under RIMURU_BENCH_ROUTER_NOISE=noise and
    without leaving its import hook in this process."""
    import importlib.util

    monkeypatch.delenv("RIMURU_BENCH_ROUTER_SKEW", raising=False)  # no hook installed in this process
    monkeypatch.setenv("RIMURU_BENCH_ROUTER_NOISE", noise or "0")
    spec = importlib.util.spec_from_file_location(
        "rimuru_bench_skew", ROOT / "bench" / "serving" / "skew" / "sitecustomize.py")
    skew = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(skew)
    finally:  # a noise above 0 installed the import hook: take it out again
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "rimuru_bench_skew"]
    return skew


def test_skew_is_independent_of_the_router_logits_scale(monkeypatch):
    """The benchmark's skewed routing standardizes each token's logits before the bias:
    dummy weights give logits of ~1e-5, and an unstandardized bias of s = 2 sent every
    token of the Qwen1.5 shape to the same 4 experts (H200). The picks must not depend
    on the logits' scale, and must still vary with the token."""
    import torch

    skew = _skew_module(monkeypatch)  # no RIMURU_BENCH_ROUTER_SKEW here: no hook installed
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


def test_router_noise_routes_each_token_by_its_own_draws(monkeypatch):
    """On dummy weights a token's router logits are a function of the token, so requests that
    decode one token share a routing (bench/serving/dummy_routing.py). --router-noise 1 draws
    each token's standardized logits anew every forward: one token's logits 4,096 times give
    4,096 routings with the popularity law of the skew table (s = 1: rank 0 ~0.85); without
    noise they give one."""
    import torch

    skew = _skew_module(monkeypatch)
    torch.manual_seed(0)
    logits = (torch.randn(1, 60) * 1e-5).expand(4096, 60)
    bias = -1.0 * torch.log1p(torch.arange(60, dtype=torch.float64))
    shared = skew.skewed_logits(logits, bias).topk(4, dim=-1).indices
    assert len(set(map(tuple, shared.tolist()))) == 1
    drawn = skew.skewed_logits(logits, bias, 1.0).topk(4, dim=-1).indices
    assert len(set(map(tuple, drawn.sort(-1).values.tolist()))) > 1000
    p = torch.bincount(drawn.flatten(), minlength=60).double() / len(logits)
    assert 0.80 < p[0] < 0.90 and 0.07 < p[9] < 0.13 and p[59] < 0.01
    with pytest.raises(SystemExit, match="RIMURU_BENCH_ROUTER_NOISE=2.0: the share of fresh draws"):
        _skew_module(monkeypatch, "2")


def test_independent_routings_pair_only_with_each_other(tmp_path):
    """A run's --router-noise is part of its traffic: runs under independent routings pair with
    each other, never with the dummy routers' (whose requests share routings), and the table
    names them; the requests themselves are the same."""
    targets = _serving_module("targets")
    ind = {"router_noise": 1.0}
    rs = [_run("off32", 32, 1000.0), _run("elastic32", 32, 1050.0),
          _run("off32-ind", 32, 990.0) | ind, _run("elastic32-ind", 32, 1200.0) | ind]
    table = targets.targets_table(rs, 3.75, tmp_path / "missing.json")
    tput = _rows(table, "32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)")
    assert sorted(_cells(r)[1:4] for r in tput) == [
        ["32 GB, Qwen1.5-MoE, uniform (independent routings), 10 req/s x 500", "elastic32-ind / off32-ind", "1.21x"],
        ["32 GB, Qwen1.5-MoE, uniform, 10 req/s x 500", "elastic32 / off32", "1.05x"]]
    assert targets.same_requests(targets.traffic_of(rs[0]), targets.traffic_of(rs[2]))
    assert targets.traffic_of(rs[0]) != targets.traffic_of(rs[2])


def test_the_per_step_record_is_bucketed_and_set_beside_the_cost_model(tmp_path):
    """run_one buckets the steps the adjuster timed (``NAME_trace.steps.jsonl``) by batch;
    report.py --steps sets each bucket's median beside the last order's cost model."""
    run_one, report = _serving_module("run_one"), _serving_module("report")
    path = tmp_path / "e_trace.steps.jsonl"
    # the first line from before the GPU times were recorded; the second with them
    path.write_text(json.dumps({"t": 1.0, "steps": [[1, 6.0, 0.0], [8, 8.0, 2.0], [3, 7.0, 1.0]]}) + "\n"
                    + json.dumps({"t": 2.0, "steps": [[9, 30.0, 40.0], [16, 34.0, 50.0]],
                                  "gpu": [[10, 20.0], [16, 24.0], [9, 21.0]]}) + "\n")
    rows = run_one.step_summary(run_one.read_jsonl(path))
    assert rows == [[1, 8, 3, 7.0, 4.0, 1.0, None], [9, 16, 2, 32.0, 12.5, 45.0, 21.0]]
    assert run_one.step_summary(run_one.read_jsonl(tmp_path / "missing.steps.jsonl")) is None
    r = {"name": "elastic24", "steps": rows,
         "trace": {"cost_ms": {"base": 5.0, "per_request": 0.2, "expert": 0.5}}}
    old = {"name": "elastic24-old", "steps": [row[:6] for row in rows]}  # a JSON from before the GPU column
    out = report.steps([r, {"name": "off24", "trace": None}, old])
    assert "| elastic24 | 1-8 | 3 | 7.00 | - | 6.30 | 1.0 |" in out  # 5 + 0.2 x 4 + 0.5 x 1
    assert "| elastic24 | 9-16 | 2 | 32.00 | 21.00 | 30.00 | 45.0 |" in out  # 5 + 0.2 x 12.5 + 0.5 x 45
    assert "| elastic24-old | 9-16 | 2 | 32.00 | - | - | 45.0 |" in out
    assert "off24" not in out
    assert report.steps([{"name": "off24"}]) == "(no run has a per-step record)"


def test_a_stopped_run_counts_its_tokens_from_the_pass_record(tmp_path):
    """run_one's pass_tokens: decode passes give one token per request, extend and mixed
    passes one per request too; records written before the traffic began are left out."""
    run_one = _serving_module("run_one")
    path = tmp_path / "e_trace.steps.jsonl"
    path.write_text(json.dumps({"t": 5.0, "steps": [], "gpu": [[1, 40.0]] * 30}) + "\n"  # warmup
                    + json.dumps({"t": 30.0, "steps": [], "gpu": [[100, 1000.0], [101, 1010.0]],
                                  "passes": [["mixed", 104, 1400.0], ["extend", 3, 900.0]]}) + "\n"
                    + json.dumps({"t": 50.0, "steps": [[99, 990.0, 4000.0]], "gpu": [[99, 990.0]]}) + "\n")
    got = run_one.pass_tokens(run_one.read_jsonl(path), t_from=10.0)
    assert got == {"tokens": 100 + 101 + 104 + 3 + 99, "seconds": 40.0, "tok_s": round(407 / 40, 1),
                   "decode_passes": 3, "mixed_passes": 1, "extend_passes": 1}
    assert run_one.pass_tokens(run_one.read_jsonl(path), t_from=60.0) is None
    assert run_one.pass_tokens(run_one.read_jsonl(tmp_path / "missing.steps.jsonl"), t_from=0.0) is None


def _stub_bench(tmp_path: Path, monkeypatch, cli_main: str) -> None:
    """A stand-in ``sglang.benchmark.serving`` first on the path of every warm_bench.py started
    from here on: ``cli_main`` is the body of its ``cli_main()`` (sys and time imported)."""
    stub = tmp_path / "stub" / "sglang" / "benchmark"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("")
    (stub / "serving.py").write_text("import sys, time\nIMPORTED = time.time()\ndef cli_main():\n"
                                     + "".join(f"    {line}\n" for line in cli_main.splitlines()))
    monkeypatch.setenv("PYTHONPATH", f"{stub.parent.parent}:{os.environ.get('PYTHONPATH', '')}")


def test_the_traffic_begins_when_bench_serving_says_so_not_at_its_launch(tmp_path, monkeypatch):
    """run_one's bench_serving: the first requests go out one second (bench_serving's sleep)
    after it prints that its main run starts, read as the line is printed (the child's
    stdout unbuffered), not when the process starts or ends; past the timeout the child is
    killed and the start it printed is kept (a stopped run's pass record needs it)."""
    run_one = _serving_module("run_one")
    _stub_bench(tmp_path, monkeypatch, "time.sleep(1.5)\n"
                f"print('Warmup completed with 1 sequences. {run_one.MAIN_RUN}...')\n"
                "time.sleep(float(sys.argv[1]))\nprint('done')")
    began: list = []
    launched = time.time()
    out, err = run_one.bench_serving(["1.0"], 60, began)
    ended = time.time()
    assert out.endswith("done\n") and err == ""
    assert len(began) == 1 and launched + 2.5 <= began[0] <= ended  # 1.5 s + its 1 s sleep
    began.clear()
    launched = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run_one.bench_serving(["60"], 4, began)
    assert time.time() - launched < 15  # killed at its timeout, not left to run its 60 s
    assert len(began) == 1 and launched + 2.5 <= began[0] <= launched + 6


def test_pass_memory_sums_the_allocator_rows_by_pass_kind(tmp_path):
    """run_one's pass_memory: per kind the largest batch and the highest peak with its
    batch; reserved after the last pass and at most; None without rows or a record."""
    run_one = _serving_module("run_one")
    path = tmp_path / "e_trace.steps.jsonl"
    path.write_text(json.dumps({"t": 5.0, "steps": [], "gpu": [[1, 40.0]]}) + "\n"  # a record from before "memory"
                    + json.dumps({"t": 30.0, "steps": [], "memory": [["decode", 160, 900, 31000],
                                                                     ["mixed", 200, 2500, 33000],
                                                                     ["decode", 240, 1400, 34000]]}) + "\n"
                    + json.dumps({"t": 50.0, "steps": [], "memory": [["mixed", 180, 2600, 36000],
                                                                     ["decode", 120, 700, 35500]]}) + "\n")
    assert run_one.pass_memory(run_one.read_jsonl(path)) == {
        "by_kind": {"decode": {"passes": 3, "max_batch": 240, "peak_mib": 1400, "peak_at_batch": 240},
                    "mixed": {"passes": 2, "max_batch": 200, "peak_mib": 2600, "peak_at_batch": 180}},
        "reserved_mib_last": 35500, "reserved_mib_max": 36000, "peak_mib_max": 2600}
    path.write_text(json.dumps({"t": 5.0, "steps": [], "gpu": [[1, 40.0]]}) + "\n")
    assert run_one.pass_memory(run_one.read_jsonl(path)) is None
    assert run_one.pass_memory(run_one.read_jsonl(tmp_path / "missing.steps.jsonl")) is None


CAP_LOG = """\
[2026-12-03 22:55:09] sglang-rimuru card emulation (SGLANG_RIMURU_CARD_MIB): torch's allocator capped at 31892.4 MiB of the 32768 MiB card (619.6 MiB in use outside it, 256 MiB margin); the cap follows what lies outside torch, measured again at most every 1 s
[2026-12-03 22:55:38] sglang-rimuru card emulation: 735.6 MiB now in use outside torch's allocator; its cap follows to 31776.4 MiB
[2026-12-03 22:56:48] sglang-rimuru card emulation: 1191.6 MiB now in use outside torch's allocator; its cap follows to 31320.4 MiB
[2026-12-03 22:57:36] Decode batch, #running-req: 11, #token: 6629, token usage: 0.96, cuda graph: True, gen throughput (token/s): 1726.61, #queue-req: 51
"""


def test_card_cap_log_reads_the_cap_and_what_lay_outside_torch():
    """run_one's card_cap_log (the lines of a smoke run on the H200, f93d751): the start's cap,
    the lowest it followed to, and the most that lay outside torch; None without a cap."""
    run_one = _serving_module("run_one")
    assert run_one.card_cap_log(CAP_LOG) == {"cap_mib_start": 31892.4, "outside_mib_start": 619.6,
                                             "outside_mib_max": 1191.6, "cap_mib_min": 31320.4, "follows": 2}
    assert run_one.card_cap_log(CAP_LOG.splitlines()[0]) == {
        "cap_mib_start": 31892.4, "outside_mib_start": 619.6, "outside_mib_max": 619.6, "cap_mib_min": 31892.4,
        "follows": 0}
    assert run_one.card_cap_log(CAP_LOG.splitlines()[-1]) is None


def test_a_run_cut_by_its_calls_time_still_writes_what_it_measured(tmp_path, monkeypatch):
    """The device call's ``timeout`` sends SIGTERM while bench_serving runs: run_one stops the
    traffic, writes its JSON from the server's log (marked cut) and prints its line, instead of
    dying with nothing written (the twelfth session's smoke run lost its JSON so)."""
    run_one = _serving_module("run_one")
    out = tmp_path / "out"
    data = sharegpt_file(tmp_path / "sharegpt.json", 4)

    class FakeServer:
        url = "http://127.0.0.1:1"
        proc = SimpleNamespace(pid=os.getpid())
        stopped = False

        def stop(self):
            FakeServer.stopped = True

    def start(cmd, log_path, timeout, env):
        assert env == {"SGLANG_RIMURU_CARD_MIB": "32768"}
        Path(log_path).write_text(CAP_LOG)
        return FakeServer()

    def traffic(args, phases, datasets, port, out, t0, results, bench_logs, began=None, hosts=None):
        assert hosts == ["host"]  # one warm bench_serving a phase, started beside the server
        os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the traffic")

    monkeypatch.setattr(run_one, "start_local_server", start)
    monkeypatch.setattr(run_one, "run_traffic", traffic)
    monkeypatch.setattr(run_one, "warm_bench", lambda: "host")
    monkeypatch.setattr(run_one, "end_unused", lambda hosts: ended.extend(hosts))
    ended: list = []
    monkeypatch.setattr(run_one.GpuSampler, "_sample_gpu", lambda self, t0: None)
    monkeypatch.setattr(sys, "argv", ["run_one.py", "--name", "q3elastic32d_cap", "--model", "m", "--card-gb", "32",
                                      "--card-cap", "--dataset", str(data), "--out", str(out), "--budget-s", "60",
                                      "--", "--rimuru-mode", "elastic"])
    try:
        run_one.main()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    res = json.loads((out / "q3elastic32d_cap.json").read_text())
    assert FakeServer.stopped and res["cut"] is True and res["stopped_at_budget"] is True
    assert ended == ["host"]  # the cut traffic's unused bench_serving is not left behind
    assert res["bench"] == {} and res["all_completed"] is False
    assert res["log"]["peak_running"] == 11
    assert res["card_cap_log"]["outside_mib_max"] == 1191.6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_bench_serving_runs_in_a_process_that_imported_it_beside_the_servers_start(tmp_path, monkeypatch):
    """run_one.py starts one warm_bench.py a phase with the server: it imports bench_serving's
    module then (~20 s of SGLang on the device) and runs its command line with the arguments
    handed over later; one the traffic never used is killed, not left behind. Here a stand-in
    ``sglang.benchmark.serving`` (first on the path) records what it was given."""
    run_one = _serving_module("run_one")
    _stub_bench(tmp_path, monkeypatch, f"print('{run_one.MAIN_RUN}', flush=True)\n"
                "print('argv', sys.argv[1:], 'waited', time.time() - IMPORTED > 0.5)")
    used, unused = run_one.warm_bench(), run_one.warm_bench()
    time.sleep(1.0)  # the server's start: the hosts have imported and wait
    began: list = []
    out, err = run_one.bench_serving(["--port", "1", "--num-prompts", "2"], 30, began, used)
    assert "argv ['--port', '1', '--num-prompts', '2'] waited True" in out, err
    assert used.returncode == 0 and len(began) == 1
    assert unused.poll() is None
    run_one.end_unused([used, unused, None])
    assert unused.returncode is not None and unused.returncode != 0  # killed while it waited


def test_phased_traffic_on_cpu(tmp_path, model_dir):
    """run_one.py --phases: one server, one bench_serving run per phase from disjoint slices
    of the dataset, each phase's figures and the aggregate over every request; report.py's
    phase table (and no traffic floor: a phased run has no one rate)."""
    model = str(ensure_model("tiny-qwen2-moe-q15-ratio", cache_dir=model_dir))
    data = sharegpt_file(tmp_path / "sharegpt.json", 12)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench/serving/run_one.py"), "--name", "phased_cpu", "--model", model,
           "--card-gb", "0", "--device-flags", "", "--phases", "2:3,8:6", "--dataset", str(data),
           "--context-len", "512", "--out", str(out), "--budget-s", "240", "--",
           "--rimuru-mode", "static", "--rimuru-pool-gb", f"{POOL_GB:.9f}", "--context-length", "512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "phased_cpu.json").read_text())
    assert res["all_completed"] and res["num_prompts"] == 9 and res["rate"] is None, res["bench_log_tail"]
    assert [(p["rate"], p["num_prompts"], p["completed"]) for p in res["phases"]] == [(2.0, 3, 3), (8.0, 6, 6)]
    b = res["bench"]
    assert b["completed"] == 9 and b["median_ttft_ms"] > 0 and b["median_tpot_ms"] > 0
    assert b["total_output_tokens"] == sum(p["total_output_tokens"] for p in res["phases"])
    assert b["duration"] == pytest.approx(sum(p["duration"] for p in res["phases"]))
    assert (out / "phased_cpu_bench_phase1.jsonl").exists() and (out / "phased_cpu_bench_phase2.jsonl").exists()

    lens = tmp_path / "lens.json"  # any lens file: a phased run gets no floor whatever it holds
    lens.write_text("[[10, 10]]")
    rep = subprocess.run([sys.executable, str(ROOT / "bench/serving/report.py"), str(out / "phased_cpu.json"),
                          "--floor-step-ms", "--lens", str(lens)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    assert "| phased_cpu | 0 GB | 9/9 |" in rep.stdout
    assert "| phased_cpu | 2 | 8 | 6/6 |" in rep.stdout
    assert "- (phased traffic)" in rep.stdout


def test_a_run_from_before_the_digest_gets_its_commits_marked_as_recovered(tmp_path):
    """A run JSON without ``code_digest`` takes the digest of the commit its folder's
    CODE_DIGEST.json names, else of its name's ``_<commit>`` tag, marked as recovered (``*``
    in the targets' digest line); a run's own digest wins; a tag that is no commit says
    nothing."""
    cd, report = _serving_module("code_digest"), _serving_module("report")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    want = cd.commit_digest("HEAD", ROOT)
    tagged, own, bogus = tmp_path / f"elastic32_{head}.json", tmp_path / "off32.json", tmp_path / "x_0000000.json"
    assert cd.run_digest(tagged, {}) == (want, "recovered from the name's commit")
    assert cd.run_digest(own, {"code_digest": "aaaaaaaaaaaa"}) == ("aaaaaaaaaaaa", "run")
    assert cd.run_digest(own, {}) == (None, "")
    assert cd.run_digest(bogus, {}) == (None, "")
    sub = tmp_path / "session"
    sub.mkdir()
    (sub / "CODE_DIGEST.json").write_text(json.dumps({"commit": "HEAD", "why": "test"}))
    assert cd.run_digest(sub / "off32.json", {}) == (want, "recovered from CODE_DIGEST.json")
    for path, digest in ((sub / "off32.json", None), (sub / "elastic32.json", "aaaaaaaaaaaa")):
        r = _run(path.stem, 32, 1000.0, digest=digest)
        path.write_text(json.dumps(r))
    runs = report.load([str(sub / "off32.json"), str(sub / "elastic32.json")])
    assert [(r["code_digest"], r.get("code_digest_source")) for r in runs] == [
        (want, "recovered from CODE_DIGEST.json"), ("aaaaaaaaaaaa", None)]
    table = _serving_module("targets").targets_table(runs, 3.75, tmp_path / "missing.json")
    assert (f"the pool modes at one digest, `aaaaaaaaaaaa`: elastic32; SGLang's own path (mode off, "
            f"`--cpu-offload-gb`) at `{want}`: off32*") in table
    assert "- `*`: the run predates code_digest.py" in table


def test_a_pair_across_two_server_codes_is_flagged():
    """A pair whose runs ran different server code (both digests known) says so in its row;
    one digest, or an unknown one, does not."""
    targets = _serving_module("targets")
    rs = [_run("off32", 32, 1000.0, digest="aaaaaaaaaaaa"), _run("elastic32", 32, 1050.0, digest="bbbbbbbbbbbb"),
          _run("off32-skew", 32, 1000.0, skew=1, digest="aaaaaaaaaaaa"), _run("elastic32-skew", 32, 1030.0, skew=1)]
    table = targets.targets_table(rs, 3.75, Path("/nonexistent/lens.json"))
    pairs = {_cells(r)[2] for r in _rows(table, "at no rate below 0.97x plain")}
    assert pairs == {"elastic32 / off32 (two server codes)", "elastic32-skew / off32-skew"}


def test_the_ablation_row_names_each_step_and_the_copy_variant_pairs_with_no_target():
    """Issue 12's ablation on one traffic: static (pool only), elastic32copy (+ adjuster,
    stopped at its budget here: its decode log against plain's bench_serving figure), elastic
    (+ paged kernel), each against plain.
    The copy variant is not elastic mode as shipped: it makes no row of the plain targets."""
    targets = _serving_module("targets")
    rs = [_run("off32-skew_r20", 32, 1000.0, rate=20, skew=1, running=30, queued=200, log_rate=1000.0),
          _run("static32-skew_r20", 32, 900.0, rate=20, skew=1),
          _run("elastic32copy-skew_r20", 32, rate=20, skew=1, log_rate=400.0),
          _run("elastic32-skew_r20", 32, 1450.0, rate=20, skew=1, running=70)]
    table = targets.targets_table(rs, 3.75, Path("/nonexistent/lens.json"))
    [row] = _rows(table, "ablation: pool only, + adjuster, + paged kernel")
    assert _cells(row)[2:] == [
        "static32-skew_r20 / elastic32copy-skew_r20 / elastic32-skew_r20 against off32-skew_r20",
        "pool only (static32-skew_r20): 900 tok/s, 0.90x plain; + adjuster (elastic32copy-skew_r20): 400 tok/s, "
        "~0.40x (decode log / bench_serving) plain; + paged kernel (elastic32-skew_r20): 1450 tok/s, 1.45x plain",
        "measured"]
    assert "elastic32copy" not in "\n".join(_rows(table, "at no rate below 0.97x plain"))
    assert targets.system_of({"name": "elastic32copy"}) == "elastic_copy"
    incomplete = targets.targets_table(rs[2:], 3.75, Path("/nonexistent/lens.json"))
    [row] = _rows(incomplete, "ablation: pool only, + adjuster, + paged kernel")
    assert _cells(row)[3].startswith("pool only: not run; ") and _cells(row)[4] == "incomplete"


#: nvidia-smi's two queries on a two-GPU machine during a TP=2 run (per_rank.SMI_GPUS,
#: SMI_APPS): one scheduler process per GPU, a third GPU the run does not use, and a row
#: with no figure (nvidia-smi prints [N/A] where it has none)
SMI_GPUS_OUT = "0, GPU-aaaa, 21500\n1, GPU-bbbb, 22900\n2, GPU-cccc, [N/A]\n"
SMI_APPS_OUT = "4101, GPU-aaaa, 20980\n4102, GPU-bbbb, 22310\n4103, GPU-bbbb, 300\n4104, GPU-zzzz, 999\n"


def test_each_gpu_is_its_own_card_at_tp2():
    """At --tp-size 2 each rank's GPU is an emulated card: the sampler keeps each GPU's peak
    and its largest process's, and the card check reads the fullest GPU, never the sum of
    two (which would put every TP=2 run over a 24 GB card) nor GPU 0 alone."""
    per_rank, run_one = _serving_module("per_rank"), _serving_module("run_one")
    used, largest = per_rank.parse_smi(SMI_GPUS_OUT, SMI_APPS_OUT)
    assert used == {0: 21500, 1: 22900}  # GPU 2's [N/A] is no 0
    assert largest == {0: 20980, 1: 22310}  # the process on an unlisted GPU is left out
    s = run_one.GpuSampler()
    s.add_sample(1.0, used, largest)
    s.add_sample(1.5, {0: 23000, 1: 22000}, {0: 22400, 1: 21900})
    assert s.peak_gpu_mib_by_gpu == {0: 23000, 1: 22900}
    assert s.peak_process_mib_by_gpu == {0: 22400, 1: 22310}
    assert (s.peak_gpu_mib, s.peak_process_mib) == (23000, 22400)
    assert s.samples == [(1.0, 22900), (1.5, 23000)]
    assert per_rank.parse_smi("", "") == ({}, {})  # no GPU: nothing made up
    one = run_one.GpuSampler()
    assert (one.peak_gpu_mib, one.peak_process_mib) == (0, 0)
    targets = _serving_module("targets")
    card24 = {"card_gib": 24.0, "peak_gpu_mib": s.peak_gpu_mib, "peak_process_mib": s.peak_process_mib}
    assert not targets.over_card(card24)  # each GPU within 24 GiB (their sum, 45,900 MiB, is not a card)
    card24["peak_gpu_mib"] = 24 * 1024
    assert not targets.over_card(card24)  # exactly the card is within it...
    card24["peak_gpu_mib"] += 1
    assert targets.over_card(card24)  # ...one MiB more on either GPU is not


def _trace_line(seq: int, t: float, evicted, restored, sets) -> str:
    """One adjuster trace line as the elastic controller writes it (the fields compared)."""
    return json.dumps({"t": t, "round": 1000 + seq, "seq": seq, "reason": "kv_short", "evicted": evicted,
                       "restored": restored, "resident": sum(len(v) for v in sets.values()),
                       "resident_sets": {str(k): v for k, v in sets.items()}})


def test_the_ranks_traces_are_compared_line_for_line(tmp_path):
    """TP rank k > 0 writes TRACE.tpk: the same seq, evictions, restores and resident sets as
    rank 0 on every line both wrote (its own wall time and round counter may differ; a rank
    stopped before its last line is compared up to it); the first line that differs is named."""
    run_one = _serving_module("run_one")
    trace = tmp_path / "elastic_tp2_trace.jsonl"
    sets = [{0: [0, 1, 2], 1: [0, 1, 3]}, {0: [0, 1], 1: [0, 1, 3]}, {0: [0, 1], 1: [1, 3]}]
    orders = [(1, [[0, 2]], []), (2, [[1, 0]], []), (3, [], [[1, 0]])]
    rank0 = [_trace_line(s, 10.0 + s, e, r, sets[i]) for i, (s, e, r) in enumerate(orders)]
    rank1 = [_trace_line(s, 10.3 + s, e, r, sets[i]) for i, (s, e, r) in enumerate(orders[:2])]
    trace.write_text("\n".join(rank0) + "\n")
    lines0 = run_one.read_jsonl(trace)
    assert run_one.rank_traces(trace, lines0) is None  # TP = 1: rank 0's trace alone
    (tmp_path / "elastic_tp2_trace.jsonl.tp1").write_text("\n".join(rank1) + "\n")
    (tmp_path / "elastic_tp2_trace.jsonl.tp1.steps.jsonl").write_text("{}\n")  # rank 1's step record: no rank
    assert run_one.rank_traces(trace, lines0) == {"ranks": 2, "rounds": [3, 2], "compared": 2,
                                                  "orders_identical": True, "first_difference_seq": None}
    drifted = {0: [0, 1], 1: [0, 3]}  # rank 1 evicted another expert of layer 1 at seq 2
    rank1[1] = _trace_line(2, 12.3, [[1, 1]], [], drifted)
    (tmp_path / "elastic_tp2_trace.jsonl.tp1").write_text("\n".join(rank1) + "\n")
    assert run_one.rank_traces(trace, lines0) == {"ranks": 2, "rounds": [3, 2], "compared": 2,
                                                  "orders_identical": False, "first_difference_seq": 2}


def test_the_report_sets_each_rank_beside_its_card():
    """The report's TP table: one row per run at --tp-size > 1, each GPU's peak against the
    card, the ranks' trace lines and their agreement; runs at TP = 1 make no table."""
    per_rank = _serving_module("per_rank")
    tp2 = {"name": "tp2elastic", "card_gib": 24.0,
           "server_args": ["--tp-size", "2", "--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "64"],
           "peak_gpu_mib_by_gpu": {"1": 22900, "0": 23000}, "peak_process_mib_by_gpu": {"0": 22400, "1": 22310},
           "tp_traces": {"ranks": 2, "rounds": [41, 40], "compared": 40, "orders_identical": True,
                         "first_difference_seq": None}}
    off = {"name": "tp2off", "card_gib": 24.0, "server_args": ["--tp-size", "2", "--cpu-offload-gb", "12"],
           "peak_gpu_mib_by_gpu": {"0": 20480, "1": 20992}, "peak_process_mib_by_gpu": {"0": 20000, "1": 20500},
           "tp_traces": None}
    assert per_rank.rank_table([{"name": "elastic32", "card_gib": 32.0, "server_args": []}]) is None
    lines = per_rank.rank_table([tp2, off, {"name": "elastic32", "card_gib": 32.0, "server_args": []}]).splitlines()
    assert lines[2:] == ["| tp2elastic | 2 | 22.5 / 22.4 / 24 | 21.9 / 21.8 | 41 / 40 | yes, 40 lines |",
                         "| tp2off | 2 | 20.0 / 20.5 / 24 | 19.5 / 20.0 | - | - |"]
    tp2["tp_traces"] = {**tp2["tp_traces"], "orders_identical": False, "first_difference_seq": 7}
    assert per_rank.rank_table([tp2]).splitlines()[2].endswith("| 41 / 40 | **no**: first at seq 7 |")
    tp2["tp_traces"] = None  # an elastic run whose ranks wrote no trace says so; mode off has none to write
    assert per_rank.rank_table([tp2]).splitlines()[2].endswith("| no trace | no trace |")


def test_run_one_at_tp2_on_cpu_sets_the_ranks_traces_side_by_side(tmp_path, model_dir):
    """Issue 14's harness end to end on CPU: an elastic server at --tp-size 2 under a burst
    its 200 KV tokens cannot hold (the elastic tests' flags), so both ranks evict and
    restore; the JSON compares rank 1's trace (TRACE.tp1) with rank 0's line for line and
    the report gives the TP table. Under independent routings (--router-noise 1) each rank
    draws its own noise: SGLang seeds both alike and they draw alike, so both ranks route
    every forward by the same draws (their tallies, rank against rank)."""
    model = str(ensure_model("tiny-qwen3-moe", cache_dir=model_dir))
    data = tmp_path / "burst.json"
    data.write_text(json.dumps([{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"request {i}: " + "word " * 30},
        {"from": "gpt", "value": "It is calm and blue today, friend. " * 3}]} for i in range(16)]))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench/serving/run_one.py"), "--name", "tp2elastic_cpu", "--model", model,
           "--card-gb", "0", "--device-flags", "", "--rate", "16", "--num-prompts", "16", "--dataset", str(data),
           "--context-len", "512", "--out", str(out), "--budget-s", "240", "--router-noise", "1", "--",
           "--tp-size", "2", "--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4",
           "--max-total-tokens", "200", "--context-length", "512"]
    tally = tmp_path / "tally"
    tally.mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "SGLANG_RIMURU_CHECK_INVARIANTS": "1",
                               "RIMURU_BENCH_ROUTER_TALLY": str(tally)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "tp2elastic_cpu.json").read_text())
    assert res["all_completed"] and res["tracebacks"] == 0, res["bench_log_tail"]
    assert res["trace"]["evicted"] > 0 and res["trace"]["restored"] > 0
    tt = res["tp_traces"]
    assert tt["ranks"] == 2 and tt["orders_identical"] and tt["first_difference_seq"] is None
    # at the server's stop rank 1 may not have written its line for the last order yet
    assert tt["compared"] == min(tt["rounds"]) >= max(tt["rounds"]) - 1 and tt["compared"] >= 2
    assert res["peak_gpu_mib_by_gpu"] == {} and res["peak_gpu_mib"] == 0  # no nvidia-smi: nothing sampled
    # the two ranks' draws, forward by forward (one may have run a forward more at the stop)
    ranks = sorted((f.read_text().splitlines() for f in tally.iterdir()), key=len)
    assert len(ranks) == 2 and len(ranks[0]) >= 50 and ranks[1][:len(ranks[0])] == ranks[0]
    assert len(ranks[1]) - len(ranks[0]) <= 2 * max(int(line.split()[0]) for line in ranks[1]) + 2
    sums = [line.split()[-1] for line in ranks[0]]
    assert len(set(sums)) > 0.9 * len(sums)  # fresh draws every forward and layer
    rep = subprocess.run([sys.executable, str(ROOT / "bench/serving/report.py"), str(out / "tp2elastic_cpu.json")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    rounds = " / ".join(map(str, tt["rounds"]))
    assert f"| tp2elastic_cpu | 2 | - / 0 | - | {rounds} | yes, {tt['compared']} lines |" in rep.stdout


def test_the_offload_sweep_trades_more_copies_a_pass_for_more_kv(monkeypatch):
    """SGLang's offloader copies every offloaded byte each pass, so a setting's estimate is
    the measured rate times the batch its KV admits over the bytes it copies; the batch stops
    at the traffic's requests, and a run without --cpu-offload-gb is refused by name."""
    sweep_mod = _serving_module("offload_sweep")
    run = {"name": "offload24", "model": "q15", "num_prompts": 150, "server_args": ["--cpu-offload-gb", "8"],
           "log": {"kv_tokens": 13_000, "peak_running": 20, "gen_tok_s_mean": 100.0}}
    kv_token = sweep_mod.shape_of(run).kv_bytes_per_token
    assert kv_token == 24 * 16 * 128 * 2 * 2  # 196,608 B: 24 layers, 16 KV heads of 128, K and V, bf16
    # 24 x 60 experts of 17,301,504 B: 23.2 GiB
    assert sweep_mod.default_settings(run) == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    q3 = sweep_mod.default_settings({**run, "model": "q3", "server_args": ["--cpu-offload-gb", "35"]})
    assert 35 in q3 and q3[-1] == 54  # the run's own setting; 48 x 128 experts of 9 MiB: 54 GiB
    res = sweep_mod.sweep(run, [4, 8, 16, 24])
    rows = {r["gb"]: r for r in res["estimate"]}
    assert res["kv_tokens_per_request"] == 650.0
    assert rows[8] == {"gb": 8, "kv_tokens": 13_000, "running": 20.0, "tok_s": 100.0}
    kv16 = 13_000 + 8 * 2**30 / kv_token  # 8 GiB more of KV: 43,690.67 tokens
    assert rows[16]["kv_tokens"] == round(kv16) and rows[16]["running"] == round(kv16 / 650, 1)
    assert rows[16]["tok_s"] == round(100.0 * (kv16 / 650) / 20 * 8 / 16, 1)
    assert rows[24]["running"] == 150 and rows[24]["tok_s"] == round(100.0 * 150 / 20 * 8 / 24, 1)
    assert rows[4] == {"gb": 4, "kv_tokens": 0, "running": 0, "tok_s": 0.0}  # 4 GiB back on the GPU: no KV left
    assert res["best"]["gb"] == 24  # 250 tok/s: 7.5x the batch for 3x the bytes; 16 GiB: 4.37x for 2x
    with pytest.raises(SystemExit, match="no --cpu-offload-gb"):
        sweep_mod.sweep({**run, "server_args": []}, [8])


def test_the_card_rule_divides_by_the_gpu_it_runs_on(monkeypatch):
    """An H100 lent for the H200 emulates the same card: the fraction is the card over the
    GPU's own total by nvidia-smi; without nvidia-smi, the H200's as before."""
    run_one = _serving_module("run_one")
    assert run_one.card_fraction(24, 81_559) == round(0.886 * 24 * 1024 / 81_559, 4) == 0.267
    assert run_one.card_fraction(24) == 0.1515
    monkeypatch.setattr(run_one.subprocess, "run", lambda *a, **k: SimpleNamespace(
        stdout="NVIDIA H100 80GB HBM3, 81559\n"))
    assert run_one.this_gpu() == {"name": "NVIDIA H100 80GB HBM3", "total_mib": 81_559}

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(run_one.subprocess, "run", missing)
    assert run_one.this_gpu() == {"name": None, "total_mib": 143_771}


#: the lines an elastic server logs (Qwen1.5 shape: three pages an expert; two load buffers of 40 experts)
POOL_LOG = ("[2026-12-05 04:14:42] sglang-rimuru elastic pool: 15.000 GiB in 3000 expert pages of 5767168 B; "
            "1000 resident experts (40-44 of 60 per layer x 24 layers), load buffers 2 x 40, KV now 127 tokens, "
            "at most 80000; 1440 experts (23.2 GiB) in host memory, at most 59 a layer out of the pool "
            "(--rimuru-expert-offload-limit); ranking: expert index order\n"
            "[2026-12-05 04:18:15] Decode batch, #running-req: 46, #token: 23000, token usage: 0.95\n"
            "[2026-12-05 04:18:16] Decode batch, #running-req: 4, #token: 9000, token usage: 0.95\n"
            "[2026-12-05 04:18:21] Decode batch, #running-req: 50, #token: 15000, token usage: 0.87\n")


def test_the_card_bound_tries_every_split_the_offload_limit_allows(tmp_path):
    """The bound is the split and batch with the most decode tok/s by the run's own step line:
    free reads want the fewest experts resident (the largest batch), dear reads every expert
    that leaves a request room; the decode log gives the tokens a running request holds."""
    cb = _serving_module("card_bound")
    pool = cb.pool_of(POOL_LOG)
    assert pool == {"pages": 3000, "page_bytes": 5_767_168, "load_buffer_experts": 80, "offload_limit": 59}
    assert cb.tokens_per_request(POOL_LOG) == [500.0, 300.0]  # the line with 4 running is left out
    run = {"name": "elastic24d", "model": "q15", "num_prompts": 500, "router_skew": 0.0, "server_args": [],
           "trace": {"cost_ms": {"base": 5.9, "per_request": 0.17, "expert": 0.0}}}
    shared = 920 * 17_301_504  # the pool (1000 experts' bytes) less its load buffers' 80 experts
    free = cb.card_bound(run, POOL_LOG, None, [400.0])
    assert free["shared_bytes"] == shared and free["tokens_per_request_measured"] == [300, 500]
    # reads cost nothing: 24 resident (one a layer, the limit), KV of 896 experts at 88 tokens each
    row = free["rows"][0]
    assert row["resident"] == 24 and row["batch"] == int(896 * 17_301_504 / 196_608 / 400) == 197
    assert row["tok_s"] == round(197 / (5.9 + 0.17 * 197) * 1e3, 1)
    # the traffic's 150 requests cap the batch
    capped = cb.card_bound({**run, "num_prompts": 150}, POOL_LOG, None, [400.0])["rows"][0]
    assert capped["batch"] == 150 and capped["tok_s"] == round(150 / (5.9 + 0.17 * 150) * 1e3, 1)
    # reads dearer than any request is worth: every expert stays that leaves one request's KV
    dear = cb.card_bound({**run, "trace": {"cost_ms": {"base": 5.9, "per_request": 0.17, "expert": 1e6}}},
                         POOL_LOG, None, [400.0])["rows"][0]
    most = 920 - -(-400 * 196_608 // 17_301_504)  # 920 pages less the 5 one request's 400 tokens need
    assert dear["resident"] == most == 915 and dear["batch"] == 1 and dear["reads"] > 0
    # uniform routing: the 525 experts out are each read with touched(4/60, 1) by a step of one
    assert dear["reads"] == round((1440 - 915) * touched(4 / 60, 1), 1)
    with pytest.raises(SystemExit, match="no 'elastic pool:' line"):
        cb.pool_of("Decode batch, #running-req: 46, #token: 23000")
    with pytest.raises(SystemExit, match="skewed run needs its ranking"):
        cb.card_bound({**run, "router_skew": 1.0}, POOL_LOG, None, [400.0])


def test_the_card_bound_takes_the_logged_fit_where_no_expert_moved():
    """A run whose adjuster never ordered a move has no trace.cost_ms: the last fit its log
    reports prices the bound; a run with neither is refused by name."""
    cb = _serving_module("card_bound")
    log = POOL_LOG + ("[2026-12-04 16:06:34] sglang-rimuru cost-aware adjuster: decode step 6.21 ms + 0.067 ms per "
                      "request + 0.344 ms per offloaded expert read (512 timed steps)\n"
                      "[2026-12-04 16:07:35] sglang-rimuru cost-aware adjuster: decode step 5.12 ms + 0.170 ms per "
                      "request + 0.344 ms per offloaded expert read (512 timed steps)\n")
    run = {"name": "elastic32", "trace": {"rounds": 0, "cost_ms": None}}
    assert cb.cost_of(run, log) == {"base": 5.12, "per_request": 0.17, "expert": 0.344}
    moved = {"base": 3.28, "per_request": 0.184, "expert": 0.253}
    assert cb.cost_of({"trace": {"cost_ms": moved}}, log) is moved
    with pytest.raises(SystemExit, match="no fitted step line"):
        cb.cost_of(run, POOL_LOG)


def test_priced_out_rounds_of_a_stored_run_asked_again_of_todays_adjuster():
    """bench/serving/priced_out.py on the H100 run whose queue waited at full batch
    (bench/RESULTS.md, twenty-ninth session): its pool (8,529 pages of 3 MiB, 272,927 KV
    tokens) and resident sets rebuilt from its trace, each logged priced-out round handed
    to plan_round. At 125.8 s (261 running, 81 waiting, R_b 32) the 11 victims gain less
    than the margin and today's adjuster carries them on as the first step of a larger
    move; at 216.8 s, with 10 waiting, no larger move clears it. The 24 GB skewed Qwen1.5
    run's rounds stay priced out."""
    po = _serving_module("priced_out")
    rows = po.replay(ROOT / "bench/results/device_h100_2026-12-05f/q3elastic32d_cap")
    by_s = {r["s"]: r for r in rows}
    assert [r["s"] for r in rows] == [33.8, 64.8, 94.8, 125.8, 155.8, 186.8, 216.8]
    assert {k: by_s[125.8][k] for k in ("running", "waiting", "r_b", "out", "evicts", "reason", "larger_move")} == {
        "running": 261, "waiting": 81, "r_b": 32, "out": 4772, "evicts": 11, "reason": "kv_short", "larger_move": True}
    assert (by_s[216.8]["evicts"], by_s[216.8]["reason"], by_s[216.8]["larger_move"]) == (0, "priced_out", False)
    skew = po.replay(ROOT / "bench/results/device_h200_2026-12-04d/elastic24d-skew")
    assert [(r["evicts"], r["reason"]) for r in skew] == [(0, "priced_out")]


def test_the_copy_engine_bound_moves_every_offloaded_expert_and_pays_for_its_buffers():
    """card_bound.staged_bound (a path not built): each step moves every expert out at the
    copy rate, hidden behind the resident step as far as it lasts, and two buffers of the
    largest layer's out set, beyond the pool's load buffers, leave less room for KV."""
    from sglang_rimuru.adjuster.cost import CostModel

    cb = _serving_module("card_bound")
    probs = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]  # two layers of three experts
    cost = CostModel(expert_ms=0.0, base_ms=1.0, per_request_ms=0.0)
    # 1,000 B an expert, 10,000 B for experts and KV, 100 B a request (10 tokens of 10 B)
    args = dict(expert_bytes=1000, kv_bytes=10_000, kv_token=10, least=0, requests=1000, tokens=10)
    # a fast copy: every step takes the resident 1 ms, so the most KV wins: everything out, and
    # the buffers (2 x 3 experts) less the pool's 2 load-buffer experts leave 10,000 - 4,000 B
    fast = cb.staged_bound(probs, cost, copy_gbps=1.0, load_buffer_experts=2, **args)
    assert (fast["resident"], fast["moved"], fast["staging_experts"], fast["batch"]) == (0, 6, 4, 60)
    assert fast["step_ms"] == 1.0 and fast["tok_s"] == 60_000.0
    no_buffers = cb.staged_bound(probs, cost, copy_gbps=1.0, load_buffer_experts=0, **args)
    assert (no_buffers["staging_experts"], no_buffers["batch"]) == (6, 40)
    # a slow copy, 1 ms an expert: keep all but the least probable (layer 1's 0.1), whose
    # buffers the load buffers hold: 5,000 B of KV, 50 requests, one expert moved in 1 ms
    slow = cb.staged_bound(probs, cost, copy_gbps=1e-3, load_buffer_experts=2, **args)
    assert (slow["resident"], slow["moved"], slow["staging_experts"], slow["batch"]) == (5, 1, 0, 50)
    assert (slow["copy_ms"], slow["step_ms"], slow["tok_s"]) == (1.0, 1.0, 50_000.0)
    # equal probabilities stay resident one layer after another, as the residency manager
    # spreads them: 2 resident of 2 x 4 leave 3 out in each layer (buffers of 2 x 3, KV for
    # 20 requests); filled layer by layer they would leave 4 out in one, and no KV at all
    uniform = [[0.25] * 4, [0.25] * 4]
    even = cb.staged_bound(uniform, cost, copy_gbps=1.0, load_buffer_experts=0, **{**args, "least": 2})
    assert (even["resident"], even["moved"], even["staging_experts"], even["batch"]) == (2, 6, 6, 20)


def test_report_plots_the_pool_split_and_the_rate_sweep_of_stored_runs(tmp_path):
    """report.py --plots on stored H200 runs (skewed, 32 GB, plain against elastic at 1, 5 and
    10 req/s): one split plot (named with its server code) for the run with an adjuster trace
    that moved experts, and the rate sweep with the traffic's ceiling; each a PNG."""
    report = _serving_module("report")
    r = ROOT / "bench/results/device_h200_2026-12-05"
    runs = report.load([str(r / f"{n}.json") for n in ("elastic32-skew", "elastic32-skew_r1", "off32-skew",
                                                        "off32-skew_r1", "off32-skew_r5")])
    made = report.plots(runs, tmp_path, step_ms=3.75)
    assert [p.name for p in made] == ["elastic32-skew_split_4c0917dbaac6.png", "rate_sweep.png"]
    for p in made:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # the same setting and code on an H100 (thirty-third session) does not overwrite the H200's plot
    h100 = report.load([str(ROOT / "bench/results/device_h100_2026-12-06/elastic24d.json")])
    assert [p.name for p in report.plots(h100, tmp_path, step_ms=3.75)] == ["elastic24d_split_H100_f5c7aed6cf59.png"]


def test_priced_out_reads_the_price_a_servers_line_carries():
    """The price the controller appends to a priced-out line (price_text) is what
    priced_out.py reads back: the same numbers, for a gain under the margin and for
    victims that admit none."""
    from sglang_rimuru.adjuster import EvictionPrice
    from sglang_rimuru.adjuster.controller import price_text

    po = _serving_module("priced_out")
    head = ("[2026-12-06 10:00:00] sglang-rimuru round 7: eviction priced out (R_b=32; 3 rounds so far): the "
            "offloaded experts' PCIe time per decode step would cost more than the requests it admits (running "
            "261, waiting 81); SGLang queues or retracts instead")
    under = price_text(EvictionPrice(267, 2, 11, 0.3079, 0.3094, 474.2, False), 0.01)
    assert under == ("; priced at batch 267: 11 experts out admit 2, 307.9 -> 309.4 decode tok/s (+0.49 %, "
                     "margin 1 %), a larger move does not pay; 474 KV pages a running request")
    assert po.PRICED_OUT.search(head + under)["rb"] == "32"
    assert po.logged_price(head + under) == {"batch": 267, "victims": 11, "admits": 2, "reference_tok_s": 307.9,
                                             "after_tok_s": 309.4, "gain_pct": 0.49, "larger_move": False}
    none = price_text(EvictionPrice(305, 36, 36, 0.3, None, 400.0, None), 0.01)
    assert po.logged_price(head + none) == {"batch": 305, "victims": 36, "admits": None}
    assert po.logged_price(head) is None


def test_the_warmup_steps_before_the_traffic_give_each_machines_read_rate(tmp_path):
    """warmup_reads.py: the batch-1 steps the step record holds before the traffic began
    (not the traffic's own, whatever their batch), their median, the reads over it in GB/s
    at the model's expert bytes (Qwen3: 9 MiB), and the kernel the start line named; a
    warm-up that reads almost nothing gives no rate."""
    import gzip

    wr = _serving_module("warmup_reads")
    mib9 = 3 * 768 * 2048 * 2
    records = [{"t": 990.0, "steps": [[1, 40.0, 200.0], [1, 44.0, 200.0]]},
               {"t": 999.5, "steps": [[1, 42.0, 200.0]]},
               {"t": 1001.0, "steps": [[1, 10.0, 200.0], [30, 500.0, 3000.0]]}]  # after the traffic began
    base = tmp_path / "q3elastic32d_cap"
    with gzip.open(f"{base}_trace.steps.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    with gzip.open(f"{base}.log.gz", "wt") as f:
        f.write("[2026-12-06 00:27:00] sglang-rimuru elastic pool: ...; MoE kernel: auto -> no tuned table of "
                "the fast kernel for this shape on this GPU: exact (SGLang's configs, ...)\n")
    run = {"name": "q3elastic32d_cap", "model": "q3", "traffic_began_wall": 1000.0, "code_digest": "abc"}
    w = wr.warmup_rate(run, base)
    assert (w["steps"], w["reads"], w["median_ms"], w["kernel"]) == (3, 200.0, 42.0, "exact")
    assert w["GBps"] == round(200 * mib9 / 42e6, 1)
    assert wr.lone_warmup(records, 1000.0) == {"steps": 3, "reads": 200.0, "median_ms": 42.0}  # run_one's "warmup"
    records[0]["steps"] = [[1, 4.0, 0.2]] * 3  # a ranking kept every expert it reads
    records[1]["steps"] = []
    with gzip.open(f"{base}_trace.steps.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    assert wr.warmup_rate(run, base)["GBps"] is None
    assert wr.kernel_of("MoE kernel: fast (configs E=128,N=768,device_name=NVIDIA_H200.json; ...)") == "fast"
    # the H100's start line (thirty-third session): the reason holds a colon before the choice
    assert wr.kernel_of("MoE kernel: auto -> no tuned table for this shape on this GPU, here or in SGLang: the "
                        "kernel's default table (BLOCK_K >= 64, where ...): fast (configs default.json; ...)") == "fast"
    assert wr.kernel_of("1043 resident; MoE kernel: auto -> no tuned table: other; ranking: x") is None


def test_the_traffics_reading_steps_by_batch_band_compare_machines_whose_warmup_reads_nothing(tmp_path, capsys):
    """warmup_reads.py --bands: the traffic's steps that read offloaded experts (not the
    warm-up's, not the resident ones), by batch band of 16: median ms and median reads."""
    import gzip

    wr = _serving_module("warmup_reads")
    records = [{"t": 990.0, "steps": [[1, 4.0, 0.0]] * 3},  # the warm-up: reads nothing
               {"t": 1001.0, "steps": [[5, 6.0, 0.0], [5, 7.0, 0.5], [12, 9.0, 1.5], [14, 8.0, 1.0]]},
               {"t": 1002.0, "steps": [[40, 13.0, 11.0], [48, 15.0, 12.0], [33, 14.0, 10.0], [49, 16.0, 19.0]]}]
    assert wr.reading_bands(records, 1000.0) == [
        {"batch": "1-16", "steps": 3, "median_ms": 8.0, "reads": 1.0},
        {"batch": "33-48", "steps": 3, "median_ms": 14.0, "reads": 11.0},
        {"batch": "49-64", "steps": 1, "median_ms": 16.0, "reads": 19.0}]
    assert wr.reading_bands(records, 2000.0) == []  # every step before the traffic
    base = tmp_path / "elastic32-skew-ind_r20"
    with gzip.open(f"{base}_trace.steps.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "elastic32-skew-ind_r20.json").write_text(json.dumps(
        {"name": "elastic32-skew-ind_r20", "model": "q15", "traffic_began_wall": 1000.0}))
    wr.print_bands([str(base)])
    out = capsys.readouterr().out
    assert "| 1-16 | 33-48 | 49-64 |" in out
    assert f"| elastic32-skew-ind_r20 | {tmp_path.name} | 8.0 / 1.0 | 14.0 / 11.0 | 16.0 / 19.0 |" in out


def test_zero_copy_scale_takes_either_models_moe_layer():
    """bench/kernel/zero_copy_scale.py --shape: every size the script derives follows the
    layer it is pointed at (Qwen1.5-MoE-A2.7B's expert is 16.5 MiB, Qwen3-30B-A3B's 9)."""
    from tests.conftest import bench_module

    zcs = bench_module("kernel/zero_copy_scale.py")
    try:
        zcs.set_shape("qwen1.5")
        assert (zcs.E, zcs.I, zcs.TOP_K, zcs.EXPERT_BYTES) == (60, 1408, 4, 16.5 * 2**20)
    finally:
        zcs.set_shape("qwen3")
    assert (zcs.E, zcs.I, zcs.TOP_K, zcs.EXPERT_BYTES) == (128, 768, 8, 9 * 2**20)


def test_step_fit_replays_a_step_record_both_ways():
    """step_fit.py: on steps that follow the resident curve in routed experts (a ramp at
    batch 1-20, then a burst at 30-64 reading offloaded experts at 0.5 ms), the curve's fit
    predicts the burst's steps and the line through the ramp over-predicts them."""
    from sglang_rimuru.adjuster.cost import RoutedExperts

    sf = _serving_module("step_fit")
    routed = RoutedExperts(zipf_layer() * 24)
    resident = lambda b: 3.0 + 0.01 * routed(b)  # noqa: E731
    steps = [(1 + i % 20, resident(1 + i % 20), 0.0) for i in range(300)]
    # the burst's batch grows slowly, as a queue's does: the tangent stays near it
    steps += [(b, resident(b) + 0.5 * 0.2 * b, 0.2 * b) for b in (30 + i // 18 for i in range(630))]
    res = sf.replay(steps, (5.9, 0.17, 0.34), routed, refit=256)
    bands = {row["batch"]: row for row in res["bands"]}
    assert bands["49-64"]["curve"] == pytest.approx(1.0, abs=0.02)
    assert bands["49-64"]["line"] > 1.15
    assert res["median_abs_error"]["curve"] < res["median_abs_error"]["line"]
