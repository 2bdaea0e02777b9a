"""Run in a child process (SGLang with the CPU stand-in): SGLang's KV pool and the
pooled allocator over a unified pool at the real byte geometry of
Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B.

For each shape: a pool of ~60 expert pages holding the dummy slot, load
buffers and some resident experts; SGLang's ``MHATokenToKVPool`` built as the
``pool.kv_buffers`` seam builds it (``sglang_kv_pool_size``); the allocator
drained in request-sized chunks. Every id must be below SGLang's
``size + page_size``, and SGLang's own ``set_kv_buffer`` (with its range
assert on, ``SGLANG_ENABLE_ASYNC_ASSERT=1``) writes every K/V row; the rows
read back through the pool's views, and no resident expert's bytes change
(holes between expert pages are never handed out).

Prints one line per shape, then ``OK``.
"""

import dataclasses
import os
import types

os.environ["SGLANG_ENABLE_ASYNC_ASSERT"] = "1"

import torch  # noqa: E402

from rimuru_patches.bootstrap import bootstrap_process  # noqa: E402
from rimuru_patches.context import ProcessContext  # noqa: E402

bootstrap_process(ProcessContext(device="cpu"))

from rimuru_patches.unified_pool.kv import (  # noqa: E402
    PooledTokenToKVPoolAllocator,
    pooled_kv_pool_class,
    sglang_kv_pool_size,
)
from sglang_rimuru.config import RimuruConfig  # noqa: E402
from sglang_rimuru.experts import ExpertRanking, ExpertResidency, LoadBuffers  # noqa: E402
from sglang_rimuru.models.specs import MODELS, build_config  # noqa: E402
from sglang_rimuru.plan import ModelFacts, plan_pool  # noqa: E402
from sglang_rimuru.pool import PoolBuffer, PoolGeometry, UnifiedPagePool  # noqa: E402

PAGES = 60


class Runtime(types.SimpleNamespace):
    """The parts of ``RimuruRuntime`` the KV seams read (same property formula)."""

    @property
    def kv_id_limit(self):
        return self.geometry.num_kv_page_ids * self.plan.page_size

    @property
    def kv_tokens_now(self):
        return self.page_pool.kv_capacity_now() * self.plan.page_size

    @property
    def kv_capacity_tokens(self):  # static mode's: what the pool gives KV now
        return self.kv_tokens_now


def check(name: str, resident: int, limit: int) -> None:
    hf = build_config(MODELS[name]).to_dict()
    facts = ModelFacts.from_config(hf)
    plan = plan_pool(facts, RimuruConfig(mode="static", resident_experts=resident, expert_offload_limit=limit))
    geometry = PoolGeometry(total_bytes=PAGES * plan.expert_page_bytes, expert_page_bytes=plan.expert_page_bytes,
                            kv_page_bytes=plan.kv_page_bytes)
    pool = UnifiedPagePool(geometry)
    assert pool.alloc_kv_pages(1, owner="sglang_dummy_slot") == [0]
    buffer = PoolBuffer(geometry, "cpu")
    shape = facts.moe_shape()
    # one layer's residents are enough to put expert pages between KV pages
    one_layer = dataclasses.replace(shape, layer_ids=shape.layer_ids[:1])
    residency = ExpertResidency(one_layer, ExpertRanking.default(one_layer), limit)
    LoadBuffers(one_layer, pool, slots=1)
    residency.place_initial(pool, resident)
    expert_pages = sorted(p for pages in residency.resident_pages(one_layer.layer_ids[0]).values() for p in pages)
    g = torch.Generator().manual_seed(0)
    for p in expert_pages:
        view = buffer.expert_page_view(p, (shape.matrix_elems,), torch.bfloat16)
        view.copy_(torch.randn(shape.matrix_elems, generator=g).to(torch.bfloat16))
    before = {p: buffer.expert_page_view(p, (shape.matrix_elems,), torch.bfloat16).clone() for p in expert_pages}

    runtime = Runtime(geometry=geometry, plan=plan, buffer=buffer, page_pool=pool, config=types.SimpleNamespace(mode="static"))
    kv_heads, head_dim = facts.num_kv_heads, facts.head_dim
    kv = pooled_kv_pool_class(runtime)(
        sglang_kv_pool_size(runtime), page_size=1, dtype=torch.bfloat16, head_num=kv_heads, head_dim=head_dim,
        layer_num=facts.num_layers, device="cpu", enable_memory_saver=False,
    )
    capacity = pool.kv_capacity_now()
    alloc = PooledTokenToKVPoolAllocator(capacity, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                         need_sort=False, runtime=runtime)
    bound = kv.size + kv.page_size
    assert bound == geometry.num_kv_page_ids, (bound, geometry.num_kv_page_ids)
    held, top = 0, -1
    while True:
        loc = alloc.alloc(min(777, alloc.available_size()))  # request-sized, not page-aligned
        if loc is None or loc.numel() == 0:
            break
        ids = loc.tolist()
        assert max(ids) < bound and min(ids) > 0, (name, min(ids), max(ids), bound)
        top = max(top, max(ids))
        for layer in range(facts.num_layers):
            k = torch.full((len(ids), kv_heads, head_dim), float(layer + 1), dtype=torch.bfloat16)
            v = torch.full((len(ids), kv_heads, head_dim), float(-layer - 1), dtype=torch.bfloat16)
            kv.set_kv_buffer(None, loc, k, v, layer_id_override=layer)
            assert bool((kv.get_key_buffer(layer)[loc] == layer + 1).all())
            assert bool((kv.get_value_buffer(layer)[loc] == -layer - 1).all())
        held += len(ids)
    assert held == capacity, (held, capacity)
    for p, want in before.items():
        assert torch.equal(buffer.expert_page_view(p, (shape.matrix_elems,), torch.bfloat16), want), p
    print(f"{name}: {PAGES} expert pages of {geometry.expert_page_bytes} B, KV token {plan.token_bytes} B, "
          f"{geometry.num_kv_holes} holes; {held} KV slots written, top id {top} < size + page_size = {bound}")


check("qwen1.5-moe-a2.7b", resident=10, limit=50)
check("qwen3-30b-a3b", resident=8, limit=120)
print("OK")
