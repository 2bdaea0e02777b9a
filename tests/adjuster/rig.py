"""A small residency on a real pool for the adjuster tests (CPU, no tensors touched).

E=8 experts, I=4, H=8, bf16: one expert matrix = 64 B = one expert page (= one
huge page: no SSM).  KV page 32 B: exactly 2 KV pages per expert page, so R_b
is exact.  MoE layers (0, 1, 2), offload limit 4, 6 resident per layer.

Ranking (probabilities follow ``order``)::

    layer 0  order 3    1    4    0    5    2  | 7    6
             prob  .30  .20  .15  .10  .08  .06| .04  .02
    layer 1  order 7    6    5    4    3    2  | 1    0
             prob  .40  .20  .10  .09  .07  .06| .02  .01
    layer 2  order 0..7, every probability .125

(``|``: the resident prefix after ``place_initial(6)``.)  Placement on a fresh
pool, lowest pages first::

    layer 0  3:(0,1,2)    1:(3,4,5)    4:(6,7,8)    0:(9,10,11)  5:(12,13,14) 2:(15,16,17)
    layer 1  7:(18,19,20) 6:(21,22,23) 5:(24,25,26) 4:(27,28,29) 3:(30,31,32) 2:(33,34,35)
    layer 2  0:(36,37,38) 1:(39,40,41) ...                                    5:(51,52,53)
    free     54 ..

``rig.residency`` is the scheduler side's (the adjuster's view).
``make_worker(rig)`` adds the TP worker's side as ``RimuruRuntime.build``
does, from plain page ids and never from the scheduler's objects: the two
load buffers (``2 * limit * 3`` pages, taken from the pool next: 54..77 with
the default limit 4), the worker's own ``ExpertResidency`` built from
``rig.residency.placement()``, a CPU ``PoolBuffer``, a ``HostExpertStore``
with seeded random weights and an ``ExpertManager`` that has copied every
resident expert into its pages.  With ``make_rig(pages=84)`` the free pages
are 78..83, the same F_b = 6 as ``make_rig(pages=60)`` without a worker.
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

ORDERS = {0: [3, 1, 4, 0, 5, 2, 7, 6], 1: [7, 6, 5, 4, 3, 2, 1, 0], 2: list(range(8))}
PROBS = {
    0: [0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02],
    1: [0.40, 0.20, 0.10, 0.09, 0.07, 0.06, 0.02, 0.01],
    2: [0.125] * 8,
}
EXPERT_PAGE = 64
KV_PAGE = 32
PLACED_PAGES = 54  # 3 layers * 6 experts * 3 pages


@dataclass
class Rig:
    shape: MoEShape
    pool: UnifiedPagePool
    ranking: ExpertRanking
    residency: ExpertResidency


def make_rig(pages: int = 60, limit: int = 4, resident: int = 6) -> Rig:
    shape = MoEShape(layer_ids=(0, 1, 2), num_experts=8, hidden=8, inter=4, top_k=2,
                     dtype=torch.bfloat16)
    assert shape.expert_page_bytes == EXPERT_PAGE
    geo = PoolGeometry(total_bytes=pages * EXPERT_PAGE, expert_page_bytes=EXPERT_PAGE,
                       kv_page_bytes=KV_PAGE)
    pool = UnifiedPagePool(geo)
    ranking = ExpertRanking(8, ORDERS, PROBS)
    residency = ExpertResidency(shape, ranking, limit)
    residency.place_initial(pool, resident)
    return Rig(shape, pool, ranking, residency)


@dataclass
class Worker:
    buffer: PoolBuffer
    host: HostExpertStore
    buffers: LoadBuffers
    residency: ExpertResidency  # the worker's own: the residency as applied
    manager: ExpertManager


def make_worker(rig: Rig, seed: int = 0) -> Worker:
    shape = rig.shape
    taken = LoadBuffers(shape, rig.pool, rig.residency.offload_limit)  # the pool's owner takes them
    buffers = LoadBuffers.of_pages(shape, taken.slots, taken.all_pages())
    residency = ExpertResidency(shape, rig.ranking, rig.residency.offload_limit,
                                resident=rig.residency.placement())
    buffer = PoolBuffer(rig.pool.geometry, "cpu", zero=True)
    host = HostExpertStore(shape, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    for l in shape.layer_ids:
        e, i, h = shape.num_experts, shape.inter, shape.hidden
        host.put_fused(l, torch.randn(e, 2 * i, h, generator=g).to(shape.dtype),
                       torch.randn(e, h, i, generator=g).to(shape.dtype))
    manager = ExpertManager(shape, buffer, residency, host, buffers, None, "cpu")
    manager.upload_resident()
    return Worker(buffer, host, buffers, residency, manager)


def expert_page_holds(rig: Rig, worker: Worker, page: int, layer: int, expert: int, m: int) -> bool:
    """Pool page ``page`` holds matrix ``m`` (0 W1, 1 W3, 2 W2) of the expert, as in the host store."""
    view = worker.buffer.expert_page_view(page, (rig.shape.matrix_elems,), rig.shape.dtype)
    return torch.equal(view, worker.host.matrix(layer, expert, m))
