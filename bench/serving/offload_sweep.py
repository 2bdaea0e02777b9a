"""What SGLang's ``--cpu-offload-gb`` would serve at other settings, from one measured run.

    python3 bench/serving/offload_sweep.py RUN.json [--gb 8 12 16 20 24] [--vs ELASTIC.json ...] [--out FILE.json]

Issue 12 compares the pool modes with *the best* ``--cpu-offload-gb`` setting. A run
at one setting is not that: SGLang 0.5.17's offloader (``OffloaderV1``,
``sglang/srt/utils/offloader.py``) keeps whole parameters in pinned host memory and
copies every one of them to the GPU in every forward pass, whatever the batch. So a
pass costs about the offloaded bytes over PCIe, and what offloading more buys is KV:
each GiB more off the GPU is ``2**30 / kv_bytes_per_token`` more tokens in SGLang's
pool (its static budget is fixed by ``--mem-fraction-static``), so more requests
share each of those passes. Where the run's batch was held by its KV (a queue waiting),
output throughput scales about as

    tok/s(X) = tok/s(X0) * running(X) / running(X0) * X0 / X
    running(X) = min(requests, kv_tokens(X) / (kv_tokens(X0) / running(X0)))

(``X`` GiB offloaded; the fixed compute of a pass, ~10 ms against hundreds of ms of
copies, is left out, which understates the larger settings a little). The run gives
``X0`` (its server flags), ``kv_tokens`` (SGLang's ``max_total_num_tokens``), its peak
running and SGLang's decode-log tok/s; the model shape gives the KV bytes a token.

This is an estimate to choose the settings to measure and to say how far a single
setting can be from the best one; it is no measurement of them. ``--vs`` prints the
pool runs' tok/s against the measured setting and the best estimate (``targets.rate_of``:
bench_serving's where the run finished, else its pass record). Writes ``--out`` (JSON) and prints a table.
No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang_rimuru.models.specs import get_spec, moe_shape  # noqa: E402

#: the run JSON's "model" (the folder bench/serving/h200.sh unpacks) -> the project's model spec
MODELS = {"q15": "qwen1.5-moe-a2.7b", "q3": "qwen3-30b-a3b"}


def model_of(r: dict) -> str:
    """``q3`` (Qwen3-30B-A3B shape) or ``q15`` (Qwen1.5-MoE): the JSON's model (since
    code_digest.py) or the name's prefix (older runs)."""
    if r.get("model"):
        return "q3" if r["model"] == "q3" else "q15"
    return "q3" if r["name"].startswith("q3") else "q15"


def shape_of(run: dict):
    """The run's model shape (``MoeShape``: KV bytes a token, routed experts' bytes)."""
    return moe_shape(get_spec(MODELS[model_of(run)]).config)


def default_settings(run: dict) -> list[float]:
    """The run's own setting and every 2 GiB up to the routed experts' GiB (SGLang offloads
    whole layers' parameters in order; past the experts' bytes little is left to move)."""
    top = int(shape_of(run).routed_expert_bytes / 2**30)
    return sorted({offload_gb(run["server_args"]), *range(2, top + 1, 2)})


def offload_gb(server_args: list[str]) -> float:
    """The run's ``--cpu-offload-gb``; a clear error for a run without it."""
    if "--cpu-offload-gb" not in server_args:
        raise SystemExit("offload_sweep.py: the run has no --cpu-offload-gb (an SGLang offload run is needed)")
    return float(server_args[server_args.index("--cpu-offload-gb") + 1])


def sweep(run: dict, settings: list[float] | None = None) -> dict:
    """The estimate for each of ``settings`` (GiB offloaded; default_settings') from one
    measured offload run, and the best of them."""
    settings = settings or default_settings(run)
    x0 = offload_gb(run["server_args"])
    log = run["log"]
    kv0, running0, tok_s0 = log["kv_tokens"], log["peak_running"], log["gen_tok_s_mean"]
    if not (kv0 and running0 and tok_s0):
        raise SystemExit(f"offload_sweep.py: {run['name']} lacks SGLang's KV size, peak running or decode log")
    kv_token = shape_of(run).kv_bytes_per_token
    per_request = kv0 / running0  # the KV SGLang's admission gave each running request
    rows = []
    for x in settings:
        kv = kv0 + (x - x0) * 2**30 / kv_token
        if kv <= 0:
            rows.append({"gb": x, "kv_tokens": 0, "running": 0, "tok_s": 0.0})
            continue
        running = min(run["num_prompts"], kv / per_request)
        rows.append({"gb": x, "kv_tokens": round(kv), "running": round(running, 1),
                     "tok_s": round(tok_s0 * running / running0 * x0 / x, 1)})
    best = max(rows, key=lambda r: r["tok_s"])
    return {"run": run["name"], "measured": {"gb": x0, "kv_tokens": kv0, "peak_running": running0, "tok_s": tok_s0},
            "kv_bytes_per_token": kv_token, "kv_tokens_per_request": round(per_request, 1),
            "requests": run["num_prompts"], "estimate": rows, "best": best}


def main() -> None:
    from targets import rate_of  # beside this script; targets.py imports this module

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="an SGLang --cpu-offload-gb run's JSON (bench/serving/run_one.py)")
    ap.add_argument("--gb", type=float, nargs="+", help="settings to estimate (default: the run's and every 2 GiB "
                    "up to the routed experts' GiB)")
    ap.add_argument("--vs", nargs="*", default=[], help="pool runs' JSON on the same traffic")
    ap.add_argument("--out", help="write the numbers here (JSON)")
    args = ap.parse_args()
    run = json.loads(Path(args.run).read_text())
    res = sweep(run, sorted(set(args.gb)) if args.gb else None)
    res["vs"] = []
    for path in args.vs:
        other = json.loads(Path(path).read_text())
        tok_s, source = rate_of(other)
        res["vs"].append({"run": other["name"], "tok_s": tok_s, "source": source,
                          "vs_measured": round(tok_s / res["measured"]["tok_s"], 2),
                          "vs_best_estimate": round(tok_s / res["best"]["tok_s"], 2)})
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    m = res["measured"]
    print(f"{res['run']}: measured {m['gb']:g} GiB offloaded, {m['kv_tokens']} KV tokens, peak running "
          f"{m['peak_running']}, {m['tok_s']} tok/s (decode log); {res['kv_tokens_per_request']} KV tokens a "
          f"running request, {res['requests']} requests; ESTIMATES, not measurements:")
    print("| --cpu-offload-gb | KV tokens | running | tok/s (estimate) |\n|---|---|---|---|")
    for r in res["estimate"]:
        print(f"| {r['gb']:g}{' (measured)' if r['gb'] == m['gb'] else ''} | {r['kv_tokens']:,} | {r['running']} | {r['tok_s']} |")
    for v in res["vs"]:
        print(f"{v['run']}: {v['tok_s']:.1f} tok/s ({v['source']}) = {v['vs_measured']}x the measured setting, "
              f"{v['vs_best_estimate']}x the best estimate ({res['best']['gb']:g} GiB)")


if __name__ == "__main__":
    main()
