"""Where offloading an expert for KV can pay: the break-even routing probability.

    python3 bench/serving/break_even.py [--out FILE.json]

Offloading an expert frees its bytes for KV: ``expert_bytes / kv_bytes_per_token``
tokens, a fraction of one request's KV. Each decode step that routes a token to
it then reads it over PCIe. Adding one request to a step of ``B`` pays only if
that request's compute plus the PCIe time of the experts that make room for it
is below what a request costs now, ``step(B) / B``. This script solves that for
the per-token routing probability ``p`` an expert must stay under. It uses the
cost model's own arithmetic (``sglang_rimuru.adjuster.cost``) and measured inputs
only:

* the serving step line of plain SGLang on the H200 (6.6 ms at batch < 8, 9.7 at
  16-23, 11.6 at 32-35: 5.9 ms + 0.17 ms a request; bench/RESULTS.md, DEVICE_NOTES);
* in-place reads of host experts at 51.2 GB/s (bench/RESULTS.md, zero-copy);
* a ShareGPT request's mean KV over its life: 291 prompt tokens + half of its 216
  output tokens (the 500 requests of the 10 req/s runs: 145,734 in, 107,938 out);
* the shapes' expert and KV-token bytes (bf16, ``sglang_rimuru.models``' specs).

Qwen3-30B-A3B's rows use Qwen1.5's step line (its own serving line is not
measured yet), so they show the bytes' effect, not that model's steps.

Writes the numbers to ``--out`` (JSON) and prints a table. No GPU, no SGLang.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang_rimuru.adjuster.cost import CostModel, touched  # noqa: E402
from sglang_rimuru.models.specs import get_spec, moe_shape  # noqa: E402

#: table name: the project's model spec of that shape
SHAPES = {"Qwen1.5-MoE-A2.7B": "qwen1.5-moe-a2.7b", "Qwen3-30B-A3B": "qwen3-30b-a3b"}
STEP_LINE_MS = (5.9, 0.17)
READ_GBPS = 51.2
REQUEST_KV_TOKENS = 145_734 / 500 + 107_938 / 500 / 2
BATCHES = (8, 16, 35, 64, 128)


def break_even(cost: CostModel, batch: int, experts_per_request: float) -> float:
    """The largest per-token routing probability at which offloading the experts that
    make room for one more request keeps ``batch + 1`` requests at least as fast per
    request as ``batch`` (bisection on ``touched``, which grows with ``p``)."""
    budget = cost.step_ms(batch) / batch - cost.per_request_ms  # time one more request may add
    if budget <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        extra = experts_per_request * touched(mid, batch + 1) * cost.expert_ms
        if extra <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def rows() -> list[dict]:
    out = []
    for name, spec in SHAPES.items():
        shape = moe_shape(get_spec(spec).config)
        expert_bytes = shape.expert_bytes
        tokens_per_expert = expert_bytes / shape.kv_bytes_per_token
        per_request = REQUEST_KV_TOKENS / tokens_per_expert
        cost = CostModel.for_expert(expert_bytes, READ_GBPS, *STEP_LINE_MS)
        uniform = shape.top_k / shape.num_experts
        for b in BATCHES:
            p = break_even(cost, b, per_request)
            out.append(dict(model=name, batch=b, expert_mib=expert_bytes / 2**20, kv_tokens_per_expert=tokens_per_expert,
                            experts_per_request=per_request, expert_read_ms=cost.expert_ms, uniform_p=uniform,
                            break_even_p=p, uniform_over_break_even=uniform / p if p > 0 else math.inf))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows here (JSON)")
    args = ap.parse_args()
    table = rows()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(step_line_ms=STEP_LINE_MS, read_gbps=READ_GBPS,
                                                  request_kv_tokens=REQUEST_KV_TOKENS, rows=table), indent=1))
    print("| model | batch | KV tokens an expert frees | experts a request needs | read ms | "
          "uniform p | break-even p | uniform / break-even |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['batch']} | {r['kv_tokens_per_expert']:.0f} | {r['experts_per_request']:.1f} | "
              f"{r['expert_read_ms']:.3f} | {r['uniform_p']:.4f} | {r['break_even_p']:.5f} | "
              f"{r['uniform_over_break_even']:.2g}x |")


if __name__ == "__main__":
    main()
