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

With the run's log beside, it also sets every decode step against the adjuster's price of it
when it ran (base + per request x B + expert x expected reads: its ``StepClock`` replayed on the
record from the logged start), by batch: the whole price the policy weighs, on every run, a card
that never holds every expert (24 GB: no resident line above) included (``price_by_batch``;
where the log says the server fitted the resident step as a curve in routed experts, that
curve, from the run's ranking in NAME.json).

Limits, said in the output too: the step record is flushed every second or so with no time a
step, so each step gets the out set at its record's flush; a round inside a record's span is
placed after steps it may have preceded. No GPU, no SGLang; numpy (and torch for a curve run's
ranking).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from card_bound import FIT_LINE  # noqa: E402
from decode_log import read_lines, read_log  # noqa: E402
from sglang_rimuru.adjuster.cost import StepClock  # noqa: E402  (plain Python: no torch, no SGLang)


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


def prior_of(log: str) -> tuple[float, float, float] | None:
    """The step price the server started with: its first "cost-aware adjuster: decode step"
    line (logged before any step was timed), else None."""
    m = FIT_LINE.search(log)
    return tuple(map(float, m.groups())) if m else None


def price_by_batch(prior: tuple[float, float, float], records: list[dict], width: int = 20,
                   routed=None) -> list[dict]:
    """Each decode step of the record against the price the adjuster held when it ran, in
    batch bins ``width`` wide: the server's ``StepClock`` replayed from ``prior`` on the same
    steps (the record holds what the clock was fed), refitted at each record line as the
    server refits before it writes one, each line's steps priced with the fit before them.
    (The trace's ``cost_ms`` is written only with an order, so between orders it is stale.)
    Without ``routed`` the clock replayed is the line in B, the server's fit before
    ``281aef5``; with it (a ``RoutedExperts``: servers since, whose log says "the line is the
    tangent at batch N") the resident step is the curve in routed experts and each fit is its
    tangent at the last batch timed, as the server's is at the last decode batch.
    Per bin: steps, mean measured and priced ms, their ratio (priced over measured), mean
    expected reads, the read price's range."""
    clock = StepClock(prior=prior, routed=routed)
    fit, last = clock.fit(), None
    bins: dict[int, list[tuple[float, float, float, float]]] = {}
    for rec in records:
        base, per, expert = fit
        for b, ms, r in rec.get("steps", []):
            bins.setdefault(b // width * width, []).append((ms, base + per * b + expert * r, r, expert))
            clock.record(b, ms, r)
            last = b
        fit = clock.fit(at_batch=last if routed is not None else None)
    rows = []
    for lo in sorted(bins):
        v = bins[lo]
        measured = sum(x[0] for x in v) / len(v)
        priced = sum(x[1] for x in v) / len(v)
        rows.append({"batch": [lo, lo + width - 1], "steps": len(v), "measured_ms": round(measured, 1),
                     "priced_ms": round(priced, 1), "priced_over_measured": round(priced / measured, 2),
                     "reads": round(sum(x[2] for x in v) / len(v), 1),
                     "read_price_ms": [round(min(x[3] for x in v), 3), round(max(x[3] for x in v), 3)]})
    return rows


#: a server that fits the resident step as a curve in routed experts logs its line so (281aef5 on)
TANGENT = "the line is the tangent at batch"


def routed_of(run_name: str):
    """The run's ``RoutedExperts`` (its ranking, or uniform), from NAME.json beside the trace:
    what the server's curve counted. Needs torch (``step_fit``), which only such runs ask for."""
    from step_fit import probabilities  # noqa: PLC0415  (step_fit imports this module)

    from sglang_rimuru.adjuster.cost import RoutedExperts  # noqa: PLC0415

    path = Path(run_name + ".json")
    if not path.exists():
        raise SystemExit(f"out_steps: {run_name}'s server fitted a curve in routed experts; its replay needs {path}")
    return RoutedExperts(probabilities(json.loads(path.read_text())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="RUN_DIR/NAME: NAME_trace.jsonl(.gz) and NAME_trace.steps.jsonl(.gz) beside it")
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()

    def find(suffix: str, required: bool = True) -> Path | None:
        for p in (Path(args.run + suffix + ".gz"), Path(args.run + suffix)):
            if p.exists():
                return p
        if required:
            raise SystemExit(f"out_steps: no {args.run}{suffix}(.gz)")
        return None

    records = read_lines(find("_trace.steps.jsonl"))
    trace = read_lines(find("_trace.jsonl"))
    res = analyse(trace, records)
    log_path = find(".log", required=False)
    prior = prior_of(read_log(log_path)) if log_path else None
    if prior:
        routed = routed_of(args.run) if TANGENT in read_log(log_path) else None
        res["price_by_batch"] = {"prior": prior, "fit": "line" if routed is None else "curve",
                                 "rows": price_by_batch(prior, records, routed=routed)}
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
        base, per, expert = res["price_by_batch"]["prior"]
        shape = ("the resident step a curve in routed experts, priced at its tangent"
                 if res["price_by_batch"]["fit"] == "curve" else "the resident step a line in B")
        print(f"each decode step against the adjuster's price when it ran (its StepClock replayed on the record from "
              f"the logged start, {base} ms + {per} ms a request + {expert} ms a read; {shape}):")
        print("| batch | steps | measured ms | priced ms | priced / measured | expected reads | read price ms |")
        print("|---|---|---|---|---|---|---|")
        for row in res["price_by_batch"]["rows"]:
            lo, hi = row["read_price_ms"]
            print(f"| {row['batch'][0]}-{row['batch'][1]} | {row['steps']} | {row['measured_ms']} | {row['priced_ms']} | "
                  f"{row['priced_over_measured']:.2f}x | {row['reads']} | {lo:g}-{hi:g} |")


if __name__ == "__main__":
    main()
