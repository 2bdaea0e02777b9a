"""Tune the paged MoE kernel's launch configs per shape and token count (one device call).

For each shape (Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B) and token count it times the
gate/up GEMM (with its fused SiLU*up epilogue: the default path) and the down
GEMM *separately*, each over a candidate grid, on a
scattered pool with uniform routing rotated over several input sets (CUDA-graph
replays, median). For every BLOCK_SIZE_M it keeps the best gate/up and the best
down config, re-times the leaders, and picks the BLOCK_SIZE_M with the smallest
sum (one token alignment serves both GEMMs, so they share it). SGLang's own
tuned config for the size and the table now shipped are timed the same way,
for reference.

Writes, under --out-dir, ``E=..,N=..,device_name=...json`` and ``..._down.json``
(SGLang's file naming and keys; drop them into kernels/rimuru_kernels/configs/)
and ``tune_paged_moe.json`` with every timing. Compilation runs first in
--workers processes (Triton's disk cache is shared), timing in this one.

    source bench/device/setup_device.sh
    python3 bench/kernel/tune_paged_moe.py --out-dir $OUT/tuned

The device call does not bring back files whose names hold '=' or ',', so the
tables are also inside the JSON; write them out here with

    python3 bench/kernel/tune_paged_moe.py --tables-from tune_paged_moe.json \
        --out-dir kernels/rimuru_kernels/configs

--cpu-smoke checks the plumbing here (tiny shape, Triton interpreter, host clock).

``--kernel sglang`` tunes SGLang 0.5.17's ``fused_moe_kernel`` instead, with
the same grid, inputs, timing and pick: its gate/up GEMM (unfused, [T*k, 2I];
SGLang's SiLU*up is a separate kernel) and its down GEMM, as
``fused_experts_impl`` launches them on contiguous weights
(``sglang_rig.SGLangRig``). Its reference is the config SGLang picks today
(its shipped table, or its default config where it has none). It writes
SGLang's tables, named by SGLang's own ``get_config_file_name``, in the layout
its lookup reads with ``SGLANG_MOE_CONFIG_DIR=<out-dir>``
(``<out-dir>/configs/triton_<version>/E=..,N=..,device_name=...json`` and
``..._down.json``), and ``tune_sglang_moe.json``:

    python3 bench/kernel/tune_paged_moe.py --kernel sglang --out-dir $OUT/sglang_tuned --workers 14
    python3 bench/kernel/bench_moe_kernels.py --sglang-tuned-dir $OUT/sglang_tuned ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out-dir", default="tuned")
ap.add_argument("--kernel", default="paged", choices=["paged", "sglang"],
                help="whose GEMMs to tune: the paged kernel's (fused SiLU*up) or SGLang's fused_moe_kernel")
ap.add_argument("--shapes", nargs="*", default=None)
ap.add_argument("--tokens", type=int, nargs="*", default=None)
ap.add_argument("--workers", type=int, default=12, help="compile processes (0 = compile while timing)")
ap.add_argument("--budget-s", type=float, default=400.0, help="stop timing new sizes after this")
ap.add_argument("--leaders", type=int, default=4, help="configs per GEMM re-timed for the final pick")
ap.add_argument("--cpu-smoke", action="store_true")
ap.add_argument("--tables-from", default=None, help="write the config tables of a tune JSON and exit")
ARGS = ap.parse_args()
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"

T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import paged_rig as rig  # noqa: E402
from rimuru_kernels import moe_config  # noqa: E402

SGLANG = ARGS.kernel == "sglang"
if SGLANG:
    import sglang_rig  # noqa: E402

SMEM_LIMIT = 220 * 1024  # H100/H200: 227 KB dynamic shared memory per block, less some slack
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def cfg(bm, bn, bk, g, w, s):
    return dict(zip(KEYS, (bm, bn, bk, g, w, s)))


def smem_ok(c, which: str = "down") -> bool:
    """Fits in shared memory; the paged kernel's fused gate/up GEMM ("up") streams two B tiles."""
    b_tiles = 2 if which == "up" and not SGLANG else 1
    return c["num_stages"] * (c["BLOCK_SIZE_M"] + b_tiles * c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * 2 <= SMEM_LIMIT


def candidates(T: int) -> dict[int, list[dict]]:
    """{BLOCK_SIZE_M: configs} searched at T tokens (both GEMMs draw from the same grid)."""
    out: dict[int, list[dict]] = {}
    if T <= 64:  # decode: one M block per routed expert; GROUP_SIZE_M does not matter
        for bn, bk, (w, s) in itertools.product(
                (32, 64, 128, 256), (64, 128, 256), ((4, 2), (4, 3), (4, 4), (4, 5), (8, 3), (8, 4))):
            if w == 8 and bn < 128:
                continue
            out.setdefault(16, []).append(cfg(16, bn, bk, 1, w, s))
    elif T <= 1024:
        bms = (16, 32, 64) if T <= 256 else (32, 64, 128)
        for bm, bn, bk, g, (w, s) in itertools.product(
                bms, (64, 128, 256), (64, 128), (1, 16), ((4, 2), (4, 3), (8, 4))):
            out.setdefault(bm, []).append(cfg(bm, bn, bk, g, w, s))
    else:
        for bm, bn, bk, g, (w, s) in itertools.product(
                (64, 128), (128, 256), (64, 128), (1, 8, 16, 32), ((4, 3), (4, 4), (8, 3), (8, 4))):
            if bk == 128 and g not in (1, 16):
                continue
            out.setdefault(bm, []).append(cfg(bm, bn, bk, g, w, s))
    return {bm: [c for c in cs if smem_ok(c)] for bm, cs in out.items()}


def shapes_and_tokens():
    if ARGS.cpu_smoke:
        return {"tiny (E=8,k=2)": dict(E=8, k=2, H=64, I=32)}, ARGS.tokens or [1, 16]
    return rig.pick_shapes(ARGS.shapes), ARGS.tokens or rig.TOKENS


def make_rig(name, shape, dev, **kw):
    """The tuned kernel's rig: the paged kernel on a scattered pool, or SGLang's on contiguous weights."""
    if SGLANG:
        sglang_rig.setup(ARGS.cpu_smoke, tp_group=False)
        return sglang_rig.SGLangRig(name, **shape, device=dev, **kw)
    return rig.Rig(name, **shape, device=dev, **kw)


# ---- compile phase: every (shape, T, gemm, config) launched once, in worker processes -------


def _compile_jobs(jobs):
    """Worker: launch each job once on uninitialized weights (fills Triton's disk cache)."""
    dev = torch.device("cpu" if ARGS.cpu_smoke else "cuda")
    dtype = torch.float32 if ARGS.cpu_smoke else torch.bfloat16
    rigs, failures = {}, []
    for name, shape, T, which, c in jobs:
        try:
            if name not in rigs:
                rigs[name] = make_rig(name, shape, dev, dtype=dtype, weights=False)
            r = rigs[name]
            x, tw, ti, act_in = r.inputs(T, 1)[0]
            al = r.align(ti, c["BLOCK_SIZE_M"])
            if which == "up":
                r.gemm_up(x, tw, al, torch.empty(T * r.k, r.up_width, dtype=r.dtype, device=dev), c)
            else:
                r.gemm_down(act_in, tw, al, torch.empty(T * r.k, r.H, dtype=r.dtype, device=dev), c)
            if not ARGS.cpu_smoke:
                torch.cuda.synchronize()
        except Exception as exc:
            failures.append((name, T, which, c, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return failures


def precompile(shapes, tokens):
    jobs = []
    for name, shape in shapes.items():
        for T in tokens:
            for cs in candidates(T).values():
                for c in cs:
                    for which in ("up", "down"):
                        if smem_ok(c, which):
                            jobs.append((name, shape, T, which, c))
    if ARGS.workers <= 0:
        return 0, []
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    t = time.time()
    chunks = [jobs[i::ARGS.workers] for i in range(ARGS.workers)]
    failures = []
    with ProcessPoolExecutor(ARGS.workers, mp_context=mp.get_context("spawn")) as ex:
        for f in ex.map(_compile_jobs, chunks):
            failures += f
    print(f"[tune] compiled {len(jobs)} launches in {time.time() - t:.0f} s "
          f"({len(failures)} failed)", flush=True)
    return len(jobs), failures


# ---- timing phase ---------------------------------------------------------------------------


def timer(fn, calls):
    if ARGS.cpu_smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6 / calls
    return rig.graph_time_us(fn, calls, min_ms=0.5, replays=3)


def tune_size(r, T, rec):
    dev = r.device
    sets = r.inputs(T, 1 if ARGS.cpu_smoke else rig.input_sets(T))
    rec["distinct_experts_mean"] = r.distinct_experts(sets)
    aligned = {}
    outs_up = [torch.empty(T * r.k, r.up_width, dtype=r.dtype, device=dev) for _ in sets]
    outs_dn = [torch.empty(T * r.k, r.H, dtype=r.dtype, device=dev) for _ in sets]

    def run(which, c):
        bm = c["BLOCK_SIZE_M"]
        if bm not in aligned:
            aligned[bm] = [r.align(s[2], bm) for s in sets]
        al = aligned[bm]
        if which == "up":
            fn = lambda: [r.gemm_up(s[0], s[1], a, o, c) for s, a, o in zip(sets, al, outs_up)]  # noqa: E731
        else:
            fn = lambda: [r.gemm_down(s[3], s[1], a, o, c) for s, a, o in zip(sets, al, outs_dn)]  # noqa: E731
        try:
            return timer(fn, len(sets))
        except Exception as exc:
            rec.setdefault("failed", []).append(dict(gemm=which, config=c, error=f"{type(exc).__name__}: "
                                                                                 f"{str(exc)[:160]}"))
            return None

    per_bm = {}
    for bm, cs in candidates(T).items():
        best = {}
        for which in ("up", "down"):
            timed = [(run(which, c), c) for c in cs if smem_ok(c, which)]
            timed = sorted(((t, c) for t, c in timed if t is not None), key=lambda tc: tc[0])[: ARGS.leaders]
            # Re-time the leaders (the first pass has one short graph each) and keep the fastest.
            retimed = sorted(((min(t, run(which, c) or t), c) for t, c in timed), key=lambda tc: tc[0])
            best[which] = retimed[0] if retimed else None
        if best["up"] and best["down"]:
            per_bm[bm] = dict(up_us=best["up"][0], up=best["up"][1], down_us=best["down"][0],
                              down=best["down"][1], sum_us=best["up"][0] + best["down"][0])
    rec["per_block_m"] = {str(bm): v for bm, v in per_bm.items()}
    if not per_bm:
        return None
    bm = min(per_bm, key=lambda b: per_bm[b]["sum_us"])
    rec["pick"] = per_bm[bm]

    # References, timed the same way. Paged: the table shipped now, and SGLang's tuned configs.
    # SGLang: the configs SGLang picks today (its table, or its default config without one).
    refs = {}
    if SGLANG:
        try:
            refs["sglang"] = sglang_rig.resolve_configs(r.E, r.H, r.I, r.k, T, r.dtype)
        except Exception as exc:
            rec["sglang_error"] = f"{type(exc).__name__}: {exc}"
    else:
        try:
            shipped = moe_config.get_paged_moe_config(r.E, r.I, T, dev)
            shipped_down = moe_config.get_paged_moe_down_config(r.E, r.I, T, dev) or shipped
            refs["shipped"] = (shipped, shipped_down)
        except Exception as exc:
            rec["shipped_error"] = str(exc)
    st = None if ARGS.cpu_smoke or SGLANG else rig.sglang_table(r.E, r.I)
    if st:
        up = rig.nearest(st, T)
        sd = rig.sglang_table(r.E, r.I, down=True)
        down = rig.nearest(sd, T) if sd else dict(up)
        down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]
        refs["sglang"] = (up, down)
    for name, (up, down) in refs.items():
        up = {k: up[k] for k in KEYS if k in up}
        down = {k: down[k] for k in KEYS if k in down}
        tu, td = run("up", up), run("down", down)
        rec[f"{name}_config"] = dict(up=up, down=down, up_us=tu, down_us=td,
                                     sum_us=(tu + td) if tu is not None and td is not None else None)
    return rec["pick"]


def main():
    shapes, tokens = shapes_and_tokens()
    dev = torch.device("cpu" if ARGS.cpu_smoke else "cuda")
    os.makedirs(ARGS.out_dir, exist_ok=True)
    res = dict(meta=dict(device=None if ARGS.cpu_smoke else torch.cuda.get_device_name(), kernel=ARGS.kernel,
                         torch=torch.__version__, triton=rig.triton.__version__, tokens=tokens,
                         argv=sys.argv[1:]), sizes=[], skipped=[])
    if SGLANG:
        res["meta"]["sglang"] = sglang_rig.setup(ARGS.cpu_smoke, tp_group=False)
        res["meta"]["sglang_device_name"] = sglang_rig.configs_module().get_device_name()
    if ARGS.cpu_smoke:
        global candidates
        full = candidates
        candidates = lambda T: {bm: cs[:2] for bm, cs in list(full(T).items())[:2]}  # noqa: E731
    n, failures = precompile(shapes, tokens)
    res["meta"].update(compile_launches=n, compile_failures=[list(f[:3]) + [f[3], f[4]] for f in failures],
                       compile_s=round(time.time() - T0, 1))
    out_json = os.path.join(ARGS.out_dir, "tune_sglang_moe.json" if SGLANG else "tune_paged_moe.json")
    # The sizes the targets missed first, so a short budget still covers them.
    order = sorted(tokens, key=lambda T: (T not in (4096, 8192, 1, 4), tokens.index(T)))
    for name, shape in shapes.items():
        r = make_rig(name, shape, dev, dtype=torch.float32 if ARGS.cpu_smoke else torch.bfloat16)
        ups, downs = {}, {}
        for T in order:
            if time.time() - T0 > ARGS.budget_s:
                res["skipped"].append(dict(shape=name, tokens=T))
                continue
            rec = dict(shape=name, tokens=T)
            t = time.time()
            try:
                pick = tune_size(r, T, rec)
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
                rec["traceback"] = traceback.format_exc()[-1500:]
                pick = None
            rec["seconds"] = round(time.time() - t, 1)
            res["sizes"].append(rec)
            if pick:
                ups[T], downs[T] = pick["up"], pick["down"]
                sg = rec.get("sglang_config", {}).get("sum_us")
                sh = rec.get("shipped_config", {}).get("sum_us")
                print(f"[tune] {name} T={T}: {pick['sum_us']:.1f} us (up {pick['up_us']:.1f} + down "
                      f"{pick['down_us']:.1f}), shipped {sh and round(sh, 1)}, SGLang cfg {sg and round(sg, 1)}"
                      f" [{rec['seconds']} s]", flush=True)
            with open(out_json, "w") as f:
                json.dump(res, f, indent=1)
        if ups and SGLANG:  # also on CPU: the bench's dry run reads them through SGLang's lookup
            for path in sglang_rig.write_tables(ARGS.out_dir, shape["E"], shape["I"], r.dtype, ups, downs):
                print(f"wrote {path}")
        elif ups and not ARGS.cpu_smoke:
            write_tables(ARGS.out_dir, shape, moe_config.device_name(dev), ups, downs)
    res["meta"]["elapsed_s"] = round(time.time() - T0, 1)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)


def write_tables(out_dir, shape, device_name, ups, downs):
    for table, down in ((ups, False), (downs, True)):
        path = os.path.join(out_dir, moe_config.config_file_name(shape["E"], shape["I"], device_name, down))
        with open(path, "w") as f:
            json.dump({str(T): table[T] for T in sorted(table)}, f, indent=4)
            f.write("\n")
        print(f"wrote {path}")


def tables_from(path):
    with open(path) as f:
        res = json.load(f)
    device_name = res["meta"]["device"].replace(" ", "_")
    picks: dict[str, tuple[dict, dict, dict]] = {}
    for rec in res["sizes"]:
        if rec.get("pick"):
            shape = rig.SHAPES[rec["shape"]]
            ups, downs = picks.setdefault(rec["shape"], (shape, {}, {}))[1:]
            ups[rec["tokens"]], downs[rec["tokens"]] = rec["pick"]["up"], rec["pick"]["down"]
    os.makedirs(ARGS.out_dir, exist_ok=True)
    if res["meta"].get("kernel") == "sglang":  # SGLang's layout and names, for the tuning device
        import sglang_rig

        with sglang_rig.device_name_as(res["meta"]["device"]):
            for shape, ups, downs in picks.values():
                for p in sglang_rig.write_tables(ARGS.out_dir, shape["E"], shape["I"], torch.bfloat16, ups, downs):
                    print(f"wrote {p}")
        return
    for shape, ups, downs in picks.values():
        write_tables(ARGS.out_dir, shape, device_name, ups, downs)


def print_table(res):
    what = "SGLang's fused_moe_kernel (gate/up unfused)" if SGLANG else "the paged kernel (gate/up with SiLU*up)"
    ref = "SGLang today us" if SGLANG else "SGLang cfg us"
    print(f"\ntuned: {what}; SGLang today = its shipped table, or its default config without one")
    print(f"\n| shape | T | tuned us (up+down) | shipped us | {ref} | tuned/SGLang | BM | up (BN,BK,G,w,s) |"
          " down (BN,BK,G,w,s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rec in res["sizes"]:
        p = rec.get("pick")
        if not p:
            print(f"| {rec['shape']} | {rec['tokens']} | error: {rec.get('error', 'no config ran')[:80]} |")
            continue
        sh = rec.get("shipped_config", {}).get("sum_us")
        sg = rec.get("sglang_config", {}).get("sum_us")
        f = lambda c: f"{c['BLOCK_SIZE_N']},{c['BLOCK_SIZE_K']},{c['GROUP_SIZE_M']},{c['num_warps']},{c['num_stages']}"  # noqa: E731,E501
        print(f"| {rec['shape']} | {rec['tokens']} | {p['sum_us']:.1f} | {sh and round(sh, 1)} | "
              f"{sg and round(sg, 1)} | {(p['sum_us'] / sg) if sg else float('nan'):.3f} | "
              f"{p['up']['BLOCK_SIZE_M']} | {f(p['up'])} | {f(p['down'])} |")
    print(f"\nskipped (budget): {res['skipped']}; elapsed {res['meta'].get('elapsed_s')} s")


if __name__ == "__main__":
    if ARGS.tables_from:
        tables_from(ARGS.tables_from)
    else:
        main()
