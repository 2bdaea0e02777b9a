"""What the tuner and the decode profile share: shapes, a scattered pool, routing
sets, the paged kernel's stages as separate calls, and CUDA-graph timing.

Imported by the scripts beside it (run from the repo root with
``bench/device/setup_device.sh`` sourced, or ``kernels/`` on PYTHONPATH).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import rimuru_kernels  # noqa: F401
except ImportError:  # not on the path: use the checkout's copy
    sys.path.insert(0, os.path.join(REPO, "kernels"))
import triton  # noqa: E402

from rimuru_kernels import moe_align_block_size_triton, pack_weights_into_pool  # noqa: E402
from rimuru_kernels.paged_moe import _launch_gemm, _silu_and_mul  # noqa: E402

SHAPES = {
    "Qwen3-30B-A3B": dict(E=128, k=8, H=2048, I=768),
    "Qwen1.5-MoE-A2.7B": dict(E=60, k=4, H=2048, I=1408),
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
HBM_GBS = 4300.0  # DEVICE_NOTES copy ceiling (the targets use it)


def pick_shapes(names):
    """The shapes whose names contain one of ``names``, in the order of ``names`` (all without)."""
    if not names:
        return dict(SHAPES)
    return {n: s for a in names for n, s in SHAPES.items() if a.lower() in n.lower()}


def input_sets(T: int) -> int:
    """Routing sets rotated per call, so one call's experts are not L2-resident for the next."""
    return 8 if T <= 64 else (4 if T <= 1024 else 2)


class Rig:
    """One shape on one device: a scattered pool and per-T inputs for each stage."""

    def __init__(self, name: str, E: int, k: int, H: int, I: int, device, dtype=torch.bfloat16, seed=0,
                 weights: bool = True):
        """weights=False: an uninitialized pool (compiling only: nothing is timed or checked)."""
        self.name, self.E, self.k, self.H, self.I = name, E, k, H, I
        self.device, self.dtype = device, dtype
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.page_elems = I * H
        num_pages = 3 * E + E // 2  # gaps between experts, as KV pages leave them in the server
        perm = torch.randperm(num_pages, generator=g)[: 3 * E].view(E, 3)
        self.table = perm.to(torch.int32).to(device)
        if weights:
            gd = torch.Generator(device=device).manual_seed(seed)
            w13 = (torch.randn(E, 2 * I, H, generator=gd, device=device) / H**0.5).to(dtype)
            w2 = (torch.randn(E, H, I, generator=gd, device=device) / I**0.5).to(dtype)
            self.pool = pack_weights_into_pool(w13, w2, self.table, self.page_elems, num_pages)
            del w13, w2
        else:
            self.pool = torch.empty(num_pages * self.page_elems, dtype=dtype, device=device)
        self._gen = g

    @property
    def up_width(self) -> int:
        """Columns the gate/up GEMM writes on the default path (SiLU*up fused: I)."""
        return self.I

    def expert_bytes(self) -> int:
        return 3 * self.I * self.H * torch.tensor([], dtype=self.dtype).element_size()

    def inputs(self, T: int, nsets: int):
        """[(x, topk_weights, topk_ids, act_in)] with uniform routing (top-k of random logits)."""
        out = []
        for _ in range(nsets):
            x = torch.randn(T, self.H, generator=self._gen).to(self.dtype).to(self.device)
            tw, ti = torch.topk(torch.randn(T, self.E, generator=self._gen).softmax(-1), self.k)
            tw = (tw / tw.sum(-1, keepdim=True)).float().contiguous().to(self.device)
            ti = ti.to(torch.int32).contiguous().to(self.device)
            act_in = torch.randn(T * self.k, self.I, generator=self._gen).to(self.dtype).to(self.device)
            out.append((x, tw, ti, act_in))
        return out

    def distinct_experts(self, sets) -> float:
        return sum(torch.unique(s[2]).numel() for s in sets) / len(sets)

    # ---- the stages of paged_fused_moe, each callable alone ------------------------------

    def align(self, ti, bm, one_program=None):
        """What paged_fused_moe aligns with: the flat ids (slot blocks) for one token."""
        if ti.shape[0] == 1 and one_program is None:
            return ti.reshape(-1).contiguous()
        return moe_align_block_size_triton(ti, bm, self.E, one_program=one_program)

    def gemm_up(self, x, tw, aligned, out, cfg, fuse_silu=True):
        """fuse_silu (the default path): out [T*k, I] = SiLU(gate) * up; else out [T*k, 2I]."""
        opts = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
        _launch_gemm(x, out, self.pool, self.table, tw.view(-1), aligned,
                     N=self.I if fuse_silu else 2 * self.I, K=self.H,
                     rows_per_page=self.I, slot_base=0, top_k=self.k, mul_routed_weight=False,
                     page_elems=self.page_elems, config=cfg, options=opts, upcast=False,
                     fuse_silu=fuse_silu)

    def gemm_down(self, act, tw, aligned, out, cfg):
        opts = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
        _launch_gemm(act, out, self.pool, self.table, tw.view(-1), aligned, N=self.H, K=self.I,
                     rows_per_page=self.H, slot_base=2, top_k=1, mul_routed_weight=True,
                     page_elems=self.page_elems, config=cfg, options=opts, upcast=False)

    def silu(self, gate_up, act):
        _silu_and_mul(gate_up, act)


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph replaying fn() ``calls`` times: fn warmed up on a side stream
    first (allocator, Triton JIT), the first replay (upload) already done."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_time_us(fn, calls_per_fn: int, min_ms: float = 1.0, replays: int = 5) -> float:
    """Median µs per call of fn (which makes ``calls_per_fn`` calls) as a replayed CUDA graph
    lasting >= min_ms."""
    g = capture_graph(fn)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    one = a.elapsed_time(b)
    reps = max(1, math.ceil(min_ms / max(one, 1e-3)))
    if reps > 1:
        g = capture_graph(fn, reps)
    ts = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] * 1e3 / (reps * calls_per_fn)


def sglang_table(E: int, I: int, down: bool = False) -> dict[int, dict] | None:
    """SGLang 0.5.17's tuned table for this shape on this GPU (its JSON file), or None."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("sglang")
        root = os.path.dirname(spec.origin)
    except Exception:
        return None
    name = torch.cuda.get_device_name().replace(" ", "_")
    v = "_".join(triton.__version__.split(".")[:3])
    path = os.path.join(root, "srt/layers/moe/moe_runner/triton_utils/configs", f"triton_{v}",
                        f"E={E},N={I},device_name={name}{'_down' if down else ''}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return {int(t): c for t, c in json.load(f).items()}


def nearest(table: dict[int, dict], T: int) -> dict:
    return dict(table[min(table, key=lambda m: abs(m - T))])
