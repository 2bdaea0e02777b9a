"""Fused MoE over expert weights scattered in the pages of one pool.

Pool layout (DESIGN.md section 4)::

    pool: 1-D tensor, the pool's bytes viewed as the weight dtype
    page p: elements [p * page_elems, p * page_elems + page_elems)
    page_table[e] = (W1 page, W3 page, W2 page), int32:
        p >= 0   pool page p
        p <= -2  host page h = -2 - p of ``host_pages`` (mapped pinned host
                 memory, read in place over PCIe: zero-copy)
        -1       not present (contributes zero; ``validate`` refuses it)
    W1 (gate) and W3 (up): [I, H] row-major at the start of their page
    W2 (down):             [H, I] row-major at the start of its page

Host pages let every expert be readable without a host round trip: an
offloaded expert's row points at its pinned host copy, so routing, the
kernel and the weight traffic are all enqueued on the device and a CUDA graph
can replay them (DESIGN section 8). The host pages are addressed from the pool's
pointer (``host_base``: the element offset of ``host_pages`` from ``pool``;
pinned memory is mapped at the same address on the device under CUDA's
unified addressing), so the kernel has one weight pointer and one lookup.

Gate/up GEMM, output column n in [0, 2I) of expert e, hidden element t::

    addr(n, t) = pool + page_table[e, n // I] * page_elems + (n % I) * H + t

Down GEMM, output column n in [0, H), intermediate element t::

    addr(n, t) = pool + page_table[e, 2] * page_elems + n * I + t

Both GEMMs are one kernel: output column n of a GEMM with ``rows_per_page``
rows per weight page reads slot ``SLOT_BASE + n // rows_per_page`` of the
expert's page-table row (SLOT_BASE 0, rows_per_page I for gate/up; SLOT_BASE 2,
rows_per_page H for down). The lookup is done once per output tile for its
column vector; inside a page the K loop strides as SGLang's fused_moe_kernel
does over a contiguous [E, N, K] tensor. When BLOCK_N divides rows_per_page
(``TILE_IN_PAGE``, every shipped config) a tile's columns lie in one page: the
lookup is one scalar load, B pointers are one int64 base plus int32 column
offsets (SGLang's form), and a missing page runs no K steps instead of masking
the accumulator. On sm_90 that takes ~25-30 % of the integer instructions per
tile away (setup, the per-column mask kept live through the K loop, the
epilogue's select) and the gate/up GEMM's register spill (bench/RESULTS.md).

Two launch-saving modes (decode is launch-bound: a launch costs about what a
small kernel's work does):

* ``FUSE_SILU`` (default when no ``act_and_mul`` is given): the gate/up GEMM
  tiles N = I columns and reads the gate and the up row of each column, two
  accumulators; its epilogue writes SiLU(gate) * up, rounding gate and up to
  the output dtype first, as the separate SiLU kernel sees them (the same
  numerics up to the fp32 summation order of the differently shaped dots).
* ``SLOT_BLOCKS`` (one token): the k routed experts of one token are distinct,
  so M-block j is token slot j alone and the expert is ``topk_ids[j]``; no
  alignment kernel runs. Each row's dot products are the same as with the
  alignment, so the output is too.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import triton
import triton.language as tl

from .align import moe_align_block_size_triton
from .moe_config import get_paged_moe_config, get_paged_moe_down_config

# Decided when this module is imported: triton.jit reads TRITON_INTERPRET then.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")

#: ``act_and_mul(x [rows, 2I], out [rows, I])``: out = act(x[:, :I]) * x[:, I:]
ActAndMul = Callable[[torch.Tensor, torch.Tensor], object]
#: ``combine(intermediate [T, k, H], out [T, H])``: out = the top-k reduction
Combine = Callable[[torch.Tensor, torch.Tensor], object]


class ExpertNotResidentError(ValueError):
    """A routed expert has page id -1 in the page table (validate mode only)."""


# ---------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------


@triton.jit
def _page_start(page, ok, page_elems, host_base, host_page_elems):
    """Element offset from the pool pointer where a page-table entry's matrix starts:
    pool page ``page`` (>= 0), host page ``-2 - page`` (<= -2), or pool page 0 when
    not ``ok`` (an in-bounds stand-in; the caller runs no K steps or zeroes it)."""
    pool_start = tl.where(ok & (page >= 0), page, 0) * page_elems
    host_start = host_base + (-2 - page) * host_page_elems
    return tl.where(ok & (page <= -2), host_start, pool_start)


# EM and num_valid_tokens follow the batch: specializing on them (Triton's
# divisible-by-16 and ==1 keys) compiled a new variant for each new class of
# eager token count -- seconds of stall the first time experts were offloaded
# under load on the H200. Strides, N, K and host_base keep their keys (alignment
# of the weight reads).
@triton.jit(do_not_specialize=["EM", "num_valid_tokens"])
def _paged_moe_gemm_kernel(
    a_ptr,
    pool_ptr,
    c_ptr,
    page_table_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    EM,
    num_valid_tokens,
    num_experts,
    rows_per_page,
    page_elems,
    host_base,
    host_page_elems,
    stride_am,
    stride_cm,
    stride_pt,
    SLOT_BASE: tl.constexpr,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLOT_BLOCKS: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """C[tok, n] = sum_t A[tok // TOP_K, t] * W_e(n, t)  (times routing weight).

    One program per (M-block of sorted token slots, N-block of output columns);
    grouped ordering of the program ids for L2 reuse.
    """
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if SLOT_BLOCKS:
        # expert_ids_ptr holds the flat topk_ids: block pid_m is token slot pid_m alone.
        offs_m = tl.arange(0, BLOCK_SIZE_M)
        tok = tl.where(offs_m == 0, pid_m, num_valid_tokens).to(tl.int64)
    else:
        num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
            return
        offs_tok_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
        tok = tl.load(sorted_token_ids_ptr + offs_tok_id).to(tl.int64)
    tok_mask = tok < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    # An id outside [0, E) (only possible in slot mode) reads no page.
    expert_ok = (expert >= 0) & (expert < num_experts)
    expert = tl.where(expert_ok, expert, 0)

    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (tok // TOP_K)[:, None] * stride_am + offs_k[None, :]
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if FUSE_SILU:
        acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if TILE_IN_PAGE:
        # rows_per_page % BLOCK_SIZE_N == 0 (launcher checks): the tile's columns
        # lie in one page. Scalar page lookup; per-column offsets in int32 plus
        # one int64 scalar base, as SGLang's b_ptr + e * stride_be + n * stride_bn.
        n0 = pid_n * BLOCK_SIZE_N
        slot = SLOT_BASE + n0 // rows_per_page
        row0 = n0 % rows_per_page
        pt_row = page_table_ptr + expert * stride_pt + slot
        page = tl.load(pt_row).to(tl.int64)
        ok = (page != -1) & expert_ok
        col_off = (tl.arange(0, BLOCK_SIZE_N) * K)[None, :] + offs_k[:, None]   # int32
        row_off = row0.to(tl.int64) * K
        b_ptrs = pool_ptr + (_page_start(page, ok, page_elems, host_base, host_page_elems) + row_off) + col_off
        if FUSE_SILU:
            page_up = tl.load(pt_row + 1).to(tl.int64)
            ok = ok & (page_up != -1)
            b_up_ptrs = pool_ptr + (_page_start(page_up, ok, page_elems, host_base, host_page_elems)
                                    + row_off) + col_off
        # A missing page (or, fused, either page) gives a zero output: run no K
        # steps instead of masking the accumulator (silu(0) * up = gate-silu * 0 = 0).
        k_end = tl.where(ok, K, 0)
    else:
        # Page lookup, once per tile: which page and row each output column reads.
        n = tl.where(n_mask, offs_n, 0)
        slot = SLOT_BASE + n // rows_per_page
        row = (n % rows_per_page).to(tl.int64)
        page = tl.load(page_table_ptr + expert * stride_pt + slot).to(tl.int64)
        page_ok = (page != -1) & expert_ok
        # A page of -1 reads page 0 (in bounds); its columns are zeroed after the loop.
        col_base = _page_start(page, page_ok, page_elems, host_base, host_page_elems) + row * K
        b_ptrs = pool_ptr + col_base[None, :] + offs_k[:, None]
        if FUSE_SILU:
            page_up = tl.load(page_table_ptr + expert * stride_pt + slot + 1).to(tl.int64)
            page_up_ok = (page_up != -1) & expert_ok
            b_up_ptrs = pool_ptr + (_page_start(page_up, page_up_ok, page_elems, host_base, host_page_elems)
                                    + row * K)[None, :] + offs_k[:, None]
        k_end = K

    for k0 in range(0, k_end, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=tok_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
            if FUSE_SILU:
                b_up = tl.load(b_up_ptrs)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=tok_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            if FUSE_SILU:
                b_up = tl.load(b_up_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if FUSE_SILU:
                b_up = b_up.to(tl.float32)
        # Written as SGLang's fused_moe_kernel writes it (acc += dot), so that
        # with the same tiles the two compile to the same fp32 accumulation.
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
        if FUSE_SILU:
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
            b_up_ptrs += BLOCK_SIZE_K

    if not TILE_IN_PAGE:
        acc = tl.where(page_ok[None, :], acc, 0.0)
        if FUSE_SILU:
            acc_up = tl.where(page_up_ok[None, :], acc_up, 0.0)
    if FUSE_SILU:
        # Gate and up rounded as the unfused path stores them, then _silu_and_mul_kernel's math.
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
    if MUL_ROUTED_WEIGHT:
        # fp32 accumulator times the routing weight, then one rounding to the
        # output dtype: SGLang's order (bias-free, unquantized).
        w = tl.load(topk_weights_ptr + tok, mask=tok_mask, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]

    c_ptrs = c_ptr + tok[:, None] * stride_cm + offs_n[None, :]
    tl.store(
        c_ptrs,
        acc.to(c_ptr.dtype.element_ty),
        mask=tok_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, I, stride_x, stride_y, BLOCK: tl.constexpr):
    """y[r, :] = silu(x[r, :I]) * x[r, I:2I], computed in fp32."""
    r = tl.program_id(axis=0).to(tl.int64)
    offs = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + r * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_top_k_kernel(x_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, :] = sum_j x[t, j, :] (x contiguous [T, TOP_K, H]), fp32, j in order."""
    t = tl.program_id(axis=0).to(tl.int64)
    offs = tl.program_id(axis=1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------


def _check_inputs(hidden, pool, page_table, topk_weights, topk_ids, inter_size, page_elems, out,
                  host_pages=None):
    def fail(arg: str, msg: str):
        raise ValueError(f"paged_fused_moe: {arg}: {msg}")

    if hidden.dim() != 2:
        fail("hidden", f"must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _WEIGHT_DTYPES:
        fail("hidden", f"dtype must be one of {_WEIGHT_DTYPES}, got {hidden.dtype}")
    if hidden.stride(1) != 1:
        fail("hidden", "rows must be contiguous (stride(1) == 1)")
    T, H = hidden.shape
    dev = hidden.device
    if pool.dim() != 1 or not pool.is_contiguous():
        fail("pool", f"must be a contiguous 1-D tensor, got shape {tuple(pool.shape)}")
    if pool.dtype != hidden.dtype:
        fail("pool", f"dtype {pool.dtype} differs from hidden's {hidden.dtype}")
    if page_table.dim() != 2 or page_table.shape[1] != 3:
        fail("page_table", f"must be [E, 3], got shape {tuple(page_table.shape)}")
    if page_table.dtype not in (torch.int32, torch.int64):
        fail("page_table", f"dtype must be int32 or int64, got {page_table.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        fail("topk_ids", f"must be [T={T}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        fail("topk_ids", f"dtype must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        fail(
            "topk_weights",
            f"shape {tuple(topk_weights.shape)} differs from topk_ids' {tuple(topk_ids.shape)}",
        )
    if not topk_weights.is_floating_point():
        fail("topk_weights", f"must be floating point, got {topk_weights.dtype}")
    if inter_size <= 0:
        fail("inter_size", f"must be positive, got {inter_size}")
    if page_elems < inter_size * H:
        fail("page_elems", f"{page_elems} < inter_size * H = {inter_size * H}")
    for name, t in (("pool", pool), ("page_table", page_table),
                    ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != dev:
            fail(name, f"on {t.device}, hidden on {dev}")
    if host_pages is not None:
        if host_pages.dim() != 1 or not host_pages.is_contiguous() or host_pages.dtype != hidden.dtype:
            fail("host_pages", f"must be a contiguous 1-D {hidden.dtype} tensor, got "
                 f"{tuple(host_pages.shape)} {host_pages.dtype}")
        if host_pages.numel() % (inter_size * H):
            fail("host_pages", f"{host_pages.numel()} elements is not a whole number of I*H pages")
        # (is_pinned asks the CUDA runtime: not during a graph capture; the manager checks it once)
        if dev.type == "cuda" and not torch.cuda.is_current_stream_capturing() and not (
                host_pages.device == dev or host_pages.is_pinned()):
            fail("host_pages", "must be pinned host memory (mapped into the device's address space)")
        if dev.type == "cpu" and host_pages.device.type != "cpu":
            fail("host_pages", f"on {host_pages.device}, hidden on cpu")
    if out is not None:
        if tuple(out.shape) != (T, H) or out.dtype != hidden.dtype or out.device != dev:
            fail("out", f"must be [{T}, {H}] {hidden.dtype} on {dev}, got "
                 f"{tuple(out.shape)} {out.dtype} on {out.device}")
        if not out.is_contiguous():
            fail("out", "must be contiguous")


def _validate_pages(pool, page_table, topk_ids, inter_size, H, page_elems, host_pages):
    """Host checks (sync): routed ids in range, their pages present and in the pool
    or the host pages."""
    E = page_table.shape[0]
    routed = torch.unique(topk_ids).tolist()
    bad = [e for e in routed if not 0 <= e < E]
    if bad:
        raise ValueError(f"paged_fused_moe: topk_ids: expert ids {bad} outside [0, {E})")
    pages = page_table[routed].tolist()
    missing = [e for e, row in zip(routed, pages) if -1 in row]
    if missing:
        raise ExpertNotResidentError(
            f"paged_fused_moe: page_table: routed experts {missing} have page id -1 "
            "(neither resident, loaded nor on the host)"
        )
    last_page = (pool.numel() - inter_size * H) // page_elems
    host_count = 0 if host_pages is None else host_pages.numel() // (inter_size * H)
    for e, row in zip(routed, pages):
        if max(row) > last_page:
            raise ValueError(
                f"paged_fused_moe: page_table: expert {e} pages {row} run past the "
                f"pool ({pool.numel()} elements, page_elems={page_elems})"
            )
        host = [-2 - p for p in row if p <= -2]
        if host and max(host) >= host_count:
            raise ValueError(
                f"paged_fused_moe: page_table: expert {e} reads host pages {host}, "
                f"host_pages holds {host_count}"
            )


def _host_base(pool: torch.Tensor, host_pages: torch.Tensor | None) -> int:
    """Element offset of ``host_pages`` from ``pool`` (the kernel's ``host_base``).

    Pinned host memory is mapped into the device's address space at its host
    address (CUDA unified addressing), so the kernel reaches it from the pool's
    pointer. 0 without host pages (entries <= -2 must then not be routed).
    """
    if host_pages is None:
        return 0
    delta = host_pages.data_ptr() - pool.data_ptr()
    if delta % pool.element_size():
        raise ValueError("paged_fused_moe: host_pages is not element-aligned relative to the pool")
    return delta // pool.element_size()


def _checked_config(name: str, config: dict) -> dict:
    """The config's launch options (num_warps, num_stages, ...) after checking its keys."""
    missing = [k for k in _CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"paged_fused_moe: {name}: missing keys {missing}")
    if config.get("USE_TMA"):
        raise ValueError(f"paged_fused_moe: {name}: USE_TMA is set; the paged kernel has no TMA path")
    return {k: v for k, v in config.items() if k not in _CONFIG_KEYS and k != "USE_TMA"}


# Shared memory the fused gate/up GEMM may plan for: under Hopper's 227 KB per
# block, leaving room for the epilogue's layout conversion.
_FUSED_SMEM_BUDGET = 200 * 1024


def fit_fused_config(config: dict, elem_bytes: int) -> dict:
    """``config`` fitted to the fused gate/up GEMM, which streams two B tiles per K step.

    A config written for an unfused GEMM (SGLang's tables, a caller's) can ask
    for more shared memory than a block has once B is doubled: drop pipeline
    stages (down to 2), then halve BLOCK_SIZE_N, until the estimate fits.
    Configs tuned for the fused GEMM (``configs/``) fit and pass unchanged.
    """
    c = dict(config)

    def smem(c):
        return c.get("num_stages", 3) * (c["BLOCK_SIZE_M"] + 2 * c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * elem_bytes

    while smem(c) > _FUSED_SMEM_BUDGET and c.get("num_stages", 3) > 2:
        c["num_stages"] = c.get("num_stages", 3) - 1
    while smem(c) > _FUSED_SMEM_BUDGET and c["BLOCK_SIZE_N"] > 16:
        c["BLOCK_SIZE_N"] //= 2
    return c


def _launch_gemm(a, c, pool, page_table, topk_weights, aligned, *, N, K, rows_per_page,
                 slot_base, top_k, mul_routed_weight, page_elems, config, options, upcast,
                 fuse_silu=False, host_base=0, host_page_elems=0):
    """One GEMM. ``options``: the config's other keys (num_warps, num_stages, ...),
    passed to the launch as SGLang passes ``**config``; absent ones are Triton's defaults.
    ``aligned``: an ``AlignedTokens``, or the flat topk_ids for slot blocks (one token).
    ``fuse_silu``: gate/up GEMM writing SiLU(gate) * up; N is then I."""
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    slot_blocks = isinstance(aligned, torch.Tensor)
    if slot_blocks:
        em = aligned.numel() * bm  # one M-block per slot
        sorted_ids = expert_ids = num_post = aligned
    else:
        em = aligned.sorted_token_ids.numel()
        sorted_ids, expert_ids, num_post = aligned
    grid = (triton.cdiv(em, bm) * triton.cdiv(N, bn),)
    fp32_dot = upcast or a.dtype == torch.float32
    _paged_moe_gemm_kernel[grid](
        a, pool, c, page_table, topk_weights,
        sorted_ids, expert_ids, num_post,
        N, K, em, c.shape[0], page_table.shape[0],
        rows_per_page, page_elems, host_base, host_page_elems,
        a.stride(0), c.stride(0), page_table.stride(0),
        SLOT_BASE=slot_base,
        TOP_K=top_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        EVEN_K=K % bk == 0,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if fp32_dot else "tf32",
        SLOT_BLOCKS=slot_blocks,
        FUSE_SILU=fuse_silu,
        TILE_IN_PAGE=rows_per_page % bn == 0,
        BLOCK_SIZE_M=bm,
        BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=config["GROUP_SIZE_M"],
        **options,
    )


def _silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> None:
    """The default ``act_and_mul``: this module's Triton SiLU*up (fp32 math)."""
    inter = out.shape[1]
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block
    )


def _sum_top_k(intermediate: torch.Tensor, out: torch.Tensor) -> None:
    """The default ``combine``: the sum over the top-k axis, in fp32, in slot order
    (one Triton launch; torch's reduction costs about twice as long in decode)."""
    T, k, H = intermediate.shape
    block = min(triton.next_power_of_2(H), 1024)
    _sum_top_k_kernel[(T, triton.cdiv(H, block))](intermediate, out, H, TOP_K=k, BLOCK=block)


def paged_fused_moe(
    hidden: torch.Tensor,
    pool: torch.Tensor,
    page_table: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inter_size: int,
    page_elems: int,
    config: dict | None = None,
    down_config: dict | None = None,
    act_and_mul: ActAndMul | None = None,
    combine: Combine | None = None,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    upcast: bool | None = None,
    host_pages: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = topk_ids[t, j].

    hidden: [T, H] bf16/fp16/fp32. pool: 1-D, the page pool viewed as
    hidden's dtype. page_table: int32/int64 [E, 3], per expert the page of W1
    (gate, [I, H]), W3 (up, [I, H]) and W2 (down, [H, I]); -1 = absent; ``-2 - h`` = host page h
    of ``host_pages`` (read in place: zero-copy).
    topk_weights / topk_ids: [T, k] routing weights and expert ids.
    inter_size: I (per TP shard). page_elems: pool elements per expert page
    (>= I * H; pages may be padded). config: launch config with SGLang's keys
    (BLOCK_SIZE_M/N/K, GROUP_SIZE_M; other keys such as num_warps, num_stages
    go to the launch, absent ones take Triton's defaults); None = from
    ``configs/`` (and the down GEMM's from its ``_down`` table there, if any).
    down_config: the down GEMM's config, None = ``config``; its
    BLOCK_SIZE_M must equal ``config``'s (one alignment serves both GEMMs).
    act_and_mul(x [T*k, 2I], out [T*k, I]): writes SiLU(gate) * up into out;
    None = fused into the gate/up GEMM (this module's SiLU kernel's math).
    combine(intermediate [T, k, H], out [T, H]): writes
    the top-k reduction of the down GEMM's output (already multiplied by the
    routing weights) into out; None = an fp32 sum over k (one Triton launch).
    The three let a caller reproduce another fused MoE's arithmetic exactly
    (``rimuru_patches`` passes SGLang's). out: optional [T, H] output
    (hidden's dtype). host_pages: 1-D tensor of unpadded I*H pages (pinned host
    memory for CUDA tensors). validate: host
    checks of routed ids and their pages (syncs; not CUDA-graph safe);
    None = on for CPU tensors or when RIMURU_KERNELS_VALIDATE=1. Without it a
    routed expert with page -1 contributes zero. upcast: feed fp32 to tl.dot
    (None = only for bf16 under the Triton interpreter, whose bf16 dot is wrong).

    GEMMs accumulate in fp32; the gate/up output (rounded even when fused) and
    SiLU*up are stored in hidden's dtype, like SGLang's fused MoE. One token
    (T == 1) skips the alignment kernel (slot blocks, same output).
    """
    _check_inputs(hidden, pool, page_table, topk_weights, topk_ids, inter_size, page_elems, out, host_pages)
    T, H = hidden.shape
    E, top_k = page_table.shape[0], topk_ids.shape[1]
    I = inter_size
    if INTERPRETED != (hidden.device.type == "cpu"):
        raise RuntimeError(
            "paged_fused_moe: tensors on "
            f"{hidden.device.type} but TRITON_INTERPRET={'1' if INTERPRETED else '0'} "
            "when rimuru_kernels was imported; CPU needs the interpreter, CUDA must not use it"
        )
    if validate is None:
        validate = hidden.device.type == "cpu" or os.environ.get("RIMURU_KERNELS_VALIDATE") == "1"
    if validate:
        _validate_pages(pool, page_table, topk_ids, I, H, page_elems, host_pages)
    host = dict(host_base=_host_base(pool, host_pages), host_page_elems=I * H)
    if upcast is None:
        upcast = INTERPRETED and hidden.dtype == torch.bfloat16
    if out is None:
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if T == 0 or top_k == 0:
        return out.zero_()
    if config is None:
        config = get_paged_moe_config(E, I, T, hidden.device)
        if down_config is None:
            down_config = get_paged_moe_down_config(E, I, T, hidden.device)
    up_options = _checked_config("config", config)
    if down_config is None:
        down_config, down_options = config, up_options
    else:
        down_options = _checked_config("down_config", down_config)
        if down_config["BLOCK_SIZE_M"] != config["BLOCK_SIZE_M"]:
            raise ValueError(
                f"paged_fused_moe: down_config: BLOCK_SIZE_M {down_config['BLOCK_SIZE_M']} differs "
                f"from config's {config['BLOCK_SIZE_M']}; both GEMMs read one token alignment "
                "padded to config's BLOCK_SIZE_M"
            )

    if T == 1:  # one token's k experts are distinct: one M-block per slot, no alignment
        aligned = topk_ids.reshape(-1).contiguous()
    else:
        aligned = moe_align_block_size_triton(topk_ids, config["BLOCK_SIZE_M"], E)
    page_table = page_table.contiguous()
    topk_weights = topk_weights.contiguous().view(-1)
    rows = T * top_k

    act = torch.empty(rows, I, dtype=hidden.dtype, device=hidden.device)
    if act_and_mul is None:  # SiLU*up in the gate/up GEMM's epilogue
        fused = fit_fused_config(config, hidden.element_size())
        _launch_gemm(hidden, act, pool, page_table, topk_weights, aligned,
                     N=I, K=H, rows_per_page=I, slot_base=0, top_k=top_k,
                     mul_routed_weight=False, page_elems=page_elems, config=fused,
                     options=_checked_config("config", fused), upcast=upcast, fuse_silu=True, **host)
    else:
        gate_up = torch.empty(rows, 2 * I, dtype=hidden.dtype, device=hidden.device)
        _launch_gemm(hidden, gate_up, pool, page_table, topk_weights, aligned,
                     N=2 * I, K=H, rows_per_page=I, slot_base=0, top_k=top_k,
                     mul_routed_weight=False, page_elems=page_elems, config=config,
                     options=up_options, upcast=upcast, **host)
        act_and_mul(gate_up, act)

    down = torch.empty(rows, H, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(act, down, pool, page_table, topk_weights, aligned,
                 N=H, K=I, rows_per_page=H, slot_base=2, top_k=1,
                 mul_routed_weight=True, page_elems=page_elems, config=down_config,
                 options=down_options, upcast=upcast, **host)

    (combine or _sum_top_k)(down.view(T, top_k, H), out)
    return out
