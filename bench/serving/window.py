"""Two runs over the same first seconds of their traffic, where one or both stopped at its budget.

    python3 bench/serving/window.py RUN_DIR/NAME [...] --write   # adds each run's "timeline" to its JSON

A run stopped at its budget has a rate over its own window only: a pool mode's pass record
from the traffic's first request to its last record line, SGLang's decode log from the
traffic's start to its last decode line. Two such windows differ in length and in what they
hold: SGLang's offloader admits its queue before it decodes (the Qwen3 50 GiB run on the H100:
89 s of prefill, then 410 tok/s at 406 running), a pool mode mixes decodes into its prefill
passes, so a ratio of their means says as much about the windows as about the systems.
Here each run's output tokens are counted as time from its traffic's start goes on, and a pair
is compared at ``T``, the earlier of the two windows' ends:

- a pool mode's points are its step record's lines (tokens of the decode and prefill passes
  each holds, ``run_one.pass_tokens``' count), SGLang's its decode-log lines, each from the
  traffic's start (``began_of``): each decode line
  ``#running-req x decode_log_interval`` tokens, plus one first token for each sequence its
  prefill lines admitted (a chunked prompt's lines count it again: generous).

Each side's tokens at ``T`` are interpolated between its points (a step record's lines are
~20 s apart); ``a``'s tokens at its last point at or before ``T`` over ``b``'s at its first at
or after it bound ``a``'s lead from below within that resolution, and are kept beside. A
decode-log timeline also keeps SGLang's fastest line in the window (``best_line``): its rate
once its batch is full, which a window that opened on its prefill does not show; and where
the log ends on one request decoding alone, that request's KV and rate (``lone_tail``), from
which targets.lone_tail_ceiling bounds the run's whole traffic. targets.py uses both where
the two runs of a pair stopped. No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from decode_log import DECODE, STAMP, log_interval, read_lines, read_log, stamp

# a decode line's requests, the KV they hold (SGLang's ``#token``: tokens locked by running requests,
# the radix cache's evictable ones left out), its rate and its queue
HELD = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\][^\n]*?Decode batch, #running-req: (?P<r>\d+), "
                  r"#token: (?P<kv>\d+),[^\n]*?gen throughput \(token/s\): (?P<g>[0-9.]+),[^\n]*?#queue-req: (?P<q>\d+)")
LINE = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\][^\n]*?(?:(?P<decode>Decode batch, #running-req: "
                  r"(?P<r>\d+),)|(?P<prefill>Prefill batch, #new-seq: (?P<n>\d+),))")


def traffic_start(log: str) -> float | None:
    """Wall time of the traffic's first prefill line: the first after a decode line
    (bench_serving's warm-up request decodes before its traffic is sent)."""
    seen_decode = False
    for m in LINE.finditer(log):
        if m["decode"]:
            seen_decode = True
        elif seen_decode:
            return stamp(m["ts"])
    return None


def log_timeline(log: str, began: float) -> list[list[float]]:
    """``[seconds from began, output tokens by then]`` at each decode-log line from ``began``
    on (its second: the stamps are whole seconds)."""
    interval = log_interval(log)
    points, tokens = [], 0
    for m in LINE.finditer(log):
        t = stamp(m["ts"])
        if t < int(began):
            continue
        if m["prefill"]:
            tokens += int(m["n"])  # each admitted sequence's first token
        else:
            tokens += int(m["r"]) * interval
            points.append([round(t - began, 1), tokens])
    return points


def best_line(log: str, began: float) -> dict | None:
    """SGLang's fastest decode-log line from ``began`` on: ``{"tok_s", "running"}``."""
    lines = [(float(m["g"]), int(m["r"])) for m in DECODE.finditer(log) if stamp(m["ts"]) >= int(began)]
    if not lines:
        return None
    g, r = max(lines)
    return {"tok_s": g, "running": r}


def lone_tail(log: str, began: float) -> dict | None:
    """Where SGLang's log ends on one request decoding alone (no other running, none queued):
    ``{"seconds", "kv_tokens", "tok_s", "lines"}``, the last such line's time from ``began``,
    the KV that request held then (its prompt and the tokens it had made), and the fastest of
    the trailing lone lines' rates but the first's. A run stopped there still had that
    request's remaining output to decode at no faster a step (targets.lone_tail_ceiling).
    None where the log's last decode or prefill line is not such a decode line."""
    last = None
    for last in LINE.finditer(log):
        pass
    if last is None or not last["decode"] or int(last["r"]) != 1:
        return None
    trailing = []
    for m in reversed([m for m in HELD.finditer(log) if stamp(m["ts"]) >= int(began)]):
        if int(m["r"]) != 1 or int(m["q"]) != 0:
            break
        trailing.append(m)
    if not trailing:
        return None
    end = trailing[0]
    # the first lone line's rate is over steps that still ran the requests before it
    # (SGLang's rate is the tokens since the previous line): only a lone line's own count
    alone = trailing[:-1] or trailing
    return {"seconds": round(stamp(end["ts"]) - began, 1), "kv_tokens": int(end["kv"]),
            "tok_s": max(float(m["g"]) for m in alone), "lines": len(trailing)}


def line_tokens(line: dict) -> int:
    """Output tokens of one step-record line's passes: one a request in each decode pass
    (``"gpu"`` rows) and in each extend or mixed pass (``"passes"``; one too many for a
    request whose prompt chunk was not its last)."""
    return sum(b for b, _ in line.get("gpu", [])) + sum(b for _, b, _ in line.get("passes", []))


def pass_timeline(records: list[dict], began: float) -> list[list[float]]:
    """``[seconds from began, output tokens by then]`` at each step-record line after ``began``."""
    points, tokens = [], 0
    for x in records:
        if x["t"] <= began:
            continue
        tokens += line_tokens(x)
        points.append([round(x["t"] - began, 1), tokens])
    return points


def timeline(records: list[dict] | None, log: str, began: float) -> dict:
    """A run's ``"timeline"``: its step record's points where the server wrote one (pool
    modes), else its decode log's with SGLang's fastest line (and its lone tail, where the
    log ends on one)."""
    if records:
        return {"source": "pass record", "began_wall": round(began, 1), "points": pass_timeline(records, began)}
    tl = {"source": "decode log", "began_wall": round(began, 1), "points": log_timeline(log, began),
          "best_line": best_line(log, began)}
    tail = lone_tail(log, began)
    return {**tl, "lone_tail": tail} if tail else tl


def began_of(run: dict, base: Path, records: list[dict] | None) -> float | None:
    """Wall time the run's traffic began: run_one.py's ``traffic_began_wall``; for runs
    before it that counted their pass record from the traffic's start (``traffic_began_s``
    set), the record's last line less ``pass_tokens.seconds``; else ``log_since``, else the
    first prefill line after the warm-up's decode line in the log beside ``base``."""
    if run.get("traffic_began_wall") is not None:
        return run["traffic_began_wall"]
    seconds = (run.get("pass_tokens") or {}).get("seconds")
    if records and run.get("traffic_began_s") is not None and seconds is not None:
        return max(x["t"] for x in records) - seconds
    if run.get("log_since"):
        return stamp(run["log_since"])
    log_path = base.with_name(base.name + ".log.gz")
    return traffic_start(read_log(log_path)) if log_path.exists() else None


def timeline_of(run: dict, base: Path) -> dict | None:
    """The run's timeline from what is stored beside ``base`` (``NAME``): its step record
    where it has one (pool modes), else its decode log (SGLang). None without either, or
    without the traffic's start."""
    steps = base.with_name(base.name + "_trace.steps.jsonl.gz")
    records = read_lines(steps) if steps.exists() else None
    began = began_of(run, base, records)
    if began is None:
        return None
    if records is not None:
        return timeline(records, "", began)
    log_path = base.with_name(base.name + ".log.gz")
    return timeline(None, read_log(log_path), began) if log_path.exists() else None


def at_or_before(points: list[list[float]], t: float) -> float:
    return max((tok for s, tok in points if s <= t), default=0)


def at_or_after(points: list[list[float]], t: float) -> float:
    return min((tok for s, tok in points if s >= t), default=points[-1][1] if points else 0)


def interpolate(points: list[list[float]], t: float) -> float:
    """Tokens by ``t``, linear between the points (from none at the traffic's start)."""
    prev = [0.0, 0.0]
    for s, tok in points:
        if s >= t:
            return prev[1] + (tok - prev[1]) * (t - prev[0]) / (s - prev[0]) if s > prev[0] else tok
        prev = [s, tok]
    return prev[1]


def same_window(a: dict, b: dict) -> dict | None:
    """``a``'s output tokens over ``b``'s in the first ``T`` seconds of their traffic, ``T``
    the earlier of their windows' ends (interpolated, and the bound from the points beside);
    None where either has no timeline or no tokens."""
    ta, tb = a.get("timeline"), b.get("timeline")
    if not (ta and tb and ta["points"] and tb["points"]):
        return None
    t = min(ta["points"][-1][0], tb["points"][-1][0])
    x, y = interpolate(ta["points"], t), interpolate(tb["points"], t)
    floor, ceil = at_or_before(ta["points"], t), at_or_after(tb["points"], t)
    if not (x and y):
        return None
    return {"seconds": t, "tokens": round(x), "other_tokens": round(y), "ratio": x / y,
            "ratio_at_least": floor / ceil if ceil else None}


def along(a: dict, b: dict, parts: int = 4) -> list[list[float]]:
    """``[t, a's tokens over b's by t]`` at each ``parts``-th of ``same_window``'s seconds
    (the last its end): a pair level at the window's end may have trailed on the way, as a
    server with less KV does while both queues are full (bench/RESULTS.md, forty-fifth
    session). [] where ``same_window`` is None; a point where ``b`` has no tokens yet is left out."""
    w = same_window(a, b)
    if w is None:
        return []
    out = []
    for k in range(1, parts + 1):
        t = w["seconds"] * k / parts
        x, y = interpolate(a["timeline"]["points"], t), interpolate(b["timeline"]["points"], t)
        if y:
            out.append([round(t, 1), x / y])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR/NAME of each run (NAME.json beside its log or step record)")
    ap.add_argument("--write", action="store_true", help="store each run's timeline in its JSON")
    args = ap.parse_args()
    for name in args.runs:
        base = Path(name)
        path = base.with_name(base.name + ".json")
        run = json.loads(path.read_text())
        tl = timeline_of(run, base)
        if tl is None:
            print(f"{run['name']}: no timeline (no step record or decode log, or no traffic start)")
            continue
        last = tl["points"][-1] if tl["points"] else [0, 0]
        print(f"{run['name']}: {tl['source']} from {time.strftime(STAMP, time.localtime(tl['began_wall']))}: "
              f"{len(tl['points'])} points, {last[1]} tokens by {last[0]} s")
        if args.write:
            run["timeline"] = tl
            path.write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
