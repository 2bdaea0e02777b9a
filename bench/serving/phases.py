"""Phased traffic for run_one.py: load that rises and falls within one run, one server.

    --phases 1:60,20:300,1:60     (RATE:NUM, in order)

Why: on traffic of one steady rate the best fixed split between expert weights and KV
is as good as any that moves (issue 12's "elastic >= 1.3x the best static budget" read
1.0x on steady traffic); what a moving split buys shows where the load changes: few
requests want every expert in HBM (a short step), many want KV (more of them at once).

Each phase is one ``bench_serving`` run against the same server, Poisson arrivals at its
rate, its prompts from its own slice of the ShareGPT file (the slices are disjoint and
contiguous, sized by each phase's count, so no phase finds an earlier phase's prompt in the
radix cache). Between phases the server keeps running; bench_serving's own start is a
quiet gap, as between real bursts: its tokenizer, data and warmup request, a few seconds,
since the forty-sixth session's ``warm_bench.py`` imported SGLang beside the server's start
(~25 s on the H200 before, imports included: the phased runs stored until then).

Aggregates are over every request of every phase, from bench_serving's per-request
details (``--output-details``): TTFT, and TPOT as bench_serving defines it (time after
the first token over the tokens after it, requests of more than one token).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["aggregate", "parse_phases", "percentile", "phase_datasets", "phase_summary"]


def parse_phases(spec: str) -> list[tuple[float, int]]:
    """``"1:60,20:300"`` -> ``[(1.0, 60), (20.0, 300)]``; a clear error for anything else."""
    phases = []
    for part in spec.split(","):
        try:
            rate, num = part.split(":")
            phase = (float(rate), int(num))
        except ValueError:
            raise ValueError(f"--phases {spec!r}: {part!r} is not RATE:NUM (e.g. 1:60,20:300,1:60)") from None
        if phase[0] <= 0 or phase[1] <= 0:
            raise ValueError(f"--phases {spec!r}: {part!r} needs a rate and a count above zero")
        phases.append(phase)
    return phases


def phase_datasets(plain: Path, nums: list[int], out_dir: Path) -> list[Path]:
    """One ShareGPT file per phase in ``out_dir``: disjoint contiguous slices of ``plain``
    (a JSON list of conversations), each sized in proportion to its phase's count."""
    convs = json.loads(Path(plain).read_text())
    total = sum(nums)
    if total > len(convs):
        raise ValueError(f"phases ask for {total} requests; {plain} holds {len(convs)} conversations")
    paths, start = [], 0
    for i, n in enumerate(nums):
        size = len(convs) * n // total if i < len(nums) - 1 else len(convs) - start
        path = Path(out_dir) / f"{Path(plain).stem}_phase{i + 1}of{len(nums)}.json"
        path.write_text(json.dumps(convs[start:start + size]))
        paths.append(path)
        start += size
    return paths


def _tpots_ms(detail: dict) -> list[float]:
    return [1e3 * sum(itl) / (n - 1) for itl, n in zip(detail.get("itls", []), detail.get("output_lens", []))
            if n > 1 and itl]


def percentile(xs: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile, q in [0, 1], as bench_serving reports them."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def phase_summary(rate: float, num: int, result: dict) -> dict:
    """A phase's line: its rate and count, and bench_serving's own figures for it."""
    keep = ("completed", "duration", "output_throughput", "total_output_tokens", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms")
    return {"rate": rate, "num_prompts": num, **{k: result[k] for k in keep if k in result}}


def aggregate(results: list[dict]) -> dict:
    """bench_serving-like figures over every request of every phase (``results``: each
    phase's bench_serving record with its details; a missing phase counts as none done)."""
    ttfts = []
    for r in results:
        errors = r.get("errors") or [""] * len(r.get("ttfts", []))
        ttfts += [1e3 * t for t, err in zip(r.get("ttfts", []), errors) if not err and t]
    tpots = [x for r in results for x in _tpots_ms(r)]
    duration = sum(r.get("duration", 0.0) for r in results)
    out_tokens = sum(r.get("total_output_tokens", 0) for r in results)
    return {
        "completed": sum(r.get("completed", 0) for r in results),
        "duration": duration,
        "total_output_tokens": out_tokens,
        "output_throughput": out_tokens / duration if duration else 0.0,
        # no request done: 0, as the table prints it (``completed`` says why)
        "median_ttft_ms": percentile(ttfts, 0.5) or 0.0, "p99_ttft_ms": percentile(ttfts, 0.99) or 0.0,
        "median_tpot_ms": percentile(tpots, 0.5) or 0.0, "p99_tpot_ms": percentile(tpots, 0.99) or 0.0,
    }
