"""The traffic's own floor under a serving run's duration, hence its throughput ceiling.

    python3 bench/serving/makespan.py --rate 10 --num 500 [--seed 1] [--step-ms 3.75]

bench_serving's throughput is total output tokens / duration, and the duration
ends with the last request's last token. A request that arrives at ``a`` and
asks for ``o`` tokens cannot finish before ``a + (o - 1) * step``, whatever the
server, where ``step`` is the fastest decode step any system reaches (one token
per step per request; prefill and the first token are left out, so this is a
lower bound). Below saturation that bound, not the server, decides the ratio
of two systems' throughputs: on the anchors' traffic at 10 req/s request 498
(6,260 output tokens) arrives at 51.06 s, so no server finishes before
51.06 s + 6,259 x 3.75 ms = 74.5 s, and none can serve more than 1.16x a server
that takes 86.3 s.

The arrivals are bench_serving's own (SGLang 0.5.17 ``benchmark/serving.py``:
``np.random.seed(seed)`` at start, then one ``np.random.exponential(1 / rate)``
interval after each request); the output lengths are the anchors' file's
(``../shared/data/...lens.json``, ``[prompt_len, output_len]`` in bench order,
which is seed 1's sample: another seed shuffles the file differently, and a run
whose total output tokens do not match the file's first ``num`` is not this
traffic, so ``floor_of_run`` returns None for it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

LENS = Path(__file__).resolve().parents[2].parent / "shared/data/sharegpt_1000_seed1_ctx8192.json.lens.json"
#: plain SGLang's decode step at batch 1 with CUDA graphs, Qwen1.5-MoE-A2.7B shape on the H200
#: (bench/RESULTS.md, "Real model shapes serve in pool modes": 3.75 ms), the fastest step measured
FASTEST_STEP_MS = 3.75
LENS_SEED = 1  # the seed whose sample the lens file holds


class Floor(NamedTuple):
    makespan_s: float  # no server finishes this traffic sooner
    last_arrival_s: float
    binding: int  # index (bench order) of the request that sets the floor
    binding_output: int  # its output tokens
    total_output: int
    ceiling_tok_s: float  # total_output / makespan_s


def arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times of bench_serving's ``num`` requests at Poisson ``rate`` (seconds from the first)."""
    rs = np.random.RandomState(seed)  # the legacy global stream np.random.seed(seed) resets
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += float(rs.exponential(1.0 / rate))
    return out


def floor(outputs: list[int], rate: float, seed: int, step_ms: float = FASTEST_STEP_MS) -> Floor:
    """The earliest any server can finish requests with these output lengths (bench order)."""
    if not outputs:
        raise ValueError("no requests")
    if step_ms <= 0:
        raise ValueError(f"step_ms must be > 0, got {step_ms}")
    arr = arrivals(len(outputs), rate, seed)
    ends = [a + max(0, o - 1) * step_ms / 1e3 for a, o in zip(arr, outputs)]
    i = max(range(len(ends)), key=ends.__getitem__)
    total = sum(outputs)
    return Floor(ends[i], arr[-1], i, outputs[i], total, total / ends[i])


def load_requests(num: int, lens: Path = LENS) -> list[tuple[int, int]]:
    """The first ``num`` requests of the lens file, (prompt, output) tokens each, bench order."""
    rows = json.loads(Path(lens).read_text())
    if num > len(rows):
        raise ValueError(f"{lens} holds {len(rows)} requests, not {num}")
    return [(int(i), int(o)) for i, o in rows[:num]]


def load_outputs(num: int, lens: Path = LENS) -> list[int]:
    return [o for _, o in load_requests(num, lens)]


def floor_of_run(run: dict, step_ms: float = FASTEST_STEP_MS, lens: Path = LENS) -> Floor | None:
    """The floor of a run_one.py result, or None when its traffic is not the lens file's
    (another seed's sample: its total output tokens differ), it has no bench summary, or it
    has no one rate (phased traffic, bench/serving/phases.py)."""
    total = run.get("bench", {}).get("total_output_tokens")
    if total is None or run.get("rate") is None or not Path(lens).exists():
        return None
    try:
        outputs = load_outputs(run["num_prompts"], lens)
    except ValueError:  # more requests than the file holds: not its sample either
        return None
    if sum(outputs) != total:
        return None
    return floor(outputs, run["rate"], run.get("seed", LENS_SEED), step_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--num", type=int, required=True)
    ap.add_argument("--seed", type=int, default=LENS_SEED, help="arrival seed (the lens file is seed 1's sample)")
    ap.add_argument("--step-ms", type=float, default=FASTEST_STEP_MS)
    ap.add_argument("--lens", default=str(LENS))
    args = ap.parse_args()
    f = floor(load_outputs(args.num, Path(args.lens)), args.rate, args.seed, args.step_ms)
    print("| rate | requests | last arrival s | floor s | set by (output tokens) | ceiling output tok/s |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.rate:g} | {args.num} | {f.last_arrival_s:.1f} | {f.makespan_s:.1f} | "
          f"#{f.binding} ({f.binding_output}) | {f.ceiling_tok_s:.0f} |")


if __name__ == "__main__":
    main()
