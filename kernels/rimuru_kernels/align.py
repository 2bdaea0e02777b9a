"""Token slots grouped by expert and padded to the GEMM's BLOCK_SIZE_M.

The output format is SGLang's ``moe_align_block_size``: the GEMM kernel takes
one M-block of ``sorted_token_ids`` at a time, all of one expert
(``expert_ids[block]``). Two implementations with the same output exactly:
torch (reference, CPU and CUDA) and Triton (what the launcher uses). The
Triton one is a single program for small batches (decode: one launch, since a
launch there costs as much as the work) and, above ``ONE_PROGRAM_MAX_SLOTS``
slots, three launches parallel over chunks of slots (histogram per chunk,
offsets, scatter per chunk).

Sizes that follow the batch (slot counts, padded lengths, block and chunk
counts) are ``do_not_specialize``: Triton would otherwise compile a variant per
class of value (divisible by 16, equal to 1), and a new eager batch size stalled
serving for seconds on a cold cache. ``BLOCK_N`` (a power of two of the slots)
still compiles one variant per power of two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Largest ``topk_ids.numel()`` (and expert count) aligned by the one-program
#: kernel: it sorts all slots in one CTA, which stops paying off past ~1k slots.
ONE_PROGRAM_MAX_SLOTS = 1024
ONE_PROGRAM_MAX_EXPERTS = 1024
#: Slots per program of the chunked (large batch) kernels.
CHUNK_SLOTS = 1024


class AlignedTokens(NamedTuple):
    """Token slots grouped by expert, each expert's group padded to block_size.

    sorted_token_ids: int32 [max_padded]; flat (token * top_k + slot) indices;
        padding entries hold ``topk_ids.numel()``.
    expert_ids: int32 [cdiv(max_padded, block_size)]; the expert of each block,
        -1 for blocks at or past ``num_tokens_post_padded``.
    num_tokens_post_padded: int32 [1]; the used length of sorted_token_ids.
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> AlignedTokens:
    """Group the flat token slots of ``topk_ids`` by expert, padded to block_size.

    Slots of one expert keep their flat order (deterministic). Torch only, no
    host sync (CUDA-graph capturable); ids outside [0, num_experts) are not
    checked here. Buffers are sized for the worst case,
    ``n + min(n, E) * (block_size - 1)`` entries for n = topk_ids.numel();
    ``num_tokens_post_padded`` says how much is used.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    max_padded = n + min(n, num_experts) * (block_size - 1)
    max_blocks = triton.cdiv(max_padded, block_size)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    rank = torch.arange(n, device=device) - count_start[sorted_experts]
    sorted_token_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_token_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)

    num_post = padded_end[-1:] if num_experts > 0 else counts.new_zeros(1)
    block_start = torch.arange(max_blocks, device=device) * block_size
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < num_post, expert_ids, -1)
    return AlignedTokens(
        sorted_token_ids, expert_ids.to(torch.int32), num_post.to(torch.int32)
    )


@triton.jit(do_not_specialize=["n", "max_padded", "fill_per_program"])
def _align_chunk_count_kernel(ids_ptr, chunk_counts_ptr, sorted_token_ids_ptr, n, E, max_padded,
                              fill_per_program, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c: the expert histogram of slots [c*CHUNK, (c+1)*CHUNK), and the
    padding value n written over its share of sorted_token_ids (the scatter
    launch later overwrites the used entries)."""
    c = tl.program_id(axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    valid = (offs < n) & (ids >= 0) & (ids < E)
    counts = tl.histogram(tl.where(valid, ids, 0), BLOCK_E, mask=valid)
    tl.store(chunk_counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    lo = c * fill_per_program
    for t0 in range(lo, lo + fill_per_program, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        tl.store(sorted_token_ids_ptr + t, tl.zeros_like(t) + n,
                 mask=(t < lo + fill_per_program) & (t < max_padded))


@triton.jit(do_not_specialize=["n_chunks", "max_blocks"])
def _align_chunk_offsets_kernel(chunk_counts_ptr, chunk_base_ptr, expert_ids_ptr,
                                num_tokens_post_padded_ptr, n_chunks, max_blocks,
                                BLOCK_SIZE_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: chunk_base[c, e] = where chunk c's slots of expert e start in
    sorted_token_ids (expert e's padded start + its slots in chunks before c);
    block expert ids and the padded total."""
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, n_chunks):
        counts += tl.load(chunk_counts_ptr + c * BLOCK_E + offs_e)
    padded = (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    # Second pass (no read-back of this program's own stores, so no barrier).
    running = padded_end - padded
    for c in range(0, n_chunks):
        tl.store(chunk_base_ptr + c * BLOCK_E + offs_e, running)
        running += tl.load(chunk_counts_ptr + c * BLOCK_E + offs_e)
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        start = b * BLOCK_SIZE_M
        e_b = tl.sum((padded_end[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(start < total, e_b, -1), mask=b < max_blocks)
    tl.store(num_tokens_post_padded_ptr, total)


@triton.jit(do_not_specialize=["n"])
def _align_chunk_scatter_kernel(ids_ptr, chunk_base_ptr, sorted_token_ids_ptr, n, E,
                                CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program c places its slots: the i-th (in flat order) slot of expert e in
    this chunk goes to chunk_base[c, e] + i (the one-program kernel's sort trick)."""
    c = tl.program_id(axis=0)
    offs = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + c * CHUNK + offs, mask=c * CHUNK + offs < n, other=-1)
    valid = (c * CHUNK + offs < n) & (ids >= 0) & (ids < E)
    ids = tl.where(valid, ids, 0)
    counts = tl.histogram(ids, BLOCK_E, mask=valid)
    base = tl.load(chunk_base_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E))
    shift = base - (tl.cumsum(counts, 0) - counts)
    key = tl.sort(tl.where(valid, ids * CHUNK + offs, E * CHUNK + offs))
    placed = key < E * CHUNK
    dst = tl.gather(shift, tl.where(placed, key // CHUNK, 0), 0) + offs
    tl.store(sorted_token_ids_ptr + dst, c * CHUNK + key % CHUNK, mask=placed)


@triton.jit(do_not_specialize=["n", "max_padded", "max_blocks"])
def _align_one_program_kernel(
    ids_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    n,
    E,
    max_padded,
    max_blocks,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The whole alignment in one program (n <= BLOCK_N slots, E <= BLOCK_E).

    Counts by histogram; the slots' places by sorting the keys
    ``expert * BLOCK_N + slot`` (unique, so the sort keeps flat order within an
    expert): the i-th sorted slot of expert e goes to
    ``padded_start[e] + (i - count_start[e])``.
    """
    offs = tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
    # Ids outside [0, E) are not placed anywhere (as in the two-launch kernels).
    valid = (offs < n) & (ids >= 0) & (ids < E)
    ids = tl.where(valid, ids, 0)
    counts = tl.histogram(ids, BLOCK_E, mask=valid)
    padded = (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    shift = (padded_end - padded) - (tl.cumsum(counts, 0) - counts)

    # Padding everywhere first; the barrier orders it before the scatter below.
    for t0 in range(0, max_padded, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(sorted_token_ids_ptr + t, tl.zeros_like(t) + n, mask=t < max_padded)
    tl.debug_barrier()

    key = tl.sort(tl.where(valid, ids * BLOCK_N + offs, E * BLOCK_N + offs))
    placed = key < E * BLOCK_N
    expert = tl.where(placed, key // BLOCK_N, 0)
    dst = tl.gather(shift, expert, 0) + offs
    tl.store(sorted_token_ids_ptr + dst, key % BLOCK_N, mask=placed)

    # Block b's expert: how many experts' padded groups end at or before it
    # (lanes >= E end at `total`, so they never count for a used block).
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        start = b * BLOCK_SIZE_M
        e_b = tl.sum((padded_end[None, :] <= start[:, None]).to(tl.int32), axis=1)
        e_b = tl.where(start < total, e_b, -1)
        tl.store(expert_ids_ptr + b, e_b, mask=b < max_blocks)
    tl.store(num_tokens_post_padded_ptr, total)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor, block_size: int, num_experts: int,
    one_program: bool | None = None,
) -> AlignedTokens:
    """``moe_align_block_size`` in Triton, the same output exactly.

    one_program: None = one launch up to ``ONE_PROGRAM_MAX_SLOTS`` slots (and
    ``ONE_PROGRAM_MAX_EXPERTS`` experts), else the chunked kernels (three
    launches, each parallel over chunks of ``CHUNK_SLOTS`` slots).
    """
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    n = flat.numel()
    max_padded = n + min(n, num_experts) * (block_size - 1)
    max_blocks = triton.cdiv(max_padded, block_size)
    sorted_token_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    if num_experts == 0:
        return AlignedTokens(sorted_token_ids, expert_ids, num_post.zero_())
    if one_program is None:
        one_program = n <= ONE_PROGRAM_MAX_SLOTS and num_experts <= ONE_PROGRAM_MAX_EXPERTS
    if one_program:
        if n > ONE_PROGRAM_MAX_SLOTS or num_experts > ONE_PROGRAM_MAX_EXPERTS:
            raise ValueError(
                f"one-program align takes at most {ONE_PROGRAM_MAX_SLOTS} slots and "
                f"{ONE_PROGRAM_MAX_EXPERTS} experts, got {n} slots, {num_experts} experts")
        block_e = triton.next_power_of_2(num_experts)
        _align_one_program_kernel[(1,)](
            flat, sorted_token_ids, expert_ids, num_post,
            n, num_experts, max_padded, max_blocks,
            BLOCK_SIZE_M=block_size,
            BLOCK_N=max(16, triton.next_power_of_2(n)),
            BLOCK_E=block_e,
            BLOCK_B=max(1, 4096 // block_e),
            BLOCK=1024,
        )
        return AlignedTokens(sorted_token_ids, expert_ids, num_post)
    # Chunked: a histogram per chunk of slots, one program for the offsets, a
    # scatter per chunk; every launch is parallel over the slots.
    block_e = triton.next_power_of_2(num_experts)
    n_chunks = max(1, triton.cdiv(n, CHUNK_SLOTS))
    chunk_counts = torch.empty(n_chunks, block_e, dtype=torch.int32, device=device)
    chunk_base = torch.empty(n_chunks, block_e, dtype=torch.int32, device=device)
    _align_chunk_count_kernel[(n_chunks,)](
        flat, chunk_counts, sorted_token_ids, n, num_experts, max_padded,
        triton.cdiv(max_padded, n_chunks), CHUNK=CHUNK_SLOTS, BLOCK_E=block_e)
    _align_chunk_offsets_kernel[(1,)](
        chunk_counts, chunk_base, expert_ids, num_post, n_chunks, max_blocks,
        BLOCK_SIZE_M=block_size, BLOCK_E=block_e, BLOCK_B=max(1, 4096 // block_e))
    _align_chunk_scatter_kernel[(n_chunks,)](
        flat, chunk_base, sorted_token_ids, n, num_experts, CHUNK=CHUNK_SLOTS, BLOCK_E=block_e)
    return AlignedTokens(sorted_token_ids, expert_ids, num_post)
