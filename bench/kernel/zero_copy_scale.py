"""In-place (zero-copy) expert reads at a serving step's scale, against the copy engine.

    python3 bench/kernel/zero_copy_scale.py --out zero_copy_scale.json [--region-gib 40] [--budget-s 300]

Why: serving Qwen3-30B-A3B on an emulated 32 GB card with uniform routing (b327e46,
bench/results/serving_h200_2026-12-02f) keeps ~4,000 experts on host pages (84 a layer)
and routes nearly all of them at batch ~100: a decode step took 1,043 ms for ~4,000
expected in-place reads of 9 MiB, 37 GB/s, where one layer alone reads its host experts
at 52-63 GB/s (zero_copy_sweep.py) and SGLang's --cpu-offload-gb, which copies whole
layers with the copy engine, moves ~58 GB/s. This separates the suspects:

- ``compact``: one decode step of L MoE layers (one CUDA graph of L paged_fused_moe
  calls), k experts a layer on host pages, every layer reading the *same* k host
  experts (a working set of k x 9 MiB);
- ``spread``: each layer its own k experts, at random slots of a registered region the
  size of serving's (working set L x k x 9 MiB, what the GPU must translate);
- ``spread_thp``: the same over transparent huge pages (MADV_HUGEPAGE, then registered:
  SGLANG_RIMURU_HOST_PIN=hugepage);
- ``spread+N`` (``--host-offsets N``): ``spread`` with the region starting N bytes past
  its 2 MiB boundary (64: where torch's CPU allocator puts a large block, and where the
  server's host store started before it was made 2 MiB-aligned);
- ``copy``: the copy engine moving the same experts (one cudaMemcpyAsync of 9 MiB per
  expert, host slot -> a device staging buffer), eager, as the offload path would.

``--dup D`` gives D tokens each routing (as when many requests decode one token); the
``reads`` column then counts the kernel's reads of out experts per distinct one, since a
block of BLOCK_SIZE_M tokens reads its expert whole (``host_reads``).

Rates are expert bytes / (step time - the step with every expert in HBM). The host
slots hold the experts' real weights, and the last layer's output of every graphed
variant is checked bit-equal to the all-in-HBM step. Writes JSON; prints a table.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import sys
import time

import torch

from rimuru_kernels import pack_contiguous_weights, paged_fused_moe
from rimuru_kernels.moe_config import (config_files, device_name, device_shared_bytes, get_paged_moe_config,
                                       get_paged_moe_down_config, pipeline_shared_bytes)
from rimuru_kernels.paged_moe import _silu_and_mul, fit_fused_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_rig import capture_graph  # noqa: E402

# the MoE layer's shape (--shape): E experts, hidden H, intermediate I, top-k
SHAPES = {"qwen3": (128, 2048, 768, 8), "qwen1.5": (60, 2048, 1408, 4)}
E, H, I, TOP_K = SHAPES["qwen3"]  # Qwen3-30B-A3B's MoE layer
IH = I * H
EXPERT_BYTES = 3 * IH * 2


def set_shape(name: str) -> None:
    """Point the module's shape at ``name`` (every function reads it at call time)."""
    global E, H, I, TOP_K, IH, EXPERT_BYTES
    E, H, I, TOP_K = SHAPES[name]
    IH = I * H
    EXPERT_BYTES = 3 * IH * 2


BLOCKING_SYNC = False  # --blocking-sync


def median_ms(run, reps: int) -> float:
    # blocking events: the host thread sleeps in synchronize() instead of spinning on a core
    a = torch.cuda.Event(enable_timing=True, blocking=BLOCKING_SYNC)
    b = torch.cuda.Event(enable_timing=True, blocking=BLOCKING_SYNC)
    times = []
    for _ in range(reps):
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def host_region(slots: int, thp: bool, offset: int = 0) -> tuple[torch.Tensor, object]:
    """``slots`` experts' worth of page-locked, mapped host memory (cudaHostRegister,
    as the server's host store), starting ``offset`` bytes past a 2 MiB boundary; with
    ``thp`` MADV_HUGEPAGE first. Returns the tensor and what must outlive it."""
    nbytes = slots * EXPERT_BYTES
    align = 2 << 20
    mm = mmap.mmap(-1, nbytes + align + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if thp and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align + offset
    t = raw[start:start + nbytes].view(torch.bfloat16)
    # one registration per layer's worth (128 experts), as the server's host store pins
    # each layer's tensor (one 38 GiB registration returned success yet left it unpinned)
    # (from the mapping's start, alignment slack included: torch asks about the storage's pointer)
    # Chunk edges fall on expert slots (a copy may not straddle two registrations).
    for lo, hi in _chunks(raw, start):
        rc = int(torch.cuda.cudart().cudaHostRegister(lo, hi - lo, 3))  # portable | mapped
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {hi - lo} B at {lo:#x} failed (cudaError {rc})")
    if not t.is_pinned():
        raise RuntimeError(f"{nbytes} B registered yet not pinned")
    return t, (mm, raw, start)


def release(keep) -> None:
    torch.cuda.synchronize()
    for lo, _ in _chunks(keep[1], keep[2]):
        torch.cuda.cudart().cudaHostUnregister(lo)


def _chunks(raw: torch.Tensor, start: int) -> list[tuple[int, int]]:
    """[lo, hi) address ranges covering raw, cut every 128 expert slots from raw + start."""
    return chunk_ranges(raw.data_ptr(), raw.data_ptr() + raw.numel(), raw.data_ptr() + start, E * EXPERT_BYTES)


def chunk_ranges(base: int, end: int, first: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering [base, end), cut at first + n * chunk (n >= 1): a slot of
    ``chunk``'s divisors laid out from ``first`` never straddles two ranges."""
    cuts = list(range(first + chunk, end, chunk))
    return list(zip([base] + cuts, cuts + [end]))


#: a --tiles spec: [BLOCK_SIZE_M x] BLOCK_SIZE_N x BLOCK_SIZE_K x num_stages x num_warps [g GROUP_SIZE_M]
TILES = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+)x(\d+)x(\d+)(?:g(\d+))?$")


def with_override(up: dict, down: dict | None, stages: str) -> tuple[dict, dict | None]:
    """The launch configs as they are (``"cfg"``), with ``num_stages`` set for both GEMMs
    (``stages`` a number), or with BLOCK_SIZE_N, BLOCK_SIZE_K, num_stages and num_warps set
    for both (a ``--tiles`` spec ``NxKxSxW``; BLOCK_SIZE_M and GROUP_SIZE_M stay the table's
    unless the spec names them: ``MxNxKxSxW``, ``...gG``). BLOCK_SIZE_M is the token
    alignment both GEMMs share, and how many times an offloaded expert is read a step: once
    per BLOCK_SIZE_M of the tokens routed to it."""
    if stages == "cfg":
        return up, down
    if m := TILES.match(stages):
        bm, bn, bk, st, nw, gm = m.groups()
        keys = {"BLOCK_SIZE_N": int(bn), "BLOCK_SIZE_K": int(bk), "num_stages": int(st), "num_warps": int(nw)}
        keys.update({k: int(v) for k, v in (("BLOCK_SIZE_M", bm), ("GROUP_SIZE_M", gm)) if v is not None})
    else:
        keys = {"num_stages": int(stages)}
    return {**up, **keys}, None if down is None else {**down, **keys}


def shared_routing(w: torch.Tensor, ids: torch.Tensor, dup: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``--dup``: the first ceil(T / dup) tokens' routings (weights, ids), each taken by
    ``dup`` tokens in a row, T rows in all; ``dup`` 1 returns them as they are."""
    if dup <= 1:
        return w, ids
    T = w.shape[0]
    return tuple(x[:-(-T // dup)].repeat_interleave(dup, 0)[:T].contiguous() for x in (w, ids))


def host_reads(ids: torch.Tensor, out: list[int], block_m: int) -> int:
    """How many times a layer's step reads its ``out`` experts from host memory: the paged
    kernel's blocks each take BLOCK_SIZE_M rows of one expert's tokens (``ids``, [T, k]) and
    read the whole expert, so an expert routed n tokens is read ceil(n / BLOCK_SIZE_M) times."""
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=max(out, default=0) + 1)
    return sum(-(-int(counts[e]) // block_m) for e in out)


def pipelines_fit(up: dict, down: dict | None, w13: str, shared_bytes: int) -> bool:
    """Whether both GEMMs run the tiles asked for: within a block's shared memory (past it a
    launch would stop the whole call instead of leaving one row out), and for the fused
    gate/up GEMM within the kernel's own budget, below which ``fit_fused_config`` drops stages
    and then halves BLOCK_SIZE_N (BK 128, BN 128 fused at 3 stages takes 204 KiB: it would run
    2 stages, the table's, under another name)."""
    fused = w13 == "fused"
    if fused and fit_fused_config(up, 2) != up:
        return False
    return (pipeline_shared_bytes(up, fused=fused) <= shared_bytes
            and (down is None or pipeline_shared_bytes(down, fused=False) <= shared_bytes))


def runnable_variants(tokens: list[int], variants: list[tuple[str, str, str]], configs_of,
                      shared_bytes: int) -> tuple[dict[int, list[tuple[str, str, str]]], list[str]]:
    """Per token count, the (configs, w13, stages) variants whose tiles run as asked
    (``pipelines_fit``), and the names of the others. ``configs_of(T, kind, stages)``: the
    (up, down) launch configs the variant passes, spelled out."""
    keep, left_out = {}, []
    for T in tokens:
        keep[T] = []
        for kind, w13, st in variants:
            up, down = configs_of(T, kind, st)
            if pipelines_fit(up, down, w13, shared_bytes):
                keep[T].append((kind, w13, st))
            else:
                left_out.append(f"T={T} {kind}/{w13}/s{st}")
    return keep, left_out


def anon_huge_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--region-gib", type=float, default=40.0, help="the spread region (serving's out-set: ~36 GiB)")
    ap.add_argument("--tokens", default="16,100")
    ap.add_argument("--ks", default="8,32,84")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--layouts", default="compact,spread,spread_thp")
    ap.add_argument("--out-sets", default="random",
                    help="compact only, comma separated: which k routed experts a layer keeps on host pages: "
                         "random (shuffled), high (the highest ids: static mode without a ranking keeps the "
                         "lowest ids resident, so its out-set is this one), low (the lowest ids)")
    ap.add_argument("--w13", default="fused",
                    help="compact only, comma separated: fused (SiLU*up in the gate/up GEMM, one CTA reads "
                         "both pages) or unfused (the gate/up GEMM over N = 2I, then SiLU*up: what serving's "
                         "default exact kernel runs, with SGLang's activation)")
    ap.add_argument("--stages", default="cfg",
                    help="compact only, comma separated: num_stages for both GEMMs, or cfg (the config's)")
    ap.add_argument("--tiles", default="",
                    help="compact only, comma separated [Mx]NxKxSxW[gG]: more variants with BLOCK_SIZE_N, "
                         "BLOCK_SIZE_K, num_stages and num_warps (and BLOCK_SIZE_M, GROUP_SIZE_M where given) set "
                         "for both GEMMs (e.g. 64x128x4x4, 64x128x128x2x4g8): a launch config for host reads, "
                         "apart from the HBM-tuned tables")
    ap.add_argument("--dup", type=int, default=1,
                    help="tokens that share each routing (default 1: every token drawn on its own): T / dup "
                         "distinct routings, so the experts a step routes to get dup times the tokens each, as "
                         "when many requests decode the same token (greedy decoding on dummy weights repeats its "
                         "input token); an offloaded expert is read once per BLOCK_SIZE_M of its tokens")
    ap.add_argument("--host-offsets", default="",
                    help="comma separated byte offsets (even): each adds a spread+N layout, the spread region "
                         "starting N bytes past its 2 MiB boundary (64: the server's host store before 2 MiB "
                         "alignment)")
    ap.add_argument("--blocking-sync", action="store_true",
                    help="wait for each timed step asleep (blocking CUDA events), leaving every host core idle "
                         "while the GPU reads host memory, as a server waiting on the GPU may; default: spin")
    ap.add_argument("--configs", default="kernel", help="kernel (its own tables: --rimuru-moe-kernel fast), "
                    "sglang (SGLang's launch configs, what serving's default exact kernel uses) or both: "
                    "the compact layout runs once per kind")
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES),
                    help="the MoE layer: qwen3 (Qwen3-30B-A3B, 48 layers) or qwen1.5 (Qwen1.5-MoE-A2.7B, "
                         "24 layers: pass --layers 24)")
    args = ap.parse_args()
    set_shape(args.shape)
    global BLOCKING_SYNC
    BLOCKING_SYNC = args.blocking_sync
    t_start = time.time()
    L = args.layers
    tokens = [int(x) for x in args.tokens.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    slots = int(args.region_gib * 2**30) // EXPERT_BYTES
    assert slots >= L * max(ks), f"--region-gib {args.region_gib}: {slots} slots < {L} x {max(ks)}"
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).cuda()
    paged = pack_contiguous_weights(w13, w2)
    del w13, w2
    pool, table0, pe = paged.pool, paged.page_table, paged.page_elems
    res = {"shape": args.shape, "device": torch.cuda.get_device_name(),
           "configs_read": [str(f) for f in config_files(E, I, device_name(torch.device("cuda")))
                            if f is not None],
           "layers": L, "dup": args.dup, "region_gib": args.region_gib, "blocking_sync": BLOCKING_SYNC,
           "expert_bytes": EXPERT_BYTES,
           "thp_enabled": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
           if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else None, "rows": []}
    # the copy engine's ceiling: one 1 GiB pinned copy
    big = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dev.copy_(big, non_blocking=True)
    res["copy_ceiling_GBps"] = (1 << 30) / (median_ms(lambda: dev.copy_(big, non_blocking=True), 5) * 1e6)
    del big, dev
    print(f"pinned 1 GiB copy: {res['copy_ceiling_GBps']:.1f} GB/s; THP: {res['thp_enabled']}", flush=True)

    # per T: routing per layer, and each layer's out-set (k of its routed experts)
    plans = {}
    for T in tokens:
        hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        routes = []
        for _ in range(L):
            w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), TOP_K, dim=-1)
            w, ids = shared_routing(w, ids, args.dup)
            routed = torch.unique(ids.view(-1))
            order = routed[torch.randperm(routed.numel(), generator=g)].tolist()
            routes.append((w.cuda(), ids.to(torch.int32).cuda(), order))
        plans[T] = (hidden, routes)

    def out_order(order: list[int], out_set: str) -> list[int]:
        """A layer's routed experts in the order the out-set takes them (its first k)."""
        return {"random": order, "high": sorted(order, reverse=True), "low": sorted(order)}[out_set]

    def tables_for(T: int, k: int, slot_of, out_set: str = "random") -> list[torch.Tensor]:
        out = []
        for l, (_, _, routed) in enumerate(plans[T][1]):
            order = out_order(routed, out_set)
            t = table0.clone()
            for j, e in enumerate(order[:k]):
                s = slot_of(l, j)
                t[e] = torch.tensor([-2 - (3 * s + m) for m in range(3)], dtype=torch.int32)
            out.append(t)
        return out

    def fill(host: torch.Tensor, T: int, k: int, slot_of) -> None:
        """Host slot of (layer l, j-th out expert) = that expert's real weights."""
        for l, (_, _, order) in enumerate(plans[T][1]):
            for j, e in enumerate(order[:k]):
                s = slot_of(l, j)
                for m in range(3):
                    p = int(table0[e, m])
                    host[(3 * s + m) * IH:(3 * s + m + 1) * IH].copy_(pool[p * pe:p * pe + IH], non_blocking=True)
        torch.cuda.synchronize()

    out_buf = {T: torch.empty(T, H, dtype=torch.bfloat16, device="cuda") for T in tokens}

    kinds = ["kernel", "sglang"] if args.configs == "both" else [args.configs]
    cfgs = {(T, "kernel"): (None, None) for T in tokens}
    if "sglang" in kinds:
        import sglang_rig

        res["sglang_rig"] = sglang_rig.setup(cpu=False, tp_group=False)
        for T in tokens:
            cfgs[(T, "sglang")] = sglang_rig.resolve_configs(E, H, I, TOP_K, T, torch.bfloat16)
            print(f"T={T}: SGLang's configs up {cfgs[(T, 'sglang')][0]} down {cfgs[(T, 'sglang')][1]}", flush=True)
    res["configs"] = {f"{T}/{kind}": v for (T, kind), v in cfgs.items()}

    def launch_configs(T, kind="kernel", stages="cfg", resolve=False):
        """(up, down) as step_fn passes them: None, None for the kernel's own tables unless an
        override or ``resolve`` needs them spelled out."""
        up, down = cfgs[(T, kind)]
        if up is None and (stages != "cfg" or resolve):  # the kernel's own tables
            dev = torch.device("cuda")
            up, down = get_paged_moe_config(E, I, T, dev), get_paged_moe_down_config(E, I, T, dev)
        return with_override(up, down, stages) if up is not None else (up, down)

    shared = device_shared_bytes(torch.device("cuda"))
    res["shared_bytes"] = shared

    def step_fn(T, tables, host, kind="kernel", w13="fused", stages="cfg"):
        hidden, routes = plans[T]
        up, down = launch_configs(T, kind, stages)
        act = None if w13 == "fused" else _silu_and_mul

        def step():
            for l in range(L):
                w, ids, _ = routes[l]
                paged_fused_moe(hidden, pool, tables[l], w, ids, inter_size=I, page_elems=pe,
                                host_pages=host, out=out_buf[T], config=up, down_config=down, act_and_mul=act)
        return step

    def timed(T, tables, host, kind="kernel", w13="fused", stages="cfg") -> tuple[float, torch.Tensor]:
        step = step_fn(T, tables, host, kind, w13, stages)
        gr = capture_graph(step)
        ms = median_ms(gr.replay, 3)
        step()
        torch.cuda.synchronize()
        return ms, out_buf[T].clone()

    tiles = [t for t in args.tiles.split(",") if t]
    bad = [t for t in tiles if not TILES.match(t)]
    assert not bad, (f"--tiles {bad}: each [Mx]NxKxSxW[gG] ([BLOCK_SIZE_M x] BLOCK_SIZE_N x BLOCK_SIZE_K x "
                     "num_stages x num_warps [g GROUP_SIZE_M])")
    variants = [(kind, w13, st) for kind in kinds for w13 in args.w13.split(",")
                for st in args.stages.split(",") + tiles]

    runnable, left_out = runnable_variants(tokens, variants,
                                           lambda T, kind, st: launch_configs(T, kind, st, resolve=True), shared)
    for name in left_out:
        res.setdefault("skipped", []).append(f"{name}: past the shared memory its tiles may use")
        print(f"{name}: left out, its tiles need more than the {shared} B of shared memory a block has, "
              f"or than the fused kernel plans for", flush=True)
    base = {}

    def base_for(T, kind="kernel", w13="fused", st="cfg") -> tuple[float, torch.Tensor]:
        """The step with every expert in HBM (the variant's time and output), once."""
        if (T, kind, w13, st) not in base:
            base[(T, kind, w13, st)] = timed(T, [table0] * L, None, kind, w13, st)
            print(f"T={T}: all in HBM {base[(T, kind, w13, st)][0]:.2f} ms a step of {L} layers "
                  f"({kind} configs, {w13} gate/up, stages {st})", flush=True)
        return base[(T, kind, w13, st)]

    for T in tokens:
        for v in runnable[T]:
            base_for(T, *v)
    print(f"{'layout':11} {'T':>4} {'k':>3} {'GiB':>6} {'step ms':>8} {'+ms':>8} {'GB/s':>6} reads equal", flush=True)

    def n_out(T: int, k: int) -> int:  # fewer than L x k where a layer routes fewer than k experts
        return sum(min(k, len(order)) for _, _, order in plans[T][1])

    def record(layout, T, k, ms, equal, extra_ms=None, kind="kernel", out_set="random", w13="fused",
               stages="cfg"):
        nbytes = n_out(T, k) * EXPERT_BYTES
        b = base_for(T, kind, w13, stages)[0]
        extra = ms - b if extra_ms is None else extra_ms
        row = dict(layout=layout, configs=kind, out_set=out_set, w13=w13, stages=stages, T=T, k=k, bytes=nbytes, step_ms=ms, base_ms=b, extra_ms=extra,
                   GBps=nbytes / (max(extra, 1e-6) * 1e6), equal=equal)
        row["experts"] = n_out(T, k)
        row["dup"] = args.dup
        row["host_reads"] = None  # a copy row moves each out expert once, however many tokens it has
        if layout != "copy":  # the kernel reads one once per BLOCK_SIZE_M of its tokens
            bm = launch_configs(T, kind, stages, resolve=True)[0]["BLOCK_SIZE_M"]
            row["host_reads"] = sum(host_reads(ids, out_order(order, out_set)[:k], bm) for _, ids, order in plans[T][1])
        res["rows"].append(row)
        name = "/".join([layout] + [v for v, d in ((kind, "kernel"), (out_set, "random"), (w13, "fused"),
                                                   (f"s{stages}", "scfg")) if v != d])
        print(f"{name:11} {T:4d} {k:3d} {nbytes / 2**30:6.2f} {ms:8.2f} {extra:8.2f} {row['GBps']:6.1f} "
              f"{'' if row['host_reads'] is None else format(row['host_reads'] / max(row['experts'], 1), '.2f'):>5} "
              f"{'' if equal is None else ('yes' if equal else 'NO')}",
              flush=True)
        json.dump(res, open(args.out, "w"), indent=1)

    # compact: layer l's j-th out expert reads slot j, for every l: k experts' bytes in all.
    # The slots hold layer L-1's out experts, so only the last layer's output is checked.
    host, keep = host_region(max(ks), thp=False)
    for T in tokens if "compact" in args.layouts else []:
        for k in ks:
            for out_set in args.out_sets.split(","):
                for j, e in enumerate(out_order(plans[T][1][L - 1][2], out_set)[:k]):
                    for m in range(3):
                        p = int(table0[e, m])
                        host[(3 * j + m) * IH:(3 * j + m + 1) * IH].copy_(pool[p * pe:p * pe + IH])
                for kind, w13, st in runnable[T]:
                    ms, got = timed(T, tables_for(T, k, lambda l, j: j, out_set), host, kind, w13, st)
                    record("compact", T, k, ms, bool(torch.equal(got, base_for(T, kind, w13, st)[1])), kind=kind,
                           out_set=out_set, w13=w13, stages=st)
    release(keep)
    del host, keep

    offsets = [int(x) for x in args.host_offsets.split(",") if x]
    assert all(o >= 0 and o % 2 == 0 for o in offsets), f"--host-offsets {args.host_offsets}: even byte counts"
    spreads = [("spread", False, 0), ("spread_thp", True, 0)] + [(f"spread+{o}", False, o) for o in offsets]
    for layout, thp, offset in spreads:
        if layout not in args.layouts.split(",") and not offset:
            continue
        if time.time() - t_start > args.budget_s:
            res["skipped"] = res.get("skipped", []) + [layout]
            continue
        t0 = time.time()
        host, keep = host_region(slots, thp=thp, offset=offset)
        res[f"{layout}_register_s"] = time.time() - t0
        res[f"{layout}_anon_huge_kib"] = anon_huge_kib()
        print(f"{layout}: registered {args.region_gib} GiB in {res[f'{layout}_register_s']:.1f} s, "
              f"AnonHugePages {res[f'{layout}_anon_huge_kib']} kB", flush=True)
        perm = torch.randperm(slots, generator=g).tolist()
        for T in tokens:
            for k in ks:
                if time.time() - t_start > args.budget_s:
                    res["skipped"] = res.get("skipped", []) + [f"{layout} T={T} k={k}"]
                    continue
                spread = lambda l, j, k=k: perm[l * k + j]  # noqa: E731
                fill(host, T, k, spread)
                ms, got = timed(T, tables_for(T, k, spread), host)
                record(layout, T, k, ms, bool(torch.equal(got, base_for(T)[1])))
                if layout == "spread":  # the copy engine, same experts, same bytes
                    stage = torch.empty(k * 3 * IH, dtype=torch.bfloat16, device="cuda")

                    def copies():
                        for l, (_, _, order) in enumerate(plans[T][1]):
                            for j in range(min(k, len(order))):
                                s = spread(l, j)
                                stage[j * 3 * IH:(j + 1) * 3 * IH].copy_(host[3 * s * IH:3 * (s + 1) * IH],
                                                                          non_blocking=True)
                    copies()
                    cms = median_ms(copies, 3)
                    record("copy", T, k, cms, None, extra_ms=cms)
                    del stage
        release(keep)
        del host, keep
    res["wall_s"] = time.time() - t_start
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("zero_copy_scale.py needs a CUDA device (pinned, mapped host memory)")
    main()
