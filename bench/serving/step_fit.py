"""How well the cost-aware adjuster's step fit predicts a run's decode steps, replayed.

    python3 bench/serving/step_fit.py RUN_DIR/NAME [RUN_DIR/NAME ...] [--out FILE.json]

A pool-mode server records every decode step it timed (``NAME_trace.steps.jsonl.gz``:
batch, ms, the offloaded reads it was expected to make). This script feeds that record,
in order, to this checkout's ``StepClock`` two ways and, as the server does every
``REFIT_ROUNDS`` rounds, refits every ``--refit`` steps:

* ``line``: the resident step as a line in B (``StepClock`` without ``routed``);
* ``curve``: the resident step as ``base + h * routed(B)``, the experts the batch is
  expected to route to over every layer (``RoutedExperts`` from the ranking the run's
  server read, or uniform), the line handed on as its tangent at the batch of the
  step last timed (``fit(at_batch=...)``, what the server passes).

Each step timed after a refit and before the next is predicted by that fit
(``base + per_request * B + expert_ms * R``) and compared with what it took: the
table gives, per band of batch sizes, the median of predicted / measured for each
way, and the last fit of each. The prior is the run's own (its log's first
"decode step" line, ``out_steps.prior_of``); the CPU split's floor scaling is
not replayed (the runs it matters for split their reads; say so when reading them).
Needs no GPU and no SGLang.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from card_bound import ranking_of  # noqa: E402  (puts the checkout on sys.path)
from decode_log import read_lines, read_log  # noqa: E402
from out_steps import prior_of  # noqa: E402
from priced_out import moe_shape_of  # noqa: E402
from sglang_rimuru.adjuster.cost import RoutedExperts, StepClock  # noqa: E402
from sglang_rimuru.experts import ExpertRanking  # noqa: E402
from sglang_rimuru.experts.ranking import load_ranking  # noqa: E402

BAND = 16


def probabilities(run: dict) -> list[float]:
    """Every expert's per-token routing probability, over every layer, as the run's adjuster
    read them (``priced_out.replay``'s ranking: its file, or uniform)."""
    shape = moe_shape_of(run)
    path = ranking_of(run)
    ranking = ExpertRanking.default(shape) if path is None else load_ranking(path, shape)
    return [p for layer in shape.layer_ids for p in ranking.token_probabilities(layer, shape.top_k)]


def replay(steps: list[tuple[int, float, float]], prior: tuple[float, float, float], routed: RoutedExperts,
           refit: int) -> dict:
    clocks = {"line": StepClock(prior=prior), "curve": StepClock(prior=prior, routed=routed)}
    fits = {k: prior for k in clocks}
    ratios: dict[str, dict[int, list[float]]] = {k: {} for k in clocks}
    for i, (b, ms, r) in enumerate(steps):
        if i and i % refit == 0:
            fits = {"line": clocks["line"].fit(), "curve": clocks["curve"].fit(at_batch=steps[i - 1][0])}
        if i >= refit:  # the prior predicts nothing of this run
            for k, (base, per, exp) in fits.items():
                ratios[k].setdefault((b - 1) // BAND, []).append((base + per * b + exp * r) / ms)
        for c in clocks.values():
            c.record(b, ms, r)
    bands = sorted(set(ratios["line"]))
    return {
        "bands": [{"batch": f"{k * BAND + 1}-{k * BAND + BAND}", "steps": len(ratios["line"][k]),
                   **{w: round(statistics.median(ratios[w][k]), 3) for w in ratios}} for k in bands],
        "last_fit": {k: [round(v, 4) for v in f] for k, f in fits.items()},
        "median_abs_error": {w: round(statistics.median(abs(x - 1) for v in ratios[w].values() for x in v), 4)
                             for w in ratios if any(ratios[w].values())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR/NAME: NAME.json, NAME.log.gz, NAME_trace.steps.jsonl.gz")
    ap.add_argument("--refit", type=int, default=256, help="steps between refits (the server: 256 rounds)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    out = {}
    for name in args.runs:
        base = Path(name)
        run = json.loads(base.with_name(base.name + ".json").read_text())
        prior = prior_of(read_log(base.with_name(base.name + ".log.gz")))
        if prior is None:
            raise SystemExit(f"step_fit.py: {name}'s log has no prior line (not a cost-aware pool-mode run)")
        steps = [(int(b), float(ms), float(r)) for rec in read_lines(base.with_name(base.name + "_trace.steps.jsonl.gz"))
                 for b, ms, r in rec["steps"]]
        key = f"{base.parent.name}/{base.name}"
        out[key] = res = replay(steps, prior, RoutedExperts(probabilities(run)), args.refit)
        res.update(prior=list(prior), steps=len(steps))
        print(f"\n{key}: {len(steps)} timed steps, prior {prior}; median |predicted / measured - 1|: "
              + ", ".join(f"{w} {v:.3f}" for w, v in res["median_abs_error"].items()))
        print("| batch | steps | line: predicted / measured | curve |\n|---|---|---|---|")
        for row in res["bands"]:
            print(f"| {row['batch']} | {row['steps']} | {row['line']:.2f} | {row['curve']:.2f} |")
        print("last fit (base ms, ms a request, ms a read): " + "; ".join(f"{k} {v}" for k, v in res["last_fit"].items()))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
