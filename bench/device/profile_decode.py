"""Where a decode step's GPU time goes, at a fixed batch, in a served model (H200).

    python3 bench/device/profile_decode.py --model /tmp/models/q3 --card-gb 32 --batch 100 \\
        --out $OUT/profile_q3 -- --rimuru-mode elastic

Starts the server as ``bench/serving/run_one.py`` does (dummy weights, the card's
``--mem-fraction-static``, ``--chunked-prefill-size 2048``, the device flags), sends
``--batch`` concurrent greedy requests of ``--prompt-tokens`` tokens that decode
``--new-tokens`` each (ignore_eos), waits ``--warm-s`` for the batch to be decoding
alone, then has SGLang's own profiler (``/start_profile``, torch profiler with CUPTI:
the kernels a CUDA graph replays are recorded one by one) record ``--steps`` steps.

Prints, and writes to OUT/summary.json: the profiled span, the time some kernel or
copy ran (the union of their intervals; the rest is the GPU idle, waiting for the
host), and the busiest kernels by total time. The step record's GPU ms brackets a
whole forward with CUDA events, so it cannot tell a slow kernel from a GPU waiting on
the host; this can.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from run_one import DEVICE_FLAGS, card_fraction  # noqa: E402
from sglang_rimuru.serving import start_local_server  # noqa: E402


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def numa_pages_mib(pid: int, numa_maps: str = "/proc/{pid}/numa_maps") -> dict[str, int]:
    """MiB of host memory on each NUMA node, over process ``pid`` and its children (the
    scheduler holds the pinned experts): which node the in-place reads come from."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return {}
    pages: dict[str, int] = defaultdict(int)
    for p in procs:
        try:
            text = open(numa_maps.format(pid=p.pid)).read()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split()
            size = 4096
            for f in fields:
                if f.startswith("kernelpagesize_kB="):
                    size = int(f.split("=")[1]) * 1024
            for f in fields:
                if f[:1] == "N" and "=" in f and f[1:].split("=")[0].isdigit():
                    node, n = f.split("=")
                    pages[node] += int(n) * size
    return {node: b >> 20 for node, b in sorted(pages.items())}


def summarize(trace_path: Path, top: int = 15) -> dict:
    """Kernel and copy time of a Chrome trace written by torch's profiler (microseconds)."""
    opener = gzip.open if trace_path.suffix == ".gz" else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not gpu:
        return {"trace": trace_path.name, "gpu_events": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        by_name[f"{e['cat']}: {e['name'][:90]}"].append(float(e["dur"]))
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "trace": trace_path.name, "gpu_events": len(gpu),
        "span_ms": round((t1 - t0) / 1e3, 3),
        "busy_ms": round(busy_union(spans) / 1e3, 3),
        # a kernel's calls can differ (the MoE's gate-up and down GEMMs share one name):
        # the median and the largest call say more than the mean
        "top": [{"name": k, "count": len(d), "total_ms": round(sum(d) / 1e3, 3),
                 "median_us": round(sorted(d)[len(d) // 2], 1), "max_us": round(max(d), 1)}
                for k, d in rows[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--card-gb", type=float, default=32)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--prompts", choices=("text", "random"), default="text",
                    help="text: one repeated phrase (similar hidden states, so routing concentrates on few "
                         "experts); random: uniform random token ids (near-uniform routing, as ShareGPT "
                         "traffic gives on dummy weights)")
    ap.add_argument("--warm-s", type=float, default=60)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--activities", default="GPU", help="the profiler's, comma separated (CPU for a dry run)")
    ap.add_argument("--device-flags", default=" ".join(DEVICE_FLAGS))
    ap.add_argument("--out", required=True)
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--model-path", args.model, "--load-format", "dummy", "--chunked-prefill-size", "2048",
             "--cuda-graph-max-bs", "160", *args.device_flags.split(),
             *[a for a in args.server_args if a != "--"]]
    if args.card_gb > 0:
        flags += ["--mem-fraction-static", str(card_fraction(args.card_gb))]
    if "elastic" in flags:
        flags += ["--rimuru-adjuster-trace", str(out / "trace.jsonl")]
    t_launch = time.time()
    srv = start_local_server(flags, out / "server.log", timeout=600)
    print(f"ready in {time.time() - t_launch:.0f} s", flush=True)
    try:
        # distinct prompts (no shared prefix to cache) of about --prompt-tokens tokens each
        sampling = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
        if args.prompts == "random":
            g = random.Random(0)
            prompts = [[g.randrange(1000, 100_000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
            body = lambda p: {"input_ids": p, "sampling_params": sampling}
        else:
            prompts = [f"{i} " + "lorem ipsum dolor " * (args.prompt_tokens // 4) for i in range(args.batch)]
            body = lambda p: {"text": p, "sampling_params": sampling}
        pool = cf.ThreadPoolExecutor(args.batch)
        futs = [pool.submit(requests.post, srv.url + "/generate", json=body(p), timeout=3600) for p in prompts]
        time.sleep(args.warm_s)
        numa = numa_pages_mib(srv.proc.pid)
        print("host memory by NUMA node (MiB):", numa, flush=True)
        r = requests.post(srv.url + "/start_profile", json={"output_dir": str(out), "num_steps": args.steps,
                                                             "activities": args.activities.split(",")}, timeout=600)
        print("start_profile:", r.status_code, r.text[:200], flush=True)
        deadline = time.time() + 300
        traces: list[Path] = []
        while time.time() < deadline:
            traces = sorted(out.glob("*.trace.json*"))
            if traces and all(t.stat().st_size > 0 for t in traces):
                size = [t.stat().st_size for t in traces]
                time.sleep(3)
                if size == [t.stat().st_size for t in traces]:
                    break
            time.sleep(2)
        res = {"batch": args.batch, "steps": args.steps, "server_args": flags, "numa_mib": numa,
               "traces": [summarize(t) for t in traces]}
        (out / "summary.json").write_text(json.dumps(res, indent=1))
        for t in res["traces"]:
            print(f"{t['trace']}: {t.get('gpu_events')} GPU events; span {t.get('span_ms')} ms over "
                  f"{args.steps} steps, busy {t.get('busy_ms')} ms")
            for row in t.get("top", []):
                print(f"  {row['total_ms']:10.3f} ms  {row['count']:6d}  median {row['median_us']:9.1f} us"
                      f"  max {row['max_us']:9.1f} us  {row['name']}")
        pool.shutdown(wait=False, cancel_futures=True)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
