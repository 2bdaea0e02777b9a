"""Decode steps taken with experts out, against the same run's resident steps at their batch.

    python3 bench/serving/out_steps.py RUN_DIR/NAME   # reads NAME_trace.jsonl.gz and NAME_trace.steps.jsonl.gz

The cost policy prices an offloaded read from what steps that expected reads took beyond the
resident line (``StepClock``). At light skewed load that price came out 50x a read's PCIe time
(bench/RESULTS.md, twenty-seventh and twenty-eighth sessions). This sets each decode step the
step record holds while the trace says experts were out beside the median resident step at its
batch, and fits the extra time two ways: on expected reads alone (what ``StepClock`` does) and
on expected reads plus the layers with any expert out (a fixed cost of leaving SGLang's own MoE
path). It also tabulates the steps by how long after a migration round their record was
written: a round's page copies share PCIe and the GPU with the steps after it.

Where the run's JSON lies beside its trace, it also sets every decode step against the step
the adjuster last priced (its trace's ``cost_ms``: base + per request x B + expert x expected
reads), by batch: the whole price the policy weighs, on every run, a card that never holds
every expert (24 GB: no resident line above) included (bench/RESULTS.md, thirty-second
session: Qwen3 0.99-1.02x; 24 GB Qwen1.5 1.18x at batch 20-39 down to 0.88x at 100-119).

Limits, said in the output too: the step record is flushed every second or so with no time a
step, so each step gets the out set at its record's flush; a round inside a record's span is
placed after steps it may have preceded. No GPU, no SGLang; numpy.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path

import numpy as np

from decode_log import read_lines


def out_states(trace: list[dict]) -> tuple[list[float], list[tuple[int, int]], list[float]]:
    """From the trace's orders in time: after each, (layers with any expert out, experts out);
    and the times of the rounds that moved an expert."""
    out: set[tuple[int, int]] = set()
    times, states, moved = [], [], []
    for e in sorted((e for e in trace if "evicted" in e), key=lambda e: e["t"]):
        for layer, expert in e["evicted"]:
            out.add((layer, expert))
        for layer, expert in e.get("restored", []):
            out.discard((layer, expert))
        times.append(e["t"])
        states.append((len({layer for layer, _ in out}), len(out)))
        if e["evicted"] or e.get("restored"):
            moved.append(e["t"])
    return times, states, moved


def analyse(trace: list[dict], records: list[dict], min_resident: int = 5) -> dict:
    times, states, moved = out_states(trace)

    def at(keys: list[float], values: list, t: float, default):
        """values' entry for the last of keys at or before t."""
        i = bisect.bisect_right(keys, t) - 1
        return values[i] if i >= 0 else default

    steps = []  # (batch, ms, expected reads, layers out, experts out, s since a round moved experts)
    for rec in records:
        layers, experts = at(times, states, rec["t"], (0, 0))
        last = at(moved, moved, rec["t"], None)
        for b, ms, r in rec.get("steps", []):
            steps.append((b, ms, r, layers, experts, rec["t"] - last if last is not None else None))
    resident: dict[int, list[float]] = {}
    for b, ms, r, _, experts, _ in steps:
        if experts == 0 and r == 0:
            resident.setdefault(b, []).append(ms)
    line = {b: statistics.median(v) for b, v in resident.items() if len(v) >= min_resident}
    # steps with experts out at a batch the resident line covers; a step 5x its line and 20 ms
    # over it is a stall (a prefill's wait, a graph capture), not a read
    rows = [(layers, r, ms - line[b], since) for b, ms, r, layers, experts, since in steps
            if experts and b in line and ms < 5 * line[b] + 20]
    result = {"resident_steps": sum(len(v) for v in resident.values()), "out_steps": len(rows),
              "rounds_moving_experts": len(moved)}
    if not rows:
        return result
    x = np.array([(layers, r) for layers, r, _, _ in rows], float)
    y = np.array([extra for _, _, extra, _ in rows])
    both, *_ = np.linalg.lstsq(x, y, rcond=None)
    result["fit_both"] = {"us_per_layer_out": round(float(both[0]) * 1e3, 1),
                          "ms_per_read": round(float(both[1]), 3),
                          "rms_ms": round(float(np.sqrt(((y - x @ both) ** 2).mean())), 3)}
    rr = float(x[:, 1] @ x[:, 1])
    if rr > 0:
        per = float(x[:, 1] @ y) / rr
        result["fit_reads"] = {"ms_per_read": round(per, 3),
                               "rms_ms": round(float(np.sqrt(((y - x[:, 1] * per) ** 2).mean())), 3)}
    by_gap = []
    for lo, hi in ((0, 0.05), (0.05, 0.15), (0.15, 0.5), (0.5, 2.0), (2.0, float("inf"))):
        sel = [(extra, r) for _, r, extra, since in rows if since is not None and lo <= since < hi]
        if sel:
            by_gap.append({"after_s": [lo, hi], "steps": len(sel),
                           "extra_ms_median": round(statistics.median(e for e, _ in sel), 3),
                           "reads_median": round(statistics.median(r for _, r in sel), 3)})
    result["by_time_after_a_round"] = by_gap
    return result


def price_by_batch(cost: dict, records: list[dict], width: int = 20) -> list[dict]:
    """Each decode step of the record against ``cost``'s price of it (``base + per_request x B
    + expert x R``, R its expected reads), in batch bins ``width`` wide: steps, mean measured
    and priced ms, their ratio (priced over measured), mean expected reads."""
    bins: dict[int, list[tuple[float, float, float]]] = {}
    for rec in records:
        for b, ms, r in rec.get("steps", []):
            priced = cost["base"] + cost["per_request"] * b + cost["expert"] * r
            bins.setdefault(b // width * width, []).append((ms, priced, r))
    rows = []
    for lo in sorted(bins):
        v = bins[lo]
        measured = sum(x[0] for x in v) / len(v)
        priced = sum(x[1] for x in v) / len(v)
        rows.append({"batch": [lo, lo + width - 1], "steps": len(v), "measured_ms": round(measured, 1),
                     "priced_ms": round(priced, 1), "priced_over_measured": round(priced / measured, 2),
                     "reads": round(sum(x[2] for x in v) / len(v), 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="RUN_DIR/NAME: NAME_trace.jsonl(.gz) and NAME_trace.steps.jsonl(.gz) beside it")
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()

    def find(suffix: str) -> Path:
        for p in (Path(args.run + suffix + ".gz"), Path(args.run + suffix)):
            if p.exists():
                return p
        raise SystemExit(f"out_steps: no {args.run}{suffix}(.gz)")

    records = read_lines(find("_trace.steps.jsonl"))
    res = analyse(read_lines(find("_trace.jsonl")), records)
    run_json = Path(args.run + ".json")
    cost = (json.loads(run_json.read_text()).get("trace") or {}).get("cost_ms") if run_json.exists() else None
    if cost:
        res["price_by_batch"] = {"cost_ms": {k: cost[k] for k in ("base", "per_request", "expert")},
                                 "rows": price_by_batch(cost, records)}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{Path(args.run).name}: {res['out_steps']} decode steps with experts out at a batch the resident line "
          f"covers, {res['resident_steps']} resident; {res['rounds_moving_experts']} rounds moved experts"
          + ("" if res["resident_steps"] else " (no resident step: the card never held every expert)"))
    if "fit_both" in res:
        fb = res["fit_both"]
        print(f"  extra = {fb['us_per_layer_out']} us a layer with experts out + {fb['ms_per_read']} ms an expected read "
              f"(rms {fb['rms_ms']} ms)")
    if "fit_reads" in res:
        print(f"  on reads alone: {res['fit_reads']['ms_per_read']} ms an expected read (rms {res['fit_reads']['rms_ms']} ms)")
    print("| s after a round that moved experts | steps | extra ms, median | expected reads, median |")
    print("|---|---|---|---|")
    for g in res.get("by_time_after_a_round", []):
        print(f"| {g['after_s'][0]:g}-{g['after_s'][1]:g} | {g['steps']} | {g['extra_ms_median']} | {g['reads_median']} |")
    print("  (each step gets the out set at its record's flush, ~1 s apart: a round inside a record's span may "
          "be placed after steps it preceded)")
    if "price_by_batch" in res:
        c = res["price_by_batch"]["cost_ms"]
        print(f"the adjuster's last price: {c['base']} ms + {c['per_request']} ms a request + {c['expert']:.3f} ms an "
              "expected read")
        print("| batch | steps | measured ms | priced ms | priced / measured | expected reads |")
        print("|---|---|---|---|---|---|")
        for row in res["price_by_batch"]["rows"]:
            print(f"| {row['batch'][0]}-{row['batch'][1]} | {row['steps']} | {row['measured_ms']} | {row['priced_ms']} | "
                  f"{row['priced_over_measured']:.2f}x | {row['reads']} |")


if __name__ == "__main__":
    main()
