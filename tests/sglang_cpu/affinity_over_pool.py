"""Run in a child process (it imports SGLang with the CPU stand-in): SGLang's own
``alloc_for_extend`` / ``alloc_for_decode``, as ``schedule_batch`` calls them
(with the ``pool.kv_affinity_*`` seams installed), over the pooled allocator and
SGLang's ReqToTokenPool and RadixCache: two interleaved requests each get KV
pages in their own expert pages, with exact ids.

Geometry: 8 expert pages of 4096 B, KV pages of 1024 B (4 per expert page:
page j holds KV ids 4j..4j+3). KV id 0 (SGLang's dummy slot) is reserved first.
The batch is a stand-in with the fields those two functions read; the requests
are stand-ins with the fields ReqToTokenPool.alloc reads.
"""

import types

import torch

from rimuru_patches.bootstrap import bootstrap_process
from rimuru_patches.context import ProcessContext

bootstrap_process(ProcessContext(device="cpu", rimuru={"mode": "static"}))

import sglang.srt.managers.schedule_batch as schedule_batch  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402

from rimuru_patches import seams  # noqa: E402
from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator  # noqa: E402
from sglang_rimuru.pool import PoolGeometry, UnifiedPagePool  # noqa: E402

# The seams wrap the names schedule_batch calls; SGLang's own functions stay underneath.
assert "pool.kv_affinity_extend" in seams.installed() and "pool.kv_affinity_decode" in seams.installed()
assert schedule_batch.alloc_for_extend is not allocation.alloc_for_extend
assert seams.original("pool.kv_affinity_decode") is allocation.alloc_for_decode

get_context().override_server_args(attention_backend="torch_native").install()  # write_cache_indices' torch path

EXPERT = 4  # KV pages per expert page


def setup():
    pool = UnifiedPagePool(PoolGeometry(total_bytes=8 * 4096, expert_page_bytes=4096, kv_page_bytes=1024))
    assert pool.alloc_kv_pages(1, owner="dummy") == [0]
    alloc = PooledTokenToKVPoolAllocator(pool.kv_capacity_now(), dtype=torch.bfloat16, device="cpu", kvcache=None,
                                         need_sort=False, runtime=types.SimpleNamespace(page_pool=pool))
    r2t = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                       page_size=1))
    return pool, alloc, r2t, cache


def request():
    return types.SimpleNamespace(req_pool_idx=None, prefix_indices=torch.empty((0,), dtype=torch.int64), kv=None,
                                 inflight_middle_chunks=0, kv_committed_len=0)


def batch(reqs, alloc, r2t, cache, seq_lens, extend_lens=None):
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    b = types.SimpleNamespace(
        reqs=reqs, device="cpu", req_to_token_pool=r2t, tree_cache=cache, token_to_kv_pool_allocator=alloc,
        model_config=types.SimpleNamespace(is_encoder_decoder=False), seq_lens=seq, seq_lens_cpu=seq,
        maybe_evict_swa=lambda: None, is_dllm=lambda: False,
    )
    if extend_lens is not None:  # a prefill batch, as prepare_for_extend sets it up
        b.prefix_lens = [len(r.prefix_indices) for r in reqs]
        b.extend_lens = extend_lens
        b.extend_num_tokens = sum(extend_lens)
    else:  # a decode batch
        b.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    return b


def kv_of(r2t, req, n):
    return r2t.req_to_token[req.req_pool_idx, :n].tolist()


def serve(extend, decode, steps=3):
    """Prefill a and b (3 tokens each) in one batch, then ``steps`` decode steps together."""
    pool, alloc, r2t, cache = setup()
    a, b = request(), request()
    out, _, _ = extend(batch([a, b], alloc, r2t, cache, [3, 3], extend_lens=[3, 3]))
    n = 3
    for _ in range(steps):
        decode(batch([a, b], alloc, r2t, cache, [n, n]), 1)
        n += 1
        if extend is schedule_batch.alloc_for_extend:  # the allocator's host record is req_to_token's last id
            assert alloc._last_kv == {r.req_pool_idx: kv_of(r2t, r, n)[-1] for r in (a, b)}, alloc._last_kv
    return pool, alloc, r2t, a, b, n


# -- with the seams: each request in its own expert pages ---------------------------------
pool, alloc, r2t, a, b, n = serve(schedule_batch.alloc_for_extend, schedule_batch.alloc_for_decode)
ka, kb = kv_of(r2t, a, n), kv_of(r2t, b, n)
# a: the rest of the dummy's page 0, then a fresh page 2; b: page 1, then page 3
assert ka == [1, 2, 3, 8, 9, 10], ka
assert kb == [4, 5, 6, 7, 12, 13], kb
pages = lambda ids: sorted({k // EXPERT for k in ids})  # noqa: E731
assert pages(ka) == [0, 2] and pages(kb) == [1, 3]
# a ends: its own expert page is whole again at once; b's pages are untouched
free_before = pool.free_expert_page_count()
alloc.free(torch.tensor(ka))
assert pool.free_expert_page_count() == free_before + 1
assert pool.stats().trapped_kv_pages == 3 + 2  # dummy's page 0 (3 free) and b's room in page 3
pool.check_invariants()

# -- SGLang's own functions (the plain order, before affinity): interleaved -----------------
pool, alloc, r2t, a, b, n = serve(allocation.alloc_for_extend, allocation.alloc_for_decode)
ka, kb = kv_of(r2t, a, n), kv_of(r2t, b, n)
assert ka == [1, 2, 3, 7, 9, 11] and kb == [4, 5, 6, 8, 10, 12], (ka, kb)
free_before = pool.free_expert_page_count()
alloc.free(torch.tensor(ka))
assert pool.free_expert_page_count() == free_before  # every page of a still holds some of b

# -- a chunked prefill continues in its own page; a new request does not take that room ----
pool, alloc, r2t, cache = setup()
c = request()
schedule_batch.alloc_for_extend(batch([c], alloc, r2t, cache, [2], extend_lens=[2]))
c.prefix_indices = torch.tensor(kv_of(r2t, c, 2))  # what cache_unfinished_req leaves after chunk 1
c.kv_committed_len = 2
d = request()
schedule_batch.alloc_for_extend(batch([d, c], alloc, r2t, cache, [2, 4], extend_lens=[2, 2]))
assert kv_of(r2t, d, 2) == [4, 5], kv_of(r2t, d, 2)  # not c's room in page 0: a fresh page
assert kv_of(r2t, c, 4) == [1, 2, 3, 8], kv_of(r2t, c, 4)  # page 0 (after the dummy), then not d's room
e = request()  # alone in a later prefill: c's and d's rooms are tails (the allocator's record)
schedule_batch.alloc_for_extend(batch([e], alloc, r2t, cache, [1], extend_lens=[1]))
assert kv_of(r2t, e, 1) == [12], kv_of(r2t, e, 1)
pool.check_invariants()

# -- a full pool: a request that needs a new page gets an evicted cache entry's page ----------
# SGLang would not evict here (b's room covers the step), and a would go into b's page.
pool, alloc, r2t, cache = setup()
assert pool.alloc_expert_pages(5, [f"expert{i}" for i in range(5)]) == [1, 2, 3, 4, 5]
x = alloc.alloc(3)  # a finished request's KV, cached and unlocked
assert x.tolist() == [1, 2, 3]
cache.insert(InsertParams(key=RadixKey([7, 8, 9]), value=x))
a, b = request(), request()
schedule_batch.alloc_for_extend(batch([a, b], alloc, r2t, cache, [3, 1], extend_lens=[3, 1]))
assert kv_of(r2t, a, 3) == [24, 25, 26] and kv_of(r2t, b, 1) == [28]  # pages 6 and 7, no page free
schedule_batch.alloc_for_decode(batch([a, b], alloc, r2t, cache, [3, 1]), 1)
assert alloc.available_size() == 2 and cache.evictable_size() == 3  # b's room: 30, 31
schedule_batch.alloc_for_decode(batch([a, b], alloc, r2t, cache, [4, 2]), 1)
assert kv_of(r2t, a, 5) == [24, 25, 26, 27, 1], kv_of(r2t, a, 5)  # the evicted entry's page 0
assert kv_of(r2t, b, 3) == [28, 29, 30], kv_of(r2t, b, 3)
assert cache.evictable_size() == 0
pool.check_invariants()
print("OK")
