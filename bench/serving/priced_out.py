"""A pool-mode run's priced-out rounds, asked again of this checkout's adjuster.

    python bench/serving/priced_out.py RUN_DIR/NAME [RUN_DIR/NAME ...] [--out FILE.json]

An elastic server with the cost-aware policy logs, at most every 30 s, a round
whose eviction it priced out: "eviction priced out (R_b=32; 44 rounds so far) ...
(running 261, waiting 81)". This script rebuilds the state each such line names
and hands it to ``Adjuster.plan_round`` as the server would, so a policy change
can be judged on the states real runs reached before it runs on a GPU:

* the pool at the run's geometry (its log's "elastic pool:" line: expert pages,
  their bytes, the load buffers; the model's KV bytes a token), bookkeeping only;
* the experts out: the resident sets of the run's last order completed before the
  line (its adjuster trace ``NAME_trace.jsonl.gz``, written at each completion); the
  ranking its server read, or uniform;
* the KV: that order's ``kv_pages_used`` at its completion, held by the running
  requests in equal runs (before the queue filled the pages the order freed);
* the step line and read price that order was priced with (``cost_ms``);
* the shortfall: the line's R_b; the load: its running and waiting, one request
  at the head, nothing in the radix cache alone.

What the line does not say is assumed: no order in flight (the server's R_b
counts in-flight victims' pages, which it subtracts), and the KV and experts of
the last completed order, up to ~30 s old, so the rebuilt pool has more free KV
than the run's had where the queue took what that order freed. So a round's answer is the adjuster's on a state
close to the run's, not the run's own round. Prints one row per line: the run,
seconds from its first order, running, waiting, R_b, what today's adjuster does
(the victims it sends out, or "priced out") and whether it asked a larger move
(``Adjuster._leaving_pays``) and how that answered; where the line carries the price
the server itself weighed (servers since f50877c), that too. Needs torch (CPU); no GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from card_bound import POOL_LINE, pool_of, ranking_of  # noqa: E402
from decode_log import read_lines, read_log, stamp  # noqa: E402
from offload_sweep import shape_of  # noqa: E402
from sglang_rimuru.adjuster import Adjuster, Load  # noqa: E402
from sglang_rimuru.adjuster.cost import CostModel  # noqa: E402
from sglang_rimuru.adjuster.policy import AdjusterPolicy  # noqa: E402
from sglang_rimuru.experts import ExpertRanking, ExpertResidency, MoEShape  # noqa: E402
from sglang_rimuru.experts.ranking import load_ranking  # noqa: E402
from sglang_rimuru.pool import PoolGeometry, UnifiedPagePool  # noqa: E402

#: "[2026-12-05 18:40:44] sglang-rimuru round 117668: eviction priced out (R_b=32; 44 rounds so far): ...
#: (running 261, waiting 81); ..."
PRICED_OUT = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\][^\n]*?eviction priced out \(R_b=(?P<rb>\d+);"
                        r"[^\n]*?\(running (?P<running>\d+), waiting (?P<waiting>\d+)\)")
#: what servers since f50877c add to that line: "; priced at batch 267: 11 experts out admit 2,
#: 307.9 -> 309.4 decode tok/s (+0.49 %, margin 1 %), a larger move does not pay; 474 KV pages a
#: running request" (``sglang_rimuru.adjuster.controller.price_text``)
PRICE = re.compile(r"; priced at batch (?P<batch>\d+): (?P<victims>\d+) experts out admit (?P<admits>\d+|none)"
                   r"(?:, (?P<ref>[\d.e+-]+) -> (?P<after>[\d.e+-]+) decode tok/s \((?P<gain>[+-][\d.]+|[+-]?inf) %, "
                   r"margin [\d.]+ %\), a larger move (?P<larger>not asked|pays|does not pay))?")


def logged_price(line: str) -> dict | None:
    """The price a priced-out line carries (servers since f50877c), None before."""
    m = PRICE.search(line)
    if m is None:
        return None
    out = {"batch": int(m["batch"]), "victims": int(m["victims"]),
           "admits": None if m["admits"] == "none" else int(m["admits"])}
    if m["ref"] is not None:
        out.update(reference_tok_s=float(m["ref"]), after_tok_s=float(m["after"]), gain_pct=float(m["gain"]),
                   larger_move={"not asked": None, "pays": True, "does not pay": False}[m["larger"]])
    return out


def moe_shape_of(run: dict) -> MoEShape:
    s = shape_of(run)
    return MoEShape(layer_ids=tuple(range(s.num_layers)), num_experts=s.num_experts, hidden=s.hidden_size,
                    inter=s.moe_intermediate_size, top_k=s.top_k, dtype=torch.bfloat16)


def rebuild(geo: PoolGeometry, offload_limit: int, record: dict, ranking: ExpertRanking, shape: MoEShape,
            running: int) -> tuple[UnifiedPagePool, ExpertResidency]:
    """The run's pool and residency as ``record`` (one trace line) left them, its KV held
    by ``running`` requests in equal runs."""
    pool = UnifiedPagePool(geo)
    buffers = record["pool"]["load_buffer_pages"]
    if pool.alloc_expert_pages(buffers, [("load_buffer", i) for i in range(buffers)]) is None:
        raise SystemExit("priced_out.py: the pool cannot hold the run's load buffers")
    residency = ExpertResidency(shape, ranking, offload_limit)
    sets = {int(l): set(es) for l, es in record["resident_sets"].items()}
    residency.place_all_but(pool, [(l, e) for l in shape.layer_ids for e in range(shape.num_experts)
                                   if e not in sets[l]])
    used = record["pool"]["kv_pages_used"]
    if running and used and pool.alloc_kv_runs([used // running] * running) is None:
        raise SystemExit(f"priced_out.py: {running} requests of {used // running} KV pages do not fit the rebuilt pool")
    return pool, residency


def replay(path: Path) -> list[dict]:
    run = json.loads(path.with_suffix(".json").read_text())
    log = read_log(path.parent / (path.name + ".log.gz"))
    trace = read_lines(path.parent / (path.name + "_trace.jsonl.gz"))
    if not trace or not all(k in trace[0] for k in ("resident_sets", "pool", "cost_ms")):
        print(f"priced_out.py: {path.name}: no adjuster trace with resident sets, pool and prices: left out",
              file=sys.stderr)
        return []
    if POOL_LINE.search(log) is None:
        print(f"priced_out.py: {path.name}: no 'elastic pool:' line with its offload limit in its log (an older run): left out",
              file=sys.stderr)
        return []
    shape = moe_shape_of(run)
    ranking_path = ranking_of(run)
    ranking = ExpertRanking.default(shape) if ranking_path is None else load_ranking(ranking_path, shape)
    pool_line = pool_of(log)
    geo = PoolGeometry(total_bytes=pool_line["pages"] * pool_line["page_bytes"],
                       expert_page_bytes=pool_line["page_bytes"], kv_page_bytes=shape_of(run).kv_bytes_per_token)
    t0 = trace[0]["t"]
    rows = []
    for m in PRICED_OUT.finditer(log):
        t = stamp(m["ts"])
        before = [r for r in trace if r["t"] <= t + 1]  # the log's stamps are whole seconds
        if not before:
            continue
        record = before[-1]
        running, waiting, r_b = int(m["running"]), int(m["waiting"]), int(m["rb"])
        pool, residency = rebuild(geo, pool_line["offload_limit"], record, ranking, shape, running)
        c = record["cost_ms"]
        cost = CostModel(expert_ms=c["expert"], base_ms=c["base"], per_request_ms=c["per_request"],
                         eager_prefill_share=c.get("eager_prefill_share", 0.0), replay_max_p=c.get("replay_max_p", 0.0))
        adj = Adjuster(AdjusterPolicy(), pool, residency, ranking, cost=cost)
        need = _kv_pages_for(pool, r_b)
        order = adj.plan_round(0, need, Load(running=running, admits=1, waiting=waiting))
        price = adj.last_price
        rows.append({"run": path.name, "s": round(t - t0, 1), "running": running, "waiting": waiting, "r_b": r_b,
                     "out": sum(shape.num_experts - len(v) for v in record["resident_sets"].values()),
                     "kv_pages_used": record["pool"]["kv_pages_used"], "evicts": len(order.evict) if order else 0,
                     "restores": len(order.restore) if order else 0,
                     "reason": order.reason.split(":")[0] if order else adj.last_round.decision.reason,
                     "larger_move": None if price is None else price.larger_move,
                     "logged": logged_price(log[m.start():log.find("\n", m.start())])})
    return rows


def _kv_pages_for(pool: UnifiedPagePool, r_b: int) -> int:
    """The fewest KV pages whose shortfall is ``r_b`` expert pages (0 for none)."""
    if r_b <= 0:
        return 0
    stats = pool.stats()
    lo, hi = 1, pool.kv_capacity_now() + (r_b + 1) * pool.geometry.expert_page_bytes // pool.geometry.kv_page_bytes + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if stats.missing_expert_pages(mid) >= r_b:
            hi = mid
        else:
            lo = mid + 1
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="RUN_DIR/NAME: NAME.json, NAME.log.gz, NAME_trace.jsonl.gz")
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    args = ap.parse_args()
    rows = [row for path in args.runs for row in replay(path)]
    cols = ("run", "s", "running", "waiting", "r_b", "out", "kv_pages_used", "evicts", "reason", "larger_move", "logged")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
