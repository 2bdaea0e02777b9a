"""A tiny model's expert residency, wired to a real pool on CPU.

Default rig: E=8 experts, I=4, H=8, top-2, MoE layers (0, 1), bf16 -> one
expert matrix is 32 elements = 64 B = one expert page; a 64-page pool.
Ranking: layer 0 ``[3, 1, 4, 0, 5, 2, 7, 6]``, layer 1 ``[7, 6, 5, 4, 3, 2, 1, 0]``.
Offload limit 3, 5 resident per layer; placement, then the load buffers::

    layer 0  3:(0,1,2) 1:(3,4,5) 4:(6,7,8) 0:(9,10,11) 5:(12,13,14)    offloaded 2, 7, 6
    layer 1  7:(15..17) 6:(18..20) 5:(21..23) 4:(24..26) 3:(27..29)   offloaded 2, 1, 0
    buffer 0 slots (30,31,32) (33,34,35) (36,37,38)
    buffer 1 slots (39,40,41) (42,43,44) (45,46,47)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_rimuru.experts import (
    ExpertManager,
    ExpertRanking,
    ExpertResidency,
    HostExpertStore,
    LoadBuffers,
    MoEShape,
)
from sglang_rimuru.pool import PoolBuffer, PoolGeometry, UnifiedPagePool

ORDERS = {0: [3, 1, 4, 0, 5, 2, 7, 6], 1: [7, 6, 5, 4, 3, 2, 1, 0]}


def tiny_shape(layer_ids=(0, 1), E=8, I=4, H=8, k=2, dtype=torch.bfloat16) -> MoEShape:
    return MoEShape(layer_ids=tuple(layer_ids), num_experts=E, hidden=H, inter=I, top_k=k, dtype=dtype)


def ranking_of(shape: MoEShape, orders: dict[int, list[int]]) -> ExpertRanking:
    e = shape.num_experts
    probs = {l: [(e - r) / (e * (e + 1) / 2) for r in range(e)] for l in orders}
    return ExpertRanking(e, orders, probs)


def make_pool(shape: MoEShape, pages: int, kv_page_bytes: int | None = None,
              page_bytes: int | None = None):
    page_bytes = page_bytes or shape.expert_page_bytes
    geo = PoolGeometry(total_bytes=pages * page_bytes,
                       expert_page_bytes=page_bytes,
                       kv_page_bytes=kv_page_bytes or shape.expert_page_bytes // 2)
    return geo, UnifiedPagePool(geo)


@dataclass
class Rig:
    shape: MoEShape
    pool: UnifiedPagePool
    buffer: PoolBuffer
    ranking: ExpertRanking
    residency: ExpertResidency
    host: HostExpertStore
    buffers: LoadBuffers
    manager: ExpertManager
    w13: dict[int, torch.Tensor]  # SGLang layout [E, 2I, H]
    w2: dict[int, torch.Tensor]  # [E, H, I]
    gates: dict[int, torch.Tensor] | None


def identity_gates(shape: MoEShape) -> dict[int, torch.Tensor]:
    """Router weights whose logits are the first E hidden features (needs H >= E)."""
    return {l: torch.eye(shape.num_experts, shape.hidden, dtype=shape.dtype) for l in shape.layer_ids}


def make_rig(shape: MoEShape | None = None, *, ranking: ExpertRanking | None = None,
             limit: int = 3, resident: int = 5, gates="identity", pages: int = 64,
             fragment: bool = False, seed: int = 0, page_bytes: int | None = None,
             sglang_layout: bool = False) -> Rig:
    shape = shape or tiny_shape()
    if ranking is None:
        ranking = ranking_of(shape, ORDERS) if shape.layer_ids == (0, 1) and shape.num_experts == 8 \
            else ExpertRanking.default(shape)
    geo, pool = make_pool(shape, pages, page_bytes=page_bytes)  # larger page: padded
    if fragment:  # scatter the pages: taken pages and KV pages between the experts
        junk = pool.alloc_expert_pages(6, [("junk", i) for i in range(6)])
        pool.free_expert_pages(junk[::2])
        pool.alloc_kv_pages(1, "req")
    buf = PoolBuffer(geo, "cpu", zero=True)
    residency = ExpertResidency(shape, ranking, limit)
    residency.place_initial(pool, resident, sglang_layout=sglang_layout)
    buffers = LoadBuffers(shape, pool, limit)
    host = HostExpertStore(shape, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    w13, w2 = {}, {}
    for l in shape.layer_ids:
        e, i, h = shape.num_experts, shape.inter, shape.hidden
        w13[l] = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(shape.dtype)
        w2[l] = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(shape.dtype)
        host.put_fused(l, w13[l], w2[l])
    if gates == "identity":
        gates = identity_gates(shape)
    elif gates == "random":
        gates = {l: torch.randn(shape.num_experts, shape.hidden, generator=g).to(shape.dtype)
                 for l in shape.layer_ids}
    manager = ExpertManager(shape, buf, residency, host, buffers, gates, "cpu")
    manager.upload_resident()
    return Rig(shape, pool, buf, ranking, residency, host, buffers, manager, w13, w2, gates)


def rows(table: torch.Tensor) -> dict[int, tuple[int, int, int]]:
    """Table rows pointing at pool pages, as {expert: pages} (not host pages, not -1)."""
    return {e: tuple(r) for e, r in enumerate(table.tolist()) if min(r) >= 0}


def host_row(expert: int) -> list[int]:
    """The home-table row of an offloaded expert: its host pages -2 - (3e + m)."""
    return [-2 - (3 * expert + m) for m in range(3)]


def page_holds(rig: Rig, page: int, layer: int, expert: int, m: int) -> bool:
    view = rig.buffer.expert_page_view(page, (rig.shape.matrix_elems,), rig.shape.dtype)
    return torch.equal(view, rig.host.matrix(layer, expert, m))
