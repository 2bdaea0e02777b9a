"""Expert weights as pool pages: packing helpers for tests and for the
contiguous-layout comparison (same kernel, pages 3e, 3e + 1, 3e + 2)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedWeights(NamedTuple):
    """Expert weights as pool pages: what ``paged_fused_moe`` reads."""

    pool: torch.Tensor
    page_table: torch.Tensor
    page_elems: int


def contiguous_page_table(
    num_experts: int,
    inter_size: int,
    hidden_size: int,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Page table and page size for weights packed expert-major, 3 pages each.

    Expert e: W1 on page 3e, W3 on 3e + 1, W2 on 3e + 2; page_elems = I * H
    (W2 is [H, I], the same size). Returns (page_table int32 [E, 3], page_elems).
    """
    table = torch.arange(3 * num_experts, dtype=torch.int32, device=device)
    return table.view(num_experts, 3), inter_size * hidden_size


def pack_weights_into_pool(
    w13: torch.Tensor,
    w2: torch.Tensor,
    page_table: torch.Tensor,
    page_elems: int,
    num_pages: int,
    *,
    fill: float = float("nan"),
) -> torch.Tensor:
    """A new pool of ``num_pages`` pages holding each expert's matrices on its pages.

    w13: [E, 2I, H] (W1 rows then W3 rows, SGLang's layout); w2: [E, H, I].
    Entries of page_table that are -1 are skipped; all other bytes of the pool
    are ``fill`` (NaN by default, so a stray read shows).
    """
    E, two_i, H = w13.shape
    inter = two_i // 2
    if two_i != 2 * inter or tuple(w2.shape) != (E, H, inter):
        raise ValueError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    if page_elems < inter * H:
        raise ValueError(f"page_elems={page_elems} < I*H={inter * H}")
    pool = torch.full((num_pages * page_elems,), fill, dtype=w13.dtype, device=w13.device)
    pages = pool.view(num_pages, page_elems)
    table = page_table.tolist()
    for e in range(E):
        mats = (w13[e, :inter], w13[e, inter:], w2[e])
        for slot, mat in enumerate(mats):
            p = table[e][slot]
            if p >= 0:
                pages[p, : inter * H] = mat.reshape(-1)
    return pool


def pack_contiguous_weights(w13: torch.Tensor, w2: torch.Tensor) -> PagedWeights:
    """Copy SGLang-layout weights into a pool laid out by ``contiguous_page_table``."""
    E, two_i, H = w13.shape
    table, page_elems = contiguous_page_table(E, two_i // 2, H, device=w13.device)
    pool = pack_weights_into_pool(w13, w2, table, page_elems, 3 * E)
    return PagedWeights(pool, table, page_elems)
