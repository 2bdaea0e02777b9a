"""Offloaded experts read in place (zero-copy) by the paged MoE kernel: cost per layer.

    python3 bench/kernel/zero_copy_sweep.py --out zero_copy_sweep.json [--budget-s 120]

For the Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B shapes, one MoE layer, uniform
routing, T tokens (1, 8, 32, 128): the layer with every expert in HBM, and with k
of the routed experts (k = 1, 2, 4, 8, the most routed first) on pinned host
pages, read in place over PCIe. Each variant timed as a replayed CUDA graph
(what decode runs). Against the physical bound: t(k) >= t(0) + bytes / ceiling,
where bytes = the k experts' three matrices and ceiling = the measured pinned
host->device copy rate (also reported). ``traffic`` = bytes / (t(k) - t(0)): the
PCIe rate the in-place reads reach on top of the compute they do not overlap;
``hidden`` = how much of bytes/ceiling the kernel hid behind its compute.
Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from rimuru_kernels import pack_contiguous_weights, paged_fused_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_rig import capture_graph  # noqa: E402  (the kernel bench's capture: warm-up on a side stream)

SHAPES = {"qwen1.5-moe-a2.7b": (60, 2048, 1408, 4), "qwen3-30b-a3b": (128, 2048, 768, 8)}


def graph_ms(fn) -> float:
    """Median ms of one replay of fn() captured in a CUDA graph (7 samples of 3 replays)."""
    g = capture_graph(fn)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        a.record()
        for _ in range(3):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 3)
    times.sort()
    return times[len(times) // 2]


def copy_ceiling_gbps() -> float:
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return 5 * n / (a.elapsed_time(b) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    t_start = time.time()
    ceiling = copy_ceiling_gbps()
    res = {"copy_ceiling_GBps": ceiling, "rows": []}
    print(f"pinned host->device copy: {ceiling:.1f} GB/s")
    print(f"{'shape':18} {'T':>4} {'k':>2} {'t_ms':>7} {'t0_ms':>7} {'bound_ms':>8} {'traffic_GBps':>12} {'hidden':>7}")
    g = torch.Generator().manual_seed(0)
    for name, (E, H, I, top_k) in SHAPES.items():
        w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
        w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).cuda()
        paged = pack_contiguous_weights(w13, w2)
        host = paged.pool.view(-1)[: 3 * E * I * H].cpu().pin_memory()  # host page 3e+m = pool page 3e+m
        del w13, w2
        for T in (1, 8, 32, 128):
            if time.time() - t_start > args.budget_s:
                break
            logits = torch.randn(T, E, generator=g)
            weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
            hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
            weights, ids = weights.cuda(), ids.to(torch.int32).cuda()
            routed = torch.bincount(ids.view(-1).long(), minlength=E).cpu()
            order = [int(e) for e in torch.argsort(routed, descending=True, stable=True) if routed[e] > 0]
            table = paged.page_table.clone()

            def layer():
                paged_fused_moe(hidden, paged.pool, table, weights, ids, inter_size=I,
                                page_elems=paged.page_elems, host_pages=host)

            t0 = graph_ms(layer)
            want = paged_fused_moe(hidden, paged.pool, table, weights, ids, inter_size=I,
                                   page_elems=paged.page_elems)
            for k in (1, 2, 4, 8):
                if k > len(order):
                    break
                table.copy_(paged.page_table)
                for e in order[:k]:
                    table[e] = torch.tensor([-2 - (3 * e + m) for m in range(3)], dtype=torch.int32)
                t = graph_ms(layer)
                got = paged_fused_moe(hidden, paged.pool, table, weights, ids, inter_size=I,
                                      page_elems=paged.page_elems, host_pages=host)
                nbytes = k * 3 * I * H * 2
                pcie_ms = nbytes / (ceiling * 1e6)
                extra = max(t - t0, 1e-6)
                row = dict(shape=name, T=T, k=k, t_ms=t, t0_ms=t0, bound_ms=t0 + pcie_ms, bytes=nbytes,
                           traffic_GBps=nbytes / (extra * 1e6), traffic_share=min(1.0, pcie_ms / extra),
                           hidden=max(0.0, 1 - extra / pcie_ms), equal=bool(torch.equal(got, want)))
                res["rows"].append(row)
                print(f"{name:18} {T:4d} {k:2d} {t:7.3f} {t0:7.3f} {row['bound_ms']:8.3f} "
                      f"{row['traffic_GBps']:12.1f} {row['hidden']:7.2f} {'' if row['equal'] else 'DIFF'}",
                      flush=True)
        del paged, host
        torch.cuda.empty_cache()
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
