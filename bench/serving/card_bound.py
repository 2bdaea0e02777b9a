"""The most decode tok/s any split of a card's pool can reach, from one elastic run.

    python3 bench/serving/card_bound.py RUN.json [--tokens-per-request 300 400 500] [--ranking FILE]
                                        [--vs TOK_S] [--read-gbps G] [--copy-gbps G] [--out FILE.json]

Issue 12 asks, where a target is missed, for what limits it in bytes per step
against the PCIe ceiling. On a card that cannot hold the model a decode step of
``B`` requests reads every offloaded expert it routes to in place over PCIe, so
with ``n`` experts resident (the most probable ones: for a given count no other
set reads less) it takes, by the cost model's own arithmetic
(``sglang_rimuru.adjuster.cost``) and the line the run fitted to its own steps::

    step(n, B) = base + per_request * B + expert_ms * sum over the experts out of touched(p, B)

and the pool's bytes left by those ``n`` experts hold ``B = KV / L`` requests of
``L`` tokens each (at most the traffic's requests). This script tries every
``n`` the offload limit allows and reports, for each ``L``, the split and batch
whose ``B / step`` is largest: the decode bound of that card. Every state a
serving run reaches is one of these, so its decode tok/s stays under it, and its
output tok/s further under it by the prefill passes between the steps.

Inputs, all from the run: the model's shape (its JSON's ``model``), the pool's
bytes and load buffers (its log's "elastic pool:" line, ``NAME.log.gz`` beside
the JSON), the step line and read price (``trace.cost_ms``: the adjuster's last
fit; its log's last fit where it moved no expert), the routing (the ranking file its server read, ``--rimuru-expert-ranking``,
or uniform ``top_k / E`` where it read none and ran the dummy routers unskewed).
``L``: the tokens a running request holds; its decode log's ``#token`` over
``#running-req`` gives the range on its traffic. ``--read-gbps`` prices a read at a measured
in-place rate instead (the adjuster's fit averages its window's batches, and a full batch reads
slower than a small one: thirty-third session). ``--copy-gbps`` adds the bound of a copy-engine
path that is not built (``staged_bound``), to say what it could buy over reading in place.
Writes ``--out`` (JSON) and prints the tables. No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_log import read_log  # noqa: E402
from offload_sweep import shape_of  # noqa: E402
from sglang_rimuru.adjuster.cost import CostModel  # noqa: E402

#: "elastic pool: 25.122 GiB in 8575 expert pages of 3145728 B; ... load buffers 2 x 72, ..."
POOL_LINE = re.compile(r"elastic pool: [\d.]+ GiB in (\d+) expert pages of (\d+) B; .*?"
                       r"load buffers (\d+) x (\d+).*?at most (\d+) a layer out of the pool")
#: "cost-aware adjuster: decode step 5.12 ms + 0.170 ms per request + 0.344 ms per offloaded expert read"
FIT_LINE = re.compile(r"cost-aware adjuster: decode step ([\d.]+) ms \+ ([\d.]+) ms per request \+ ([\d.]+) ms per "
                      r"offloaded expert read")
#: "Decode batch, #running-req: 46, #token: 22934, ..."
DECODE_LINE = re.compile(r"#running-req: (\d+), #token: (\d+)")


def pool_of(log: str) -> dict:
    """The pool's expert pages, their bytes, the load buffers' experts (two buffers of
    ``--rimuru-load-buffer-slots`` experts each) and the offload limit."""
    m = POOL_LINE.search(log)
    if not m:
        raise SystemExit("card_bound.py: no 'elastic pool:' line in the run's log (a pool-mode run is needed)")
    pages, page_bytes, buffers, per_buffer, limit = map(int, m.groups())
    return {"pages": pages, "page_bytes": page_bytes, "load_buffer_experts": buffers * per_buffer,
            "offload_limit": limit}


def cost_of(run: dict, log: str) -> dict:
    """The step line and read price the run's adjuster last priced an order with
    (``trace.cost_ms``), else the last fit its log reports (a run that moved no expert)."""
    cost = (run.get("trace") or {}).get("cost_ms")
    if cost:
        return cost
    fits = FIT_LINE.findall(log)
    if not fits:
        raise SystemExit("card_bound.py: the run has no fitted step line (no trace.cost_ms, no 'cost-aware "
                         "adjuster: decode step' line in its log): was it run with the cost-aware policy?")
    base, per, expert = map(float, fits[-1])
    return {"base": base, "per_request": per, "expert": expert}


def tokens_per_request(log: str) -> list[float]:
    """``#token / #running-req`` of each decode-log line with at least 8 running."""
    pairs = ((int(m[1]), int(m[2])) for m in DECODE_LINE.finditer(log))
    return [tokens / running for running, tokens in pairs if running >= 8]


def probabilities(run: dict, shape, ranking_path: Path | None) -> list[list[float]]:
    """Per layer, the per-token probability of each expert (summing to top_k)."""
    if ranking_path is None:
        if run.get("router_skew"):
            raise SystemExit("card_bound.py: a skewed run needs its ranking (--ranking, or the server's "
                             "--rimuru-expert-ranking under bench/results/)")
        return [[shape.top_k / shape.num_experts] * shape.num_experts for _ in range(shape.num_layers)]
    layers = json.loads(ranking_path.read_text())["layers"]
    out = []
    for lid in sorted(layers, key=int):
        w = layers[lid]["probability"]
        out.append([p * shape.top_k / sum(w) for p in w])
    return out


def ranking_of(run: dict) -> Path | None:
    """The ranking file the run's server read, found again under this checkout's bench/results/."""
    args = run["server_args"]
    if "--rimuru-expert-ranking" not in args:
        return None
    path = args[args.index("--rimuru-expert-ranking") + 1]
    return ROOT / ("bench/results/" + path.split("bench/results/", 1)[1]) if "bench/results/" in path else Path(path)


def bound(desc: list[float], cost: CostModel, expert_bytes: int, kv_bytes: int, kv_token: int,
          least: int, requests: int, tokens: float) -> dict:
    """The resident count and batch with the most decode tok/s at ``tokens`` a request;
    ``desc``: every expert's per-token probability, high to low; ``least``: the fewest
    resident the offload limit allows."""
    best = None
    for n in range(max(0, least), len(desc) + 1):
        kv = kv_bytes - n * expert_bytes
        if kv < tokens * kv_token:
            break  # fewer out, less KV: not one request fits from here on
        batch = min(requests, int(kv / kv_token / tokens))
        reads = cost.expected_reads(desc[n:], batch)
        step = cost.step_ms(batch) + reads * cost.expert_ms
        tok_s = batch / step * 1e3
        if best is None or tok_s > best["tok_s"]:
            best = {"tokens_per_request": tokens, "resident": n, "batch": batch, "reads": round(reads, 1),
                    "step_ms": round(step, 2), "tok_s": round(tok_s, 1),
                    "read_gb_per_step": round(reads * expert_bytes / 1e9, 2)}
    return best or {"tokens_per_request": tokens, "resident": None, "batch": 0, "tok_s": 0.0}


def staged_bound(probs: list[list[float]], cost: CostModel, expert_bytes: int, kv_bytes: int, kv_token: int,
                 least: int, requests: int, tokens: float, copy_gbps: float, load_buffer_experts: int) -> dict:
    """The same bound for a copy-engine path that is not built (bench/README, "not built"):
    each step moves *every* offloaded expert by DMA at ``copy_gbps`` (routing is not known to
    the host under a CUDA graph) into two staging buffers of the largest layer's out set, one
    layer ahead, hidden behind compute as far as it lasts:
    ``step = max(resident step, out x bytes / copy_gbps)``, an upper bound of such a path.
    Its buffers come out of the pool beyond the load buffers it already holds, so each split
    leaves less KV than in place. ``probs``: per layer, each expert's per-token probability."""
    # the most probable first; equal ones (uniform routing) one layer after another, so that
    # the resident experts spread over the layers as the residency manager spreads them
    order = sorted(((p, rank, layer) for layer, ps in enumerate(probs)
                    for rank, p in enumerate(sorted(ps, reverse=True))), key=lambda x: (-x[0], x[1], x[2]))
    out = [len(ps) for ps in probs]  # per layer, experts out of the pool: every one at n = 0
    best = None
    for n in range(len(order) + 1):
        if n:
            out[order[n - 1][2]] -= 1  # the n-th most probable expert stays resident
        if n < max(0, least):
            continue
        staged = max(0, 2 * max(out) - load_buffer_experts)
        kv = kv_bytes - (n + staged) * expert_bytes
        if kv < tokens * kv_token:
            continue  # the buffers shrink as n grows: a later split may fit a request again
        batch = min(requests, int(kv / kv_token / tokens))
        moved = sum(out)
        copy_ms = moved * expert_bytes / (copy_gbps * 1e6)
        step = max(cost.step_ms(batch), copy_ms)
        tok_s = batch / step * 1e3
        if best is None or tok_s > best["tok_s"]:
            best = {"tokens_per_request": tokens, "resident": n, "batch": batch, "moved": moved,
                    "staging_experts": staged, "copy_ms": round(copy_ms, 2), "step_ms": round(step, 2),
                    "tok_s": round(tok_s, 1), "copy_gb_per_step": round(moved * expert_bytes / 1e9, 2)}
    return best or {"tokens_per_request": tokens, "resident": None, "batch": 0, "tok_s": 0.0}


def card_bound(run: dict, log: str, ranking: Path | None, tokens: list[float],
               copy_gbps: float | None = None, read_gbps: float | None = None) -> dict:
    shape = shape_of(run)
    pool = pool_of(log)
    cost = dict(cost_of(run, log))
    if read_gbps:  # a measured in-place rate instead of the adjuster's last price
        cost["expert"] = shape.expert_bytes / (read_gbps * 1e6)
    # the pool's bytes less its load buffers: what experts and KV share
    shared = pool["pages"] * pool["page_bytes"] - pool["load_buffer_experts"] * shape.expert_bytes
    probs = probabilities(run, shape, ranking)
    desc = sorted((p for layer in probs for p in layer), reverse=True)  # the most probable stay first
    least = len(desc) - pool["offload_limit"] * len(probs)  # the offload limit keeps this many resident
    model = CostModel(expert_ms=cost["expert"], base_ms=cost["base"], per_request_ms=cost["per_request"])
    rows = [bound(desc, model, shape.expert_bytes, shared, shape.kv_bytes_per_token, least, run["num_prompts"], t)
            for t in tokens]
    staged = [staged_bound(probs, model, shape.expert_bytes, shared, shape.kv_bytes_per_token, least,
                           run["num_prompts"], t, copy_gbps, pool["load_buffer_experts"]) for t in tokens] \
        if copy_gbps else None
    held = tokens_per_request(log)
    return {"run": run["name"], "model": run.get("model"), "ranking": str(ranking.relative_to(ROOT))
            if ranking and ranking.is_relative_to(ROOT) else (str(ranking) if ranking else "uniform"),
            "copy_gbps": copy_gbps, "staged_rows": staged,
            "cost_ms": cost, "pool": pool, "shared_bytes": shared, "expert_bytes": shape.expert_bytes,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "tokens_per_request_measured": [round(min(held)), round(max(held))] if held else None,
            "rows": rows}


def main() -> None:
    from targets import rate_of  # beside this script

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a pool-mode run's JSON (bench/serving/run_one.py), its log beside it")
    ap.add_argument("--tokens-per-request", type=float, nargs="+", default=[300, 400, 500])
    ap.add_argument("--ranking", help="the routing's ranking file (default: the one the server read)")
    ap.add_argument("--vs", type=float, help="a baseline's tok/s: each bound and the run over it")
    ap.add_argument("--read-gbps", type=float,
                    help="price an in-place read at this rate instead of the adjuster's last fit (e.g. what the "
                         "run's step record read at full batch, which the fit over a window of batches averages; "
                         "a record's reads over its steps' time count the compute in, which the bound then adds "
                         "again: about the resident line's ms a step, 5-10 %% at full batch)")
    ap.add_argument("--copy-gbps", type=float,
                    help="also the bound of a copy-engine path (every offloaded expert staged by DMA at this "
                         "rate each step: zero_copy_scale.py's copy_ceiling_GBps of the machine)")
    ap.add_argument("--out", help="write the numbers here (JSON)")
    args = ap.parse_args()
    path = Path(args.run)
    run = json.loads(path.read_text())
    log_path = path.with_name(run["name"] + ".log.gz")
    if not log_path.exists():
        raise SystemExit(f"card_bound.py: no server log {log_path} beside the run")
    ranking = Path(args.ranking) if args.ranking else ranking_of(run)
    res = card_bound(run, read_log(log_path), ranking, args.tokens_per_request, args.copy_gbps, args.read_gbps)
    res["measured_tok_s"], res["measured_source"] = rate_of(run)
    res["vs"] = args.vs
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    held = res["tokens_per_request_measured"]
    cm = res["cost_ms"]
    print(f"{res['run']}: routing {res['ranking']}; step {cm['base']:.2f} ms + {cm['per_request']:.3f} a request "
          f"+ {cm['expert']:.3f} a read; {res['shared_bytes'] / 2**30:.2f} GiB for experts and KV; tokens a running "
          f"request holds (decode log, >= 8 running): {f'{held[0]}-{held[1]}' if held else 'no lines'}; "
          f"measured {res['measured_tok_s'] or 0:.1f} tok/s ({res['measured_source']})")
    vs = f" | bound / {args.vs:g} | measured / {args.vs:g}" if args.vs else ""
    print(f"| tokens a request | best resident | batch | expected reads | GB read a step | step ms | decode tok/s bound{vs} |")
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.vs else ""))
    for r in res["rows"]:
        extra = f" | {r['tok_s'] / args.vs:.2f}x | {res['measured_tok_s'] / args.vs:.2f}x" if args.vs else ""
        print(f"| {r['tokens_per_request']:g} | {r['resident']} | {r['batch']} | {r.get('reads', 0):.0f} | "
              f"{r.get('read_gb_per_step', 0):.2f} | {r.get('step_ms', 0):.1f} | {r['tok_s']:.0f}{extra} |")
    if res["staged_rows"]:
        print(f"\ncopy engine (not built): every offloaded expert staged by DMA at {args.copy_gbps:g} GB/s each step, "
              f"overlapped with compute, in two buffers of the largest layer's out set")
        print(f"| tokens a request | best resident | batch | experts moved | staging experts | GB moved a step | "
              f"copy ms | step ms | decode tok/s bound{f' | bound / {args.vs:g}' if args.vs else ''} | over in place |")
        print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.vs else ""))
        for r, inplace in zip(res["staged_rows"], res["rows"]):
            extra = f" | {r['tok_s'] / args.vs:.2f}x" if args.vs else ""
            print(f"| {r['tokens_per_request']:g} | {r['resident']} | {r['batch']} | {r.get('moved', 0)} | "
                  f"{r.get('staging_experts', 0)} | {r.get('copy_gb_per_step', 0):.2f} | {r.get('copy_ms', 0):.1f} | "
                  f"{r.get('step_ms', 0):.1f} | {r['tok_s']:.0f}{extra} | "
                  f"{r['tok_s'] / inplace['tok_s'] if inplace['tok_s'] else 0:.2f}x |")


if __name__ == "__main__":
    main()
