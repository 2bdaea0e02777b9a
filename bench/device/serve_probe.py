"""Probe a running server at a real model shape: greedy ids, a long prefill, decode step times.

    python3 bench/device/serve_probe.py URL OUT.json [--long-tokens 4700] [--batches 1,8,32]

Reads ``/server_info`` first (the KV capacity: a decode batch whose requests
do not all fit in it is not a batch of that size; ``probe_summary.py`` marks it).
Sends (greedy, ignore_eos):
  * one short prompt, 32 new tokens (its ids are compared across modes);
  * one prompt of about ``--long-tokens`` tokens (the prefill that crashed the
    pool modes at 0dafc5d), 8 new tokens;
  * for each batch size B: B concurrent requests of 128 new tokens; the decode
    step time is the wall time of the batch's last 96 tokens / 96 (the first 32
    cover prefill and ramp-up), i.e. the time per step at batch B.
Writes everything to OUT.json and prints one line per part.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

import requests


def generate(url: str, text, max_new_tokens: int, timeout: float = 900) -> dict | list:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                              "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def stream_times(url: str, text: str, max_new_tokens: int) -> tuple[list[float], int | None]:
    """Arrival time of each streamed chunk (one per decode step when nothing is batched away),
    and the prompt's token count (from the last chunk's meta_info)."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    times, last = [], None
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                times.append(time.perf_counter())
                last = line
    try:
        prompt_tokens = json.loads(last[len(b"data:"):])["meta_info"]["prompt_tokens"]
    except (TypeError, ValueError, KeyError):
        prompt_tokens = None
    return times, prompt_tokens


def decode_step(url: str, batch: int, new_tokens: int = 128, skip: int = 32) -> dict:
    prompts = [f"request {i}: tell me about paged experts and unified pools, part {i}." for i in range(batch)]
    with cf.ThreadPoolExecutor(batch) as ex:
        results = list(ex.map(lambda p: stream_times(url, p, new_tokens), prompts))
    runs = [t for t, _ in results]
    prompt_tokens = [n for _, n in results if n is not None]
    # per request: the time between chunk `skip` and the last, over the steps between
    per_step = [(t[-1] - t[skip]) / (len(t) - 1 - skip) for t in runs if len(t) > skip + 8]
    per_step.sort()
    return {"batch": batch, "requests": len(runs), "chunks": [len(t) for t in runs][:4],
            "new_tokens": new_tokens,
            "kv_tokens_needed": sum(prompt_tokens) + new_tokens * len(runs) if prompt_tokens else None,
            "step_ms_median": 1e3 * per_step[len(per_step) // 2] if per_step else None,
            "step_ms_min": 1e3 * per_step[0] if per_step else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--long-tokens", type=int, default=4700)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure every batch this many times, in rounds (1, 8, 32, 1, 8, 32, ...); a batch's "
                         "step time is the median of its rounds, and step_ms_rounds keeps each")
    args = ap.parse_args()
    res: dict = {"errors": {}}

    def part(name, fn):
        """One part of the probe; a failure is recorded and the others still run."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{name}: FAILED {res['errors'][name]}", flush=True)

    def server():
        info = requests.get(args.url + "/server_info", timeout=30).json()
        keys = ("max_total_num_tokens", "max_req_input_len", "context_length", "cuda_graph_max_bs",
                "disable_cuda_graph")
        res["server"] = {k: info.get(k) for k in keys}
        print("server:", res["server"], flush=True)

    def short():
        t = time.perf_counter()
        res["short_ids"] = generate(args.url, "The unified page pool of a mixture of experts", 32)["output_ids"]
        res["short_s"] = time.perf_counter() - t
        print("short:", round(res["short_s"], 3), "s", res["short_ids"][:8], flush=True)

    def long():
        info = requests.get(args.url + "/server_info", timeout=30).json()
        limit = int(info.get("max_req_input_len") or info.get("context_length") or args.long_tokens)
        want = min(args.long_tokens, limit - 64)  # a prompt the server accepts
        text = " ".join(f"w{i % 997}" for i in range(want * 10 // 38))  # ~3.8 Qwen tokens a word
        t = time.perf_counter()
        out = generate(args.url, text, 8)
        res["long"] = {"prompt_tokens": out["meta_info"]["prompt_tokens"], "ids": out["output_ids"],
                       "s": time.perf_counter() - t}
        print("long prefill:", res["long"]["prompt_tokens"], "tokens,", round(res["long"]["s"], 2), "s", flush=True)

    def batch16():
        prompts = [f"prompt {i}: " + "tokens " * (i % 5 + 1) + chr(65 + i) for i in range(16)]
        res["batch16_ids"] = [o["output_ids"] for o in generate(args.url, prompts, 16)]

    part("server", server)
    part("short", short)
    part("long", long)
    part("batch16", batch16)
    batches = [int(x) for x in args.batches.split(",")]
    rounds: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(args.repeats):
        for b in batches:
            def one(b=b, r=r):
                d = decode_step(args.url, b)
                rounds[b].append(d)
                print(f"decode batch {b}{f' (round {r + 1})' if args.repeats > 1 else ''}: "
                      f"{d['step_ms_median']:.3f} ms/step (min {d['step_ms_min']:.3f})", flush=True)
            part(f"decode{b}" + (f"_round{r + 1}" if args.repeats > 1 else ""), one)
    res["decode"] = [combine_rounds(ds) for ds in rounds.values() if ds]
    json.dump(res, open(args.out, "w"), indent=1)


def combine_rounds(ds: list[dict]) -> dict:
    """One batch's rounds as one entry: the first round's fields (requests, chunks, KV
    needed: the same each round), the step time the median over rounds, the fastest
    request's time of any round, and every round's median and their spread beside it."""
    meds = sorted(d["step_ms_median"] for d in ds if d.get("step_ms_median") is not None)
    if not meds:
        return ds[0]
    mid = meds[len(meds) // 2] if len(meds) % 2 else 0.5 * (meds[len(meds) // 2 - 1] + meds[len(meds) // 2])
    return {**ds[0], "step_ms_median": mid, "step_ms_min": min(d["step_ms_min"] for d in ds if d.get("step_ms_min")),
            "step_ms_rounds": [d.get("step_ms_median") for d in ds],
            "round_spread": (meds[-1] - meds[0]) / mid if mid else None}


if __name__ == "__main__":
    main()
