"""How fast this process reads its offloaded experts in place: one timed pass.

Why: on the H200 the server's decode step read its offloaded experts at 41 GB/s, where
the same kernel in a bench process read the same bytes at 50-52 (bench/RESULTS.md, ninth
session), and nothing but the MoE kernel ran in the step. Whether the difference lies in
the server's host store (its 54 GiB registered after the model loaded) or around it
(threads, the rest of the process) needs the rate measured inside the server, on its
own store and tables. ``SGLANG_RIMURU_PROBE_IN_PLACE=1`` makes the pool's start run
``probe_in_place`` once and log the result.

The pass: every MoE layer, ``tokens`` tokens with routing drawn uniformly at random (so
nearly every expert is routed), through ``ExpertManager.compute`` with the layer's home
table: the kernel and launch configs serving uses, offloaded experts read from the host
store. A second pass with the same tokens routed only to resident experts times the
rest of the work; the rate is the offloaded experts' bytes over the difference. Median
of ``reps`` passes after one warm-up (which compiles). Eager, not a CUDA graph: ~50 us
of launches a layer, small against the ~10 ms a layer's reads take at Qwen3's shape.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["describe", "probe_in_place", "PROBE_ENV"]

PROBE_ENV = "SGLANG_RIMURU_PROBE_IN_PLACE"


def _routing(T: int, E: int, k: int, g: torch.Generator, allowed: list[int] | None):
    """Top-k of random logits (float32 weights, int32 ids); only ``allowed`` experts if given."""
    logits = torch.randn(T, E, generator=g)
    if allowed is not None:
        mask = torch.full((E,), float("-inf"))
        mask[allowed] = 0.0
        logits = logits + mask
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w, ids.to(torch.int32)


def probe_in_place(manager, tokens: int = 100, reps: int = 3, seed: int = 0) -> dict:
    """Time one pass over every MoE layer reading offloaded experts in place (see the
    module docstring). Returns the numbers; ``describe`` makes the log line."""
    shape, res = manager.shape, manager.residency
    if not manager.host_reads:
        return {"skipped": "offloaded experts are not read in place (no pinned host store)"}
    k = min(shape.top_k, shape.num_experts)
    g = torch.Generator().manual_seed(seed)
    dev = manager.device
    hidden = torch.randn(tokens, shape.hidden, generator=g).to(shape.dtype).to(dev)
    plan, base_plan, reads = [], [], 0
    for l in shape.layer_ids:
        w, ids = _routing(tokens, shape.num_experts, k, g, None)
        out = set(res.offloaded(l))
        reads += len(out & set(ids.unique().tolist()))
        plan.append((l, w.to(dev), ids.to(dev)))
        resident = sorted(set(range(shape.num_experts)) - out)
        if len(resident) >= k:
            bw, bids = _routing(tokens, shape.num_experts, k, g, resident)
            base_plan.append((l, bw.to(dev), bids.to(dev)))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(calls) -> float:
        def one() -> float:
            sync()
            t0 = time.perf_counter()
            for l, w, ids in calls:
                manager.compute(l, hidden, w, ids, manager.table(l))
            sync()
            return (time.perf_counter() - t0) * 1e3

        one()  # warm-up: compiles, faults in the tables
        return statistics.median(one() for _ in range(max(1, reps)))

    ms = timed(plan)
    base_ms = timed(base_plan) if len(base_plan) == len(plan) else 0.0
    nbytes = reads * shape.expert_bytes
    extra = ms - base_ms
    return {"layers": len(plan), "tokens": tokens, "reads": reads, "gb": nbytes / 1e9, "ms": ms,
            "base_ms": base_ms, "GBps": nbytes / (extra * 1e6) if extra > 0 else float("nan")}


def describe(r: dict) -> str:
    if "skipped" in r:
        return f"sglang-rimuru in-place read probe skipped: {r['skipped']}"
    return (f"sglang-rimuru in-place read probe: {r['layers']} MoE layers x {r['tokens']} tokens read "
            f"{r['reads']} offloaded experts ({r['gb']:.2f} GB) in {r['ms']:.1f} ms against {r['base_ms']:.1f} ms "
            f"routed to resident experts only: {r['GBps']:.1f} GB/s")
