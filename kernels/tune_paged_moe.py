"""Benchmark and tune paged_fused_moe on a CUDA GPU (bf16).

    python kernels/tune_paged_moe.py --bench            # shipped configs: paged vs contiguous
    python kernels/tune_paged_moe.py --tune --out DIR   # sweep, write E=..,N=..,device_name=...json

Weights sit on shuffled, padded pages of one pool (what the server sees); the
contiguous run uses the same kernel on pages 3e, 3e+1, 3e+2. Times are CUDA
event medians from triton.testing.do_bench, for the whole call (align, both
GEMMs, SiLU*up, top-k sum).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rimuru_kernels import (  # noqa: E402
    pack_contiguous_weights,
    pack_weights_into_pool,
    paged_fused_moe,
)
from rimuru_kernels.moe_config import (  # noqa: E402
    config_file_name,
    device_name,
    get_paged_moe_config,
)

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def setup(E, H, I, k, max_tokens, page_pad=0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
    n = 3 * E + E // 2
    table = torch.randperm(n, generator=g, device="cuda")[: 3 * E].view(E, 3).int()
    pool = pack_weights_into_pool(w13, w2, table, I * H + page_pad, n, fill=0.0)
    x = torch.randn(max_tokens, H, generator=g, device="cuda").bfloat16()
    logits = torch.randn(max_tokens, E, generator=g, device="cuda")
    tw, ti = torch.topk(logits.softmax(-1), k)
    return dict(w13=w13, w2=w2, pool=pool, table=table, page_elems=I * H + page_pad,
                x=x, tw=tw, ti=ti.int(), I=I)


def time_call(d, T, pool, table, page_elems, config=None, graph=True):
    """Milliseconds per call: CUDA-graph replay (GPU time, as in decode) or eager."""
    x, tw, ti = d["x"][:T], d["tw"][:T], d["ti"][:T]
    out = torch.empty_like(x)

    def fn():
        paged_fused_moe(x, pool, table, tw, ti, inter_size=d["I"], page_elems=page_elems,
                        config=config, out=out, validate=False)

    if not graph:
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    reps = 10
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del g
    return sorted(times)[len(times) // 2]


def candidates(T):
    """Configs to try for T tokens, likeliest first."""
    if T <= 64:
        space = ([16], [64, 128, 32], [128, 256, 64], [4], [3, 4, 2, 5], [1])
    elif T <= 512:
        space = ([32, 64, 16], [128, 64, 256], [128, 64], [4, 8], [3, 4, 2], [1, 16])
    else:
        space = ([128, 64], [256, 128], [64, 128], [8, 4], [4, 3], [16, 1])
    for bm, bn, bk, w, s, gm in itertools.product(*space):
        if (bm * bk + bk * bn) * 2 * s > 200 * 1024:  # shared memory
            continue
        if (bm * bn >= 128 * 128) != (w == 8):  # 8 warps only for big tiles
            continue
        yield dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm,
                   num_warps=w, num_stages=s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400.0, help="tuning time limit")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    E, H, I, k = a.E, a.H, a.I, a.k
    d = setup(E, H, I, k, max(a.tokens))
    packed = pack_contiguous_weights(d["w13"], d["w2"])
    print(f"{device_name(torch.device('cuda'))} E={E} H={H} I={I} k={k}", flush=True)

    if a.bench:
        print("graph: CUDA-graph replay; eager: launched from Python each call")
        print(f"{'T':>6} {'paged us':>10} {'contig us':>10} {'eager us':>9} "
              f"{'weights GB/s':>13} {'TFLOP/s':>8}")
        for T in a.tokens:
            paged = time_call(d, T, d["pool"], d["table"], d["page_elems"])
            contig = time_call(d, T, packed.pool, packed.page_table, packed.page_elems)
            eager = time_call(d, T, d["pool"], d["table"], d["page_elems"], graph=False)
            routed = torch.unique(d["ti"][:T]).numel()
            gbs = routed * 3 * I * H * 2 / (paged * 1e-3) / 1e9
            tflops = T * k * 6 * I * H / (paged * 1e-3) / 1e12
            print(f"{T:>6} {paged * 1e3:>10.1f} {contig * 1e3:>10.1f} {eager * 1e3:>9.1f} {gbs:>13.0f} "
                  f"{tflops:>8.1f}", flush=True)

    if a.tune:
        import time

        start = time.time()
        best = {}
        for i, T in enumerate(a.tokens):
            deadline = start + a.budget_s * (i + 1) / len(a.tokens)
            base_cfg = get_paged_moe_config(E, I, T, torch.device("cuda"))
            best_t, best_cfg = time_call(d, T, d["pool"], d["table"], d["page_elems"], base_cfg), base_cfg
            base_t = best_t
            for cfg in candidates(T):
                if time.time() > deadline:
                    break
                try:
                    t = time_call(d, T, d["pool"], d["table"], d["page_elems"], cfg)
                except Exception as exc:  # out of resources etc.
                    print("skip", cfg, type(exc).__name__, str(exc)[:80], flush=True)
                    continue
                if t < best_t:
                    best_t, best_cfg = t, cfg
            best[str(T)] = best_cfg
            print(f"T={T}: {base_t * 1e3:.1f} us -> {best_t * 1e3:.1f} us {best_cfg}",
                  f"({time.time() - start:.0f} s)", flush=True)
        path = os.path.join(a.out, config_file_name(E, I, device_name(torch.device("cuda"))))
        with open(path, "w") as f:
            json.dump(best, f, indent=4)
            f.write("\n")
        print("wrote", path)
        print(json.dumps(best))


if __name__ == "__main__":
    main()
