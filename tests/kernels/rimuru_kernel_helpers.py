"""Random MoE problems laid out in a scattered, padded page pool."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


@dataclass
class Problem:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    pool: torch.Tensor
    page_table: torch.Tensor
    page_elems: int
    inter_size: int


def route(T: int, E: int, k: int, routing: str, g: torch.Generator):
    """Top-k routing. uniform: any expert; subset: only experts < E - 3;
    skewed: every token's first choice is expert 3."""
    logits = torch.randn(T, E, generator=g)
    if routing == "subset":
        logits[:, E - 3 :] = -float("inf")
    elif routing == "skewed":
        logits[:, 3] += 20.0
    elif routing != "uniform":
        raise ValueError(routing)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return weights, ids.to(torch.int32)


def make_problem(
    T: int,
    *,
    E: int = 8,
    H: int = 64,
    I: int = 48,
    k: int = 2,
    routing: str = "uniform",
    dtype: torch.dtype = torch.float32,
    page_pad: int = 40,
    spare_pages: int = 11,
    absent: tuple[int, ...] = (),
    seed: int = 0,
    device: torch.device = DEVICE,
) -> Problem:
    """Weights on randomly chosen pages of a NaN-filled pool, pages padded by
    ``page_pad`` elements; experts in ``absent`` get page ids -1."""
    from rimuru_kernels import pack_weights_into_pool

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    weights, ids = route(T, E, k, routing, g)
    num_pages = 3 * E + spare_pages
    table = torch.randperm(num_pages, generator=g)[: 3 * E].view(E, 3).to(torch.int32)
    for e in absent:
        table[e] = -1
    page_elems = I * H + page_pad
    hidden, w13, w2 = (t.to(dtype) for t in (hidden, w13, w2))
    pool = pack_weights_into_pool(w13, w2, table, page_elems, num_pages)
    return Problem(
        hidden.to(device),
        w13.to(device),
        w2.to(device),
        weights.to(device),
        ids.to(device),
        pool.to(device),
        table.to(device),
        page_elems,
        I,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
