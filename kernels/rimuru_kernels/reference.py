"""Plain torch references for the paged MoE kernel, in fp32, one expert at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_weights_from_pool(
    pool: torch.Tensor,
    page_table: torch.Tensor,
    expert: int,
    *,
    inter_size: int,
    hidden_size: int,
    page_elems: int,
    host_pages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W1 [I, H], W3 [I, H], W2 [H, I]) of one expert: views into the pool, or into
    ``host_pages`` (unpadded I*H pages) for entries ``-2 - h``."""
    I, H = inter_size, hidden_size
    p1, p3, p2 = (int(p) for p in page_table[expert].tolist())
    if -1 in (p1, p3, p2):
        raise ValueError(f"expert {expert} has page id -1: {[p1, p3, p2]}")

    def page(p: int) -> torch.Tensor:
        if p <= -2:
            h = -2 - p
            return host_pages[h * I * H : (h + 1) * I * H]
        return pool[p * page_elems : p * page_elems + I * H]

    return page(p1).view(I, H), page(p3).view(I, H), page(p2).view(H, I)


def _moe(hidden, topk_weights, topk_ids, weights_of) -> torch.Tensor:
    x = hidden.float()
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w1, w3, w2 = (w.float() for w in weights_of(e))
        xe = x[tok]
        y = (F.silu(xe @ w1.T) * (xe @ w3.T)) @ w2.T
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out


def paged_fused_moe_reference(
    hidden: torch.Tensor,
    pool: torch.Tensor,
    page_table: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inter_size: int,
    page_elems: int,
    host_pages: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``paged_fused_moe`` computes, in fp32 ([T, H] float32)."""
    H = hidden.shape[1]
    return _moe(
        hidden,
        topk_weights,
        topk_ids,
        lambda e: expert_weights_from_pool(
            pool, page_table, e, inter_size=inter_size, hidden_size=H, page_elems=page_elems,
            host_pages=host_pages,
        ),
    )


def fused_moe_dense_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same MoE from SGLang-layout weights w13 [E, 2I, H], w2 [E, H, I] (fp32)."""
    I = w13.shape[1] // 2
    return _moe(hidden, topk_weights, topk_ids, lambda e: (w13[e, :I], w13[e, I:], w2[e]))
