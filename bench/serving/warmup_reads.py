"""How fast each run's machine read offloaded experts in place, from the warm-up before its traffic.

    python3 bench/serving/warmup_reads.py RUN_DIR/NAME [...] [--vs RUN_DIR/NAME] [--bands]

Two runs of one server code on two machines of one kind need not read host memory at one
rate: on four H100s lent for the same Qwen3 card (bench/RESULTS.md, thirty-first session) the
same 36 warm-up decode steps took 40 ms or 58-63 ms. A pool-mode run's step record begins
with those steps, before its first request (``window.began_of``): batch 1, the same
resident split and so the same expected in-place reads in every run of one model, card and
ranking. Their median time is the machine's, and the code's, lone step, and their reads over
it a rate of the host link that the traffic's steps do not give cleanly (those mix batch
sizes, prefill passes and the adjuster's moves). A ratio of two runs' output tokens says as
much about their machines as about their servers where these differ.

Per run: the steps counted, their batch (1), expected reads a step, median ms, and GB/s
(reads x the model's expert bytes over the median: a floor of the link's rate, the step's
own compute counted in; none where a step reads fewer than ``MIN_READS`` experts, as under
a ranking that keeps the hot ones, and the step is mostly compute); with ``--vs``, each
run's median over that run's where the two warm-ups read the same experts within 5 % (the
same work), else "other work". Also the MoE kernel the server's start line names (``auto -> ...: exact`` where
the GPU has no tuned table of the fast kernel): the kernel sets the rate as much as the link.

``--bands``: where the warm-up reads nothing (Qwen1.5 at 32 GB holds every expert until the
traffic comes), the traffic's own reading steps by batch band instead: each band's median step
and median expected reads (bench/RESULTS.md, forty-fifth session: at 33-48 running one H100 took
13.6 ms for 11.3 reads where another took 15.3 ms for 10.4). Runs of one routing and traffic
only: the reads a step takes depend on what the adjuster evicted, so more reads in less time
says "faster machine", the other way round says nothing alone.
No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_log import read_lines, read_log  # noqa: E402
from offload_sweep import shape_of  # noqa: E402
from window import began_of  # noqa: E402

#: the start line's "...; MoE kernel: auto -> no tuned table ...: exact (SGLang's configs, ...)"; the
#: reason may hold colons of its own ("... here or in SGLang: the kernel's default table (...): fast"),
#: so the choice is the first "exact" or "fast" after a colon, not after the first colon
KERNEL = re.compile(r"MoE kernel: (?:auto -> [^;]*?: )?(exact|fast)\b")
MIN_READS = 10  # expected reads a warm-up step below which its GB/s is left out
BAND = 16  # batch sizes a --bands row spans (step_fit.py's)


def warmup_steps(records: list[dict], began: float) -> list[list[float]]:
    """The decode steps ([batch, ms, expected reads]) the record holds before the traffic began."""
    return [s for r in records if r["t"] <= began for s in r.get("steps", [])]


def lone_warmup(records: list[dict], began: float) -> dict | None:
    """The batch-1 steps before the traffic: how many, expected reads a step and median ms
    (run_one.py stores this in each run's JSON as ``warmup``); None without any."""
    lone = [s for s in warmup_steps(records, began) if s[0] == 1]
    if not lone:
        return None
    return {"steps": len(lone), "reads": round(statistics.median(s[2] for s in lone), 1),
            "median_ms": round(statistics.median(s[1] for s in lone), 2)}


def reading_bands(records: list[dict], began: float) -> list[dict]:
    """The traffic's decode steps that read offloaded experts (expected reads > 0), by batch
    band of ``BAND``: steps counted, median ms and median expected reads a step."""
    bands: dict[int, list[list[float]]] = {}
    for r in records:
        if r["t"] > began:
            for b, ms, reads in r.get("steps", []):
                if reads > 0:
                    bands.setdefault((int(b) - 1) // BAND, []).append([ms, reads])
    return [{"batch": f"{k * BAND + 1}-{k * BAND + BAND}", "steps": len(v),
             "median_ms": round(statistics.median(x[0] for x in v), 2),
             "reads": round(statistics.median(x[1] for x in v), 1)} for k, v in sorted(bands.items())]


def kernel_of(log: str) -> str | None:
    m = KERNEL.search(log)
    return m.group(1) if m else None


def step_record(run: dict, base: Path) -> tuple[list[dict], float] | None:
    """A stored run's step record and its traffic's start, or None without either."""
    steps_path = base.with_name(base.name + "_trace.steps.jsonl.gz")
    if not steps_path.exists():
        return None
    records = read_lines(steps_path)
    began = began_of(run, base, records)
    return None if began is None else (records, began)


def warmup_rate(run: dict, base: Path) -> dict | None:
    """The run's warm-up figures, or None where it has no step record or no traffic start."""
    got = step_record(run, base)
    w = lone_warmup(*got) if got else None
    if w is None:
        return None
    log_path = base.with_name(base.name + ".log.gz")
    reads, ms = w["reads"], w["median_ms"]
    return {"run": run["name"], "gpu": run.get("gpu"), "code_digest": run.get("code_digest"),
            "kernel": kernel_of(read_log(log_path)) if log_path.exists() else None, **w,
            "GBps": round(reads * shape_of(run).expert_bytes / (ms * 1e6), 1) if reads >= MIN_READS else None}


def bands_of(run: dict, base: Path) -> list[dict]:
    """``reading_bands`` of a stored run ([] without a step record or a traffic start)."""
    got = step_record(run, base)
    return reading_bands(*got) if got else []


def print_bands(names: list[str]) -> None:
    """One row a run, one column a batch band: "median ms / median reads"."""
    rows = {}
    for name in names:
        base = Path(name)
        rows[name] = {b["batch"]: b for b in bands_of(json.loads(base.with_name(base.name + ".json").read_text()), base)}
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: int(c.split("-")[0]))
    print("\nreading steps (median ms / median expected reads, by running batch):\n")
    print("| run | dir | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for name, r in rows.items():
        cells = [f"{r[c]['median_ms']} / {r[c]['reads']}" if c in r else "-" for c in cols]
        print(f"| {Path(name).name} | {Path(name).parent.name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN_DIR/NAME of each run (NAME.json beside its step record)")
    ap.add_argument("--vs", help="RUN_DIR/NAME: each run's median warm-up step over this run's")
    ap.add_argument("--bands", action="store_true",
                    help="also the traffic's reading steps by batch band (a warm-up that reads nothing)")
    args = ap.parse_args()

    def of(name: str) -> dict | None:
        base = Path(name)
        return warmup_rate(json.loads(base.with_name(base.name + ".json").read_text()), base)

    ref = of(args.vs) if args.vs else None
    if args.vs and ref is None:
        raise SystemExit(f"warmup_reads.py: {args.vs} has no warm-up steps to compare with")
    print("| run | dir | code | kernel | warm-up steps | reads a step | median ms | GB/s |"
          + (" vs |" if ref else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if ref else ""))
    # the reference's own row last, so that the ratios' denominator is on the table
    for name in args.runs + ([args.vs] if args.vs and args.vs not in args.runs else []):
        w = of(name)
        if w is None:
            print(f"| {Path(name).name} | {Path(name).parent.name} | no step record or warm-up | | | | | |")
            continue
        # a ratio only between runs whose warm-up did the same work (the same expected reads)
        same = ref and abs(w["reads"] - ref["reads"]) <= 0.05 * max(ref["reads"], 1)
        vs = (f" {w['median_ms'] / ref['median_ms']:.2f}x |" if same else " other work |") if ref else ""
        print(f"| {w['run']} | {Path(name).parent.name} | {w['code_digest']} | {w['kernel']} | {w['steps']} | "
              f"{w['reads']} | {w['median_ms']} | {'' if w['GBps'] is None else w['GBps']} |{vs}")
    if args.bands:
        print_bands(args.runs + ([args.vs] if args.vs and args.vs not in args.runs else []))


if __name__ == "__main__":
    main()
