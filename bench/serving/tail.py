"""What a pool-mode run stopped at its budget would have served of its whole traffic: a bound
from its own step record, and an estimate on uniform routing.

    python3 bench/serving/tail.py RUN_DIR/NAME   # reads NAME.json, NAME.log.gz, NAME_trace.steps.jsonl.gz

bench_serving's throughput is over the whole traffic: total output tokens over the time to
the last request's last token. A run stopped at its budget has no such figure, and on a card
that cannot hold the model the traffic's end is its longest request decoded at whatever step
the system has when little else runs: SGLang's ``--cpu-offload-gb`` copies every offloaded
byte each pass, so its lone step bounds it from above (``targets.whole_run_ceiling``); a pool
mode reads in place only the experts a step routes to, so its step falls with its batch. This
bounds the pool mode from below, so the two bounds can be set side by side.

Where the run's traffic had all arrived and its queue was empty at the cut (the last decode
line of its log), every running request was admitted by the last prefill pass its record
holds, so each decoded at least once in every decode pass after that record line: ``D``.
Each request still running then asks at most ``o - D - 1`` tokens more (``o`` its output
length, from the lens file of bench_serving's sample; one token came with its prefill).

- **Bound**: the longest of those at the slowest step the record holds at the cut's batch (the
  step does not grow as the batch falls: fewer requests route to fewer offloaded experts), so
  the traffic ends no later than ``elapsed + max(o - D - 1) x that step``, and the whole
  throughput is at least the lens file's total output over that.
- **Estimate** (uniform routing only): each step as the run's adjuster last priced it
  (``trace.cost_ms``: ``base + per_request x b + expert x expected reads``; on the Qwen3 runs it
  prices a step above what the record measured at batch 1 and 33, so it errs slow), where at
  batch ``b`` uniform routing touches an offloaded expert with probability
  ``1 - (1 - top_k / E) ** b`` (the out set held at the cut's size: restores as the KV frees
  are left out, which errs slow too), and
  the requests still running are the ``running`` longest with ``P`` tokens each, ``P >= D + 1``
  the fewest that leave no more requests running than the record's last batch (errs slow). Skewed routing
  reads by its ranking, not this curve: no estimate there.

``--cut S`` backtests both on a run that served its whole traffic: its record and log cut
``S`` s after the traffic's start, as if it had stopped there, beside what it measured (the
thirty-second session's 24 GB uniform H200 run, 201 tok/s whole: the bound 63-124 and the
estimate 150-189 tok/s at cuts from 60 to 128 s, each below the measured figure, as both are
meant to err).

No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from card_bound import cost_of
from decode_log import read_lines, read_log, stamp
from makespan import LENS, LENS_SEED, arrivals, load_outputs
from offload_sweep import shape_of
from window import began_of, line_tokens

QUEUE = re.compile(r"Decode batch, #running-req: (\d+),.*?#queue-req: (\d+)")
LINE_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def cut_at(records: list[dict], log: str, began: float, seconds: float) -> tuple[list[dict], str]:
    """A whole run's step record and log as a run stopped ``seconds`` after the traffic began
    (``began``, wall time) would have left them: the record's lines up to then, the log's
    lines up to the first stamped later (an unstamped line belongs to the one before)."""
    end = began + seconds
    kept = []
    for line in log.splitlines():
        m = LINE_STAMP.match(line)
        if m and stamp(m.group(1)) > end:
            break
        kept.append(line)
    return [x for x in records if x["t"] <= end], "\n".join(kept) + "\n"


def remaining_steps(run: dict, records: list[dict], log: str, outputs: list[int], began: float) -> dict:
    """From the traffic's start (``began``, wall time): elapsed time, tokens made, the
    decode passes ``D`` after the last prefill pass, the batch at the cut, and each running
    request's most tokens left (longest first). Raises ValueError where the premise fails:
    requests still queued or still to arrive at the cut, or fewer requests long enough to be
    running than the record's last batch."""
    rows = [x for x in records if x["t"] > began]
    if not rows:
        raise ValueError("no step record after the traffic began")
    lines = QUEUE.findall(log)
    if not lines or int(lines[-1][1]):
        raise ValueError(f"requests still queued at the cut ({lines[-1][1] if lines else '?'} by the last decode line)")
    elapsed = rows[-1]["t"] - began
    last_arrival = arrivals(len(outputs), run["rate"], run.get("seed", LENS_SEED))[-1]
    if last_arrival >= elapsed:
        raise ValueError(f"the traffic's last request arrives at {last_arrival:.1f} s, after the cut at {elapsed:.1f} s")
    last_prefill = max((i for i, x in enumerate(rows) if x.get("passes")), default=-1)
    decodes_after = sum(len(x.get("gpu", [])) for x in rows[last_prefill + 1:])
    steps = [s for x in rows for s in x.get("steps", [])]
    batch = steps[-1][0] if steps else 0
    made = decodes_after + 1
    left = sorted((o - made for o in outputs if o > made), reverse=True)
    if len(left) < batch:
        raise ValueError(f"{len(left)} requests ask more than {made} tokens, fewer than the {batch} running at the cut")
    tokens = sum(line_tokens(x) for x in rows)
    at_cut = [ms for b, ms, _ in steps if b == batch]
    return {"elapsed_s": elapsed, "tokens": tokens, "decodes_after_last_prefill": decodes_after,
            "batch_at_cut": batch, "slowest_step_at_cut_ms": max(at_cut), "left": left,
            "reads_at_cut": steps[-1][2], "steps": steps}


def step_ms(cost: dict, batch: int, out: float, touch: float) -> float:
    """The adjuster's price of a decode step at ``batch`` with ``out`` experts offloaded
    (summed over layers) under uniform routing: ``touch`` is one token's chance of picking a
    given expert (``top_k / E``)."""
    return cost["base"] + cost["per_request"] * batch + cost["expert"] * out * (1 - (1 - touch) ** batch)


def estimate_tail_s(left: list[int], batch: int, out: float, touch: float, cost: dict) -> float:
    """Seconds to decode the ``batch`` longest of ``left`` (tokens each still asks, longest
    first) to their ends, the batch falling as each ends, each step at step_ms."""
    rest = sorted(left[:batch])  # shortest first
    t, done = 0.0, 0
    for i, r in enumerate(rest):
        t += (r - done) * step_ms(cost, batch - i, out, touch) / 1e3
        done = r
    return t


def tail(run: dict, records: list[dict], log: str, lens: Path = LENS, began: float | None = None) -> dict:
    """The bound and, on uniform routing, the estimate; ``began``: the traffic's start (wall
    time; default ``traffic_began_wall``, which runs before the twenty-eighth session lack:
    window.began_of finds theirs)."""
    outputs = load_outputs(run["num_prompts"], lens)
    total = sum(outputs)
    st = remaining_steps(run, records, log, outputs, run["traffic_began_wall"] if began is None else began)
    if st["tokens"] > total:
        raise ValueError(f"the record's {st['tokens']} tokens exceed the lens file's {total}: another sample")
    bound_s = st["elapsed_s"] + st["left"][0] * st["slowest_step_at_cut_ms"] / 1e3
    res = {"run": run["name"], "total_output": total, "elapsed_s": round(st["elapsed_s"], 1), "tokens": st["tokens"],
           "batch_at_cut": st["batch_at_cut"], "decodes_after_last_prefill": st["decodes_after_last_prefill"],
           "longest_left": st["left"][0], "slowest_step_at_cut_ms": st["slowest_step_at_cut_ms"],
           "makespan_at_most_s": round(bound_s, 1), "whole_tok_s_at_least": round(total / bound_s, 1)}
    if run.get("router_skew"):
        res["estimate"] = "none: skewed routing reads by its ranking, not the uniform curve"
        return res
    shape = shape_of(run)
    touch = shape.top_k / shape.num_experts
    cost = cost_of(run, log)
    out = st["reads_at_cut"] / (1 - (1 - touch) ** st["batch_at_cut"])  # experts offloaded at the cut
    # the tokens each running request has made beyond D + 1: the fewest that leave no more
    # requests running than the record's last batch (the running ones the longest; errs slow)
    left = st["left"]
    batch = st["batch_at_cut"]
    shift = left[batch] if len(left) > batch else 0
    est_left = [x - shift for x in left[:batch]]
    tail_s = estimate_tail_s(est_left, batch, out, touch, cost)
    est_s = st["elapsed_s"] + tail_s
    res.update({"cost_ms": {k: cost[k] for k in ("base", "per_request", "expert")}, "experts_out": round(out),
                "estimate_tail_s": round(tail_s, 1), "estimate_makespan_s": round(est_s, 1),
                "estimate_whole_tok_s": round(total / est_s, 1),
                "estimate_lone_step_ms": round(step_ms(cost, 1, out, touch), 1)})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="RUN_DIR/NAME: NAME.json, NAME.log.gz and NAME_trace.steps.jsonl.gz beside it")
    ap.add_argument("--lens", default=str(LENS), help="the traffic's lens file (makespan.py)")
    ap.add_argument("--cut", type=float, help="backtest: a whole run cut S s after its traffic began")
    args = ap.parse_args()
    base = Path(args.run)
    run = json.loads(base.with_name(base.name + ".json").read_text())
    records = read_lines(base.with_name(base.name + "_trace.steps.jsonl.gz"))
    log = read_log(base.with_name(base.name + ".log.gz"))
    began = began_of(run, base, records)
    if args.cut is not None:
        if not run.get("all_completed"):
            ap.error(f"--cut backtests a run that served its whole traffic; {run['name']} stopped at its budget")
        records, log = cut_at(records, log, began, args.cut)
    res = tail(run, records, log, Path(args.lens), began)
    if args.cut is not None:
        res["measured_whole_tok_s"] = round(run["bench"]["output_throughput"], 1)
        res["measured_makespan_s"] = round(run["bench"]["duration"], 1)
    print(json.dumps(res, indent=1))
    print(f"{res['run']}: cut at {res['elapsed_s']} s with {res['batch_at_cut']} running, {res['tokens']} of "
          f"{res['total_output']} tokens made; the longest still running asks <= {res['longest_left']} more at <= "
          f"{res['slowest_step_at_cut_ms']:.0f} ms a step: whole traffic >= {res['whole_tok_s_at_least']} tok/s "
          f"(makespan <= {res['makespan_at_most_s']} s)"
          + (f"; estimate {res['estimate_whole_tok_s']} tok/s (tail {res['estimate_tail_s']} s, lone step "
             f"~{res['estimate_lone_step_ms']} ms)" if "estimate_whole_tok_s" in res else f"; {res.get('estimate')}")
          + (f"; measured {res['measured_whole_tok_s']} tok/s (makespan {res['measured_makespan_s']} s)"
             if "measured_whole_tok_s" in res else ""))


if __name__ == "__main__":
    main()
