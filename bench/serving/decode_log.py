"""What SGLang's scheduler log says about a serving run: running and queued requests, decode
steps, and SGLang's own decode rate, the figure a run stopped at its budget still has.

    python3 bench/serving/decode_log.py RUN.json LOG[.gz] --since 'YYYY-MM-DD HH:MM:SS'

``log_stats`` is what run_one.py writes into each run's JSON (``"log"``). With ``since``, the
wall time the traffic began (bench_serving's first request), decode lines logged before it
are no part of the traffic's rate: they are bench_serving's warm-up request, one request
decoded alone, which at ``--decode-log-interval 10`` fills several lines (SGLang's
``--cpu-offload-gb 50`` for Qwen3-30B-A3B: three at 1.01 tok/s, which stood as the run's
rate when its whole traffic window went to prefill). Those lines are kept apart as
``lone_step_ms``: the system's decode step with one request, measured.

The command re-derives the ``"log"`` of a run written before ``since`` was passed, from the
log stored beside it, with ``since`` read off that log (after the warm-up's last decode line,
before the traffic's first prefill); the JSON keeps the figures it was written with under
``"log_as_run"`` and the ``since`` used under ``"log_since"``. No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import time
from pathlib import Path

# "[2026-12-05 16:24:11] Decode batch, ..." ("[... TP0]" at --tp-size 2)
DECODE = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]\n]*\][^\n]*?Decode batch, #running-req: (?P<r>\d+),"
                    r"[^\n]*?gen throughput \(token/s\): (?P<g>[0-9.]+)")
STAMP = "%Y-%m-%d %H:%M:%S"


def stamp(text: str) -> float:
    """A log line's ``[YYYY-MM-DD HH:MM:SS]`` as wall time (the server's local time, which
    is run_one.py's: both run on the device machine)."""
    return time.mktime(time.strptime(text, STAMP))


def log_stats(log: str, since: float | None = None) -> dict:
    """Running/queued requests, decode steps and SGLang's decode rate from its scheduler log.

    Each decode line covers ``decode_log_interval`` steps of its ``#running-req`` requests,
    so the rate is weighed by time (tokens / rate), not by line. The log's first decode line
    never counts: SGLang times it from the scheduler's start. With ``since`` (wall time the
    traffic began), only lines stamped in or after its second count, and the ones before it
    at one running request (the warm-up) give ``lone_step_ms``; without, every line after the
    first counts (runs before ``since`` existed: at the default interval of 40 the warm-up
    fills only that first line)."""
    running = [int(m) for m in re.findall(r"#running-req: (\d+)", log)]
    queued = [int(m) for m in re.findall(r"#queue-req: (\d+)", log)]
    lines = [(stamp(m["ts"]), int(m["r"]), float(m["g"])) for m in DECODE.finditer(log)][1:]
    if since is not None:
        first = int(since)  # the stamps have whole seconds
        lone = [1e3 / g for t, r, g in lines if t < first and r == 1 and g > 0]
        lines = [x for x in lines if x[0] >= first]
    gen = [(r, g) for _, r, g in lines if g > 0]
    gen_s = sum(r / g for r, g in gen)
    stats = {
        "peak_running": max(running, default=0),
        "peak_queued": max(queued, default=0),
        "decode_steps_est": len(re.findall(r"Decode batch", log)) * log_interval(log),
        "prefill_batches": len(re.findall(r"Prefill batch", log)),
        "retractions": len(re.findall(r"Retract requests", log)),
        "kv_tokens": int(m.group(1)) if (m := re.search(r"max_total_num_tokens=(\d+)", log)) else None,
        "gen_tok_s_mean": round(sum(r for r, _ in gen) / gen_s, 1) if gen_s else None,
        "gen_tok_s_lines": len(gen),
    }
    if since is not None:
        stats["lone_step_ms"] = round(statistics.median(lone), 1) if lone else None
    return stats


def log_interval(log: str) -> int:
    """Decode steps a decode line covers: the server's ``--decode-log-interval`` (SGLang's
    default 40 where its args are not in the log)."""
    return int(m.group(1)) if (m := re.search(r"decode_log_interval=(\d+)", log)) else 40


def read_lines(path: Path) -> list[dict]:
    """A stored JSON-lines file (an adjuster trace or its step record), gzipped or not."""
    return [json.loads(x) for x in read_log(path).splitlines() if x.strip()]


def read_log(path: Path) -> str:
    """A stored log or JSON-lines file, gzipped (``.gz``, as raw results are kept) or not."""
    opener = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        return f.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="run_one.py's JSON, rewritten in place")
    ap.add_argument("log", help="that run's server log (.log or .log.gz)")
    ap.add_argument("--since", required=True, help="when the traffic began, in the log's own stamps")
    args = ap.parse_args()
    path = Path(args.run)
    run = json.loads(path.read_text())
    run.setdefault("log_as_run", run["log"])  # a second re-derivation keeps the first figures
    run["log"] = log_stats(read_log(Path(args.log)), stamp(args.since))
    run["log_since"] = args.since
    path.write_text(json.dumps(run, indent=1))
    old, new = run["log_as_run"], run["log"]
    print(f"{run['name']}: decode log {old.get('gen_tok_s_mean')} tok/s over {old.get('gen_tok_s_lines')} lines as run; "
          f"{new['gen_tok_s_mean']} over {new['gen_tok_s_lines']} from {args.since}; lone step {new['lone_step_ms']} ms")


if __name__ == "__main__":
    main()
