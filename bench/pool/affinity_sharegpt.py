"""Request affinity over a ShareGPT run: trapped KV pages and merge-back, before and after.

Serves a tiny model with a real model's expert-page / KV-page byte ratio in
``--rimuru-mode static`` on the CPU, sends the same ShareGPT requests to it once
without request affinity (``SGLANG_RIMURU_KV_AFFINITY=0``: SGLang's allocations
take the pool's plain order, as before issue 13) and once with it, and reads
the pooled allocator's trace (``SGLANG_RIMURU_KV_TRACE``: every allocation and
free, with the pool's counters after it). Reported per run:

* trapped KV pages (the pool's counter: free KV pages in expert pages that
  still hold used ones), time-weighted mean and max over the run, and its two
  parts: *stranded* (freed while a sibling is in use: DESIGN.md section 3's
  trapped space) and *room* (never used since the page was split: the unfilled
  end of the page a request is writing into);
* expert pages split into KV pages, and KV pages used, mean and max;
* merge-back: for each freed KV page, the time until its expert page holds no
  used KV page again (merged back into a whole expert page): the share that
  merged in the same free call, and the median / p90 / mean wait of the rest in
  seconds and in scheduler steps (KV allocations: one per prefill or decode
  batch); pages still waiting at the end are counted, not timed.

Two configurations: SGLang's radix cache on (its default: a finished request's
KV stays cached and is freed when evicted, least recently used first) and off
(``--disable-radix-cache``: freed when the request ends).

Prompts are the ShareGPT file's first human turns (``/work/shared/data``,
bench_serving's sample), tokenized by the tiny model's byte tokenizer and cut
to ``--max-prompt-tokens``; each request generates min(its ShareGPT reply
length, ``--max-output-tokens``) tokens, EOS ignored, greedy. Requests go out
in file order from ``--concurrency`` client threads (closed loop).

    python bench/pool/affinity_sharegpt.py --out bench/results/affinity_sharegpt_cpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path("/work/shared/data/sharegpt_1000_seed1_ctx8192.json.gz")


def load_requests(model_path: str, n: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    convs = json.load(gzip.open(DATA))[:n]
    lens = json.loads(Path(str(DATA).removesuffix(".gz") + ".lens.json").read_text())[:n]
    out = []
    for conv, (_, out_len) in zip(convs, lens):
        ids = tok(conv["conversations"][0]["value"], add_special_tokens=False)["input_ids"][:max_prompt]
        out.append((ids or [32], max(1, min(out_len, max_output))))
    return out


def send_all(url: str, reqs: list[tuple[list[int], int]], concurrency: int) -> dict:
    import requests

    def one(item):
        ids, n_out = item
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n_out, "temperature": 0.0,
                                                      "ignore_eos": True}}
        r = requests.post(url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return len(r.json()["output_ids"])

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(one, reqs))
    return {"requests": len(outs), "output_tokens": sum(outs), "prompt_tokens": sum(len(i) for i, _ in reqs),
            "wall_s": round(time.monotonic() - t0, 1)}


# ---------------------------------------------------------------- trace analysis


def analyze(trace: Path) -> dict:
    """Replay the allocator trace; see the module docstring for the figures.

    Trapped KV pages (the pool's counter) are split in two: *room*, free KV pages
    of a split expert page that nobody has used since it was split (the unfilled
    end of the page a request is writing into), and *stranded*, KV pages freed
    while a sibling is still in use (DESIGN.md section 3's "trapped" space).
    """
    from sglang_rimuru.pool import PoolGeometry

    lines = trace.read_text().splitlines()
    head = json.loads(lines[0])
    g = PoolGeometry(total_bytes=head["total_bytes"], expert_page_bytes=head["expert_page_bytes"],
                     kv_page_bytes=head["kv_page_bytes"])
    e_of = g.expert_page_of_kv_page
    used: dict[int, int] = defaultdict(int)
    seen: dict[int, set[int]] = {}  # split expert page -> KV ids used since it was split
    tot = {"cap": 0, "seen": 0, "used": 0}  # over split expert pages

    def take(k: int) -> None:
        j = e_of(k)
        if used[j] == 0:
            seen[j] = set()
            tot["cap"] += len(g.kv_pages_of_expert_page(j))
        used[j] += 1
        tot["used"] += 1
        if k not in seen[j]:
            seen[j].add(k)
            tot["seen"] += 1

    for k in head["held_at_start"]:
        take(k)
    pending: dict[int, list[tuple[float, int, int]]] = defaultdict(list)  # page -> (t, step, free call)
    waits_s, waits_steps, at_once = [], [], 0
    call_left: dict[int, int] = {}  # free call -> its pages still waiting
    call_t: dict[int, tuple[float, int]] = {}
    call_done: dict[int, tuple[float, int]] = {}
    series = []  # (t, trapped, kv_split, used, room, stranded)
    steps = 0
    events = [json.loads(x) for x in lines[1:]]
    for t, _step, op, ids, trapped, kv_split in events:
        if op == "a":
            steps += 1
            for k in ids:
                take(k)
        else:
            call = len(call_t)
            call_t[call], call_left[call] = (t, steps), len(ids)
            merged = set()
            for k in ids:
                j = e_of(k)
                used[j] -= 1
                tot["used"] -= 1
                pending[j].append((t, steps, call))
                if used[j] == 0:
                    merged.add(j)
            for j in merged:
                tot["cap"] -= len(g.kv_pages_of_expert_page(j))
                tot["seen"] -= len(seen.pop(j))
                for t0, s0, c in pending.pop(j):
                    if c == call:
                        at_once += 1
                    else:
                        waits_s.append(t - t0)
                        waits_steps.append(steps - s0)
                    call_left[c] -= 1
                    if call_left[c] == 0:
                        call_done[c] = (t - call_t[c][0], steps - call_t[c][1])
        mine = (tot["cap"] - tot["used"], len(seen))
        if mine != (trapped, kv_split):  # the replay must agree with the pool's own counters
            raise AssertionError(f"replay disagrees with the pool at t={t}: (trapped, split) {mine} vs "
                                 f"{(trapped, kv_split)}")
        series.append((t, trapped, kv_split, tot["used"], tot["cap"] - tot["seen"], tot["seen"] - tot["used"]))

    def stat(col: int) -> dict:
        total = sum((b[0] - a[0]) * a[col] for a, b in zip(series, series[1:]))
        span = series[-1][0] - series[0][0]
        mean = total / span if span > 0 else series[0][col]
        return {"mean": round(mean, 1), "max": max(s[col] for s in series)}

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0

    freed = at_once + len(waits_s) + sum(len(v) for v in pending.values())
    calls = len(call_t)
    split, kv_used = stat(2), stat(3)
    return {
        "events": len(events),
        "steps": steps,
        "trapped_kv_pages": stat(1),
        "trapped_room": stat(4),
        "trapped_stranded": stat(5),
        "kv_split_expert_pages": split,
        "kv_pages_used": kv_used,
        "kv_pages_per_split_expert_page": round(kv_used["mean"] / max(split["mean"], 1e-9), 2),
        "merge_back": {
            "freed_kv_pages": freed,
            "merged_at_once": round(at_once / max(freed, 1), 3),
            "merged_later": len(waits_s),
            "still_waiting_at_end": freed - at_once - len(waits_s),
            "wait_s": {"median": round(q(waits_s, 0.5), 2), "p90": round(q(waits_s, 0.9), 2),
                       "mean": round(statistics.fmean(waits_s), 2) if waits_s else 0.0},
            "wait_steps": {"median": q(waits_steps, 0.5), "p90": q(waits_steps, 0.9),
                           "mean": round(statistics.fmean(waits_steps), 1) if waits_steps else 0.0},
            "free_calls": calls,
            "free_calls_whole_at_once": round(sum(1 for s, _ in call_done.values() if s == 0) / max(calls, 1), 3),
            "free_calls_whole_by_end": round(len(call_done) / max(calls, 1), 3),
        },
    }


# ---------------------------------------------------------------- runs


def run_variant(name: str, affinity: bool, server_args: list[str], concurrency: int, model_path: str, reqs,
                workdir: Path) -> dict:
    from sglang_rimuru.serving import start_local_server

    trace = workdir / f"{name}.trace.jsonl"
    trace.unlink(missing_ok=True)
    env = {"SGLANG_RIMURU_KV_TRACE": str(trace), "SGLANG_RIMURU_KV_AFFINITY": "1" if affinity else "0"}
    srv = start_local_server(["--model-path", model_path, *server_args], workdir / f"{name}.log", timeout=600,
                             env=env)
    try:
        load = send_all(srv.url, reqs, concurrency)
    finally:
        srv.stop()
    log = srv.log()
    if "Traceback" in log:
        raise RuntimeError(f"{name}: the server log has a traceback ({workdir / (name + '.log')})")
    result = {"affinity": affinity, **load, "retractions": log.count("retract"), **analyze(trace)}
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return sha.strip() + ("+dirty" if dirty else "")


CONFIGS = {"radix": [], "no-radix": ["--disable-radix-cache"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen2-moe-q15-ratio")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--server-args", default="--rimuru-mode static --rimuru-resident-experts 4 "
                    "--rimuru-expert-offload-limit 4 --max-total-tokens 4096 --max-running-requests 32 "
                    "--context-length 1024")
    ap.add_argument("--configs", default="radix,no-radix",
                    help="radix: SGLang's radix cache on (its default); no-radix: --disable-radix-cache")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep", type=Path, help="keep traces and server logs here")
    args = ap.parse_args()

    from sglang_rimuru.models import ensure_model

    model_path = str(ensure_model(args.model))
    reqs = load_requests(model_path, args.num_prompts, args.max_prompt_tokens, args.max_output_tokens)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="affinity_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for config in args.configs.split(","):
        extra = CONFIGS[config]
        results[config] = {
            name: run_variant(f"{config}-{name}", name == "after", [*args.server_args.split(), *extra],
                              args.concurrency, model_path, reqs, workdir)
            for name in ("before", "after")
        }
    report = {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": f"{os.cpu_count()} CPU cores shared with other developers' jobs, no GPU ({platform.node()})",
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]]),
        "model": args.model,
        "workload": {"sharegpt": str(DATA), "num_prompts": args.num_prompts,
                     "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens,
                     "concurrency": args.concurrency, "server_args": args.server_args,
                     "configs": {c: CONFIGS[c] for c in results}},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
