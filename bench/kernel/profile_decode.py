"""Where the paged MoE's time goes at decode sizes (T <= 64, and 4096), on the device.

Times every stage of ``paged_fused_moe`` alone (a CUDA graph of that stage over
rotating routing sets): the token alignment (one-program kernel, the chunked
kernels, and SGLang's sgl_kernel align for reference), the gate/up GEMM with its
fused SiLU*up (and, for reference, unfused plus the separate SiLU kernel), the
down GEMM and the top-k sum (Triton, and torch.sum for reference), plus an empty
Triton kernel (the floor of one launch in a graph) and the whole call. Then a torch.profiler trace
of the whole call's graph gives each kernel's own device time, so
``whole - sum(kernel times)`` is what the launches between kernels cost.

    source bench/device/setup_device.sh
    python3 bench/kernel/profile_decode.py --out $OUT/profile_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default="profile_decode.json")
ap.add_argument("--shapes", nargs="*", default=None)
ap.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 16, 64, 4096])
ap.add_argument("--cpu-smoke", action="store_true", help="plumbing only: tiny shape, interpreter, host clock")
ARGS = ap.parse_args()
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import paged_rig as rig  # noqa: E402
from rimuru_kernels import get_paged_moe_config, paged_fused_moe  # noqa: E402
from rimuru_kernels.moe_config import get_paged_moe_down_config  # noqa: E402
from rimuru_kernels.paged_moe import _sum_top_k  # noqa: E402


@triton.jit
def _empty_kernel(p):
    tl.store(p, 1)


def sglang_align():
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size

        return moe_align_block_size, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def stage_us(fn, calls):
    if ARGS.cpu_smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6 / calls
    return rig.graph_time_us(fn, calls, min_ms=1.0, replays=7)


def kernel_times(fn, iters=20):
    """{kernel name: mean device µs per call} from torch.profiler over a graph of fn."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:90]] = round(t / iters, 3)
    return out


def profile_shape(r, T, res, sgl_align):
    dev = r.device
    nsets = rig.input_sets(T)
    sets = r.inputs(T, nsets)
    cfg = get_paged_moe_config(r.E, r.I, T, dev)
    dcfg = get_paged_moe_down_config(r.E, r.I, T, dev) or cfg
    bm = cfg["BLOCK_SIZE_M"]
    al = [r.align(s[2], bm) for s in sets]
    gate_up = [torch.empty(T * r.k, 2 * r.I, dtype=r.dtype, device=dev) for _ in sets]
    one = T * r.k <= 1024  # the one-program align's limit
    al_unfused = [r.align(s[2], bm, one_program=one) for s in sets]
    act = [torch.empty(T * r.k, r.I, dtype=r.dtype, device=dev) for _ in sets]
    down = [torch.empty(T * r.k, r.H, dtype=r.dtype, device=dev) for _ in sets]
    out = [torch.empty(T, r.H, dtype=r.dtype, device=dev) for _ in sets]
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    stages = {
        "empty_launch": lambda: [_empty_kernel[(1,)](flag) for _ in sets],
        "align_chunked": lambda: [r.align(s[2], bm, one_program=False) for s in sets],
        "gemm_up_silu": lambda: [r.gemm_up(s[0], s[1], a, o, cfg) for s, a, o in zip(sets, al, act)],
        "gemm_up": lambda: [r.gemm_up(s[0], s[1], a, o, cfg, fuse_silu=False)
                            for s, a, o in zip(sets, al_unfused, gate_up)],
        "silu_and_mul": lambda: [r.silu(g, a) for g, a in zip(gate_up, act)],
        "gemm_down": lambda: [r.gemm_down(a, s[1], x, o, dcfg) for s, x, a, o in zip(sets, al, act, down)],
        "topk_sum": lambda: [_sum_top_k(d.view(T, r.k, r.H), o) for d, o in zip(down, out)],
        "topk_sum_torch": lambda: [torch.sum(d.view(T, r.k, r.H), dim=1, out=o) for d, o in zip(down, out)],
        "whole_call": lambda: [paged_fused_moe(s[0], r.pool, r.table, s[1], s[2], inter_size=r.I,
                                               page_elems=r.page_elems, out=o, validate=False)
                               for s, o in zip(sets, out)],
    }
    if one:
        stages["align_one_program"] = lambda: [r.align(s[2], bm, one_program=True) for s in sets]
    if sgl_align is not None:
        stages["align_sglang"] = lambda: [sgl_align(s[2], bm, r.E) for s in sets]
    rec = dict(shape=r.name, tokens=T, config=cfg, down_config=dcfg, input_sets=nsets,
               distinct_experts_mean=r.distinct_experts(sets), us={})
    for name, fn in stages.items():
        try:
            rec["us"][name] = round(stage_us(fn, nsets), 3)
        except Exception as exc:
            rec.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    us = rec["us"]
    mat_bytes = r.I * r.H * 2
    n_e = rec["distinct_experts_mean"]
    if "gemm_up_silu" in us and "gemm_down" in us:
        rec["gemm_up_silu_gbs"] = round(n_e * 2 * mat_bytes / (us["gemm_up_silu"] * 1e-6) / 1e9, 1)
        rec["gemm_down_gbs"] = round(n_e * mat_bytes / (us["gemm_down"] * 1e-6) / 1e9, 1)
        rec["gemms_gbs"] = round(n_e * 3 * mat_bytes / ((us["gemm_up_silu"] + us["gemm_down"]) * 1e-6) / 1e9, 1)
        # What paged_fused_moe launches: no align at T == 1 (slot blocks), one program up to 1024 slots.
        align = [] if T == 1 else ["align_one_program" if T * r.k <= 1024 else "align_chunked"]
        parts = align + ["gemm_up_silu", "gemm_down", "topk_sum"]
        rec["sum_of_stages_us"] = round(sum(us[p] for p in parts if p in us), 3)
    if "whole_call" in us and not ARGS.cpu_smoke:
        rec["whole_call_gbs"] = round(n_e * 3 * mat_bytes / (us["whole_call"] * 1e-6) / 1e9, 1)
        try:
            kt = kernel_times(lambda: paged_fused_moe(sets[0][0], r.pool, r.table, sets[0][1], sets[0][2],
                                                      inter_size=r.I, page_elems=r.page_elems, out=out[0],
                                                      validate=False))
            rec["profiler_kernel_us"] = kt
            rec["profiler_kernels_sum_us"] = round(sum(kt.values()), 3)
        except Exception as exc:
            rec["profiler_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    res["sizes"].append(rec)
    return rec


def main():
    t0 = time.time()
    dev = torch.device("cpu" if ARGS.cpu_smoke else "cuda")
    sgl, sgl_err = (None, "cpu smoke") if ARGS.cpu_smoke else sglang_align()
    shapes = ({"tiny (E=8,k=2)": dict(E=8, k=2, H=64, I=32)} if ARGS.cpu_smoke
              else rig.pick_shapes(ARGS.shapes))
    res = dict(meta=dict(device="cpu smoke" if ARGS.cpu_smoke else torch.cuda.get_device_name(), torch=torch.__version__,
                         triton=triton.__version__, sglang_align_error=sgl_err, hbm_gbs=rig.HBM_GBS),
               sizes=[])
    for name, shape in shapes.items():
        r = rig.Rig(name, **shape, device=dev, dtype=torch.float32 if ARGS.cpu_smoke else torch.bfloat16)
        for T in ARGS.tokens:
            try:
                profile_shape(r, T, res, sgl)
            except Exception as exc:
                res["sizes"].append(dict(shape=name, tokens=T, error=f"{type(exc).__name__}: {exc}",
                                         traceback=traceback.format_exc()[-1500:]))
            with open(ARGS.out, "w") as f:
                json.dump(res, f, indent=1)
        del r
        torch.cuda.empty_cache()
    res["meta"]["elapsed_s"] = round(time.time() - t0, 1)
    with open(ARGS.out, "w") as f:
        json.dump(res, f, indent=1)
    cols = ["empty_launch", "align_one_program", "align_chunked", "align_sglang", "gemm_up_silu", "gemm_up",
            "silu_and_mul", "gemm_down", "topk_sum", "topk_sum_torch", "whole_call"]
    print("\n| shape | T | " + " | ".join(cols) + " | stages sum | kernels (profiler) | GEMMs GB/s | whole GB/s |")
    print("|---" * (len(cols) + 6) + "|")
    for rec in res["sizes"]:
        if "error" in rec:
            print(f"| {rec['shape']} | {rec['tokens']} | error {rec['error'][:100]} |")
            continue
        us = rec["us"]
        print(f"| {rec['shape']} | {rec['tokens']} | " + " | ".join(str(us.get(c, "-")) for c in cols)
              + f" | {rec.get('sum_of_stages_us')} | {rec.get('profiler_kernels_sum_us', '-')} | "
              f"{rec.get('gemms_gbs')} | {rec.get('whole_call_gbs')} |")
    for rec in res["sizes"][:1]:
        print("profiler kernels (first size):", rec.get("profiler_kernel_us") or rec.get("profiler_error"))
    print(f"elapsed {res['meta']['elapsed_s']} s")


if __name__ == "__main__":
    main()
