"""Run in a child process (it imports SGLang with the CPU stand-in): SGLang's own
RadixCache over the pooled allocator, with exact KV page ids and pool state.

Geometry: 8 expert pages of 4096 B, KV pages of 1024 B (4 per expert page).
KV id 0 (SGLang's dummy slot) is reserved first, so expert page 0 is split;
expert pages 1..2 hold one expert's W1/W3 and are not KV.
"""

import types

import torch

from rimuru_patches.bootstrap import bootstrap_process
from rimuru_patches.context import ProcessContext

bootstrap_process(ProcessContext(device="cpu"))

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator  # noqa: E402
from sglang_rimuru.pool import ExpertKey, PoolGeometry, UnifiedPagePool  # noqa: E402

pool = UnifiedPagePool(PoolGeometry(total_bytes=8 * 4096, expert_page_bytes=4096, kv_page_bytes=1024))
assert pool.alloc_kv_pages(1, owner="dummy") == [0]
experts = pool.alloc_expert_pages(2, [ExpertKey(0, 0, "w1"), ExpertKey(0, 0, "w3")])
assert experts == [1, 2], experts
capacity0 = pool.kv_capacity_now()
assert capacity0 == 3 + 5 * 4, capacity0  # 3 left in page 0, 5 free expert pages

alloc = PooledTokenToKVPoolAllocator(
    capacity0, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False,
    runtime=types.SimpleNamespace(page_pool=pool),
)
cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1))

# A 6-token request: 3 trapped slots of expert page 0, then a split of expert page 3.
a = alloc.alloc(6)
assert a.tolist() == [1, 2, 3, 12, 13, 14], a.tolist()
assert alloc.available_size() == capacity0 - 6
cache.insert(InsertParams(key=RadixKey(torch.arange(100, 106).tolist()), value=a))

# Prefix reuse: a second request shares 4 tokens and gets the same KV pages.
match = cache.match_prefix(MatchPrefixParams(key=RadixKey([100, 101, 102, 103, 7, 8])))
assert match.device_indices.tolist() == [1, 2, 3, 12], match.device_indices.tolist()

# Lock the shared prefix: eviction may only take the unshared tail (2 tokens).
cache.inc_lock_ref(match.last_device_node)
cache.evict(EvictParams(num_tokens=6))
assert alloc.available_size() == capacity0 - 4
assert not pool.is_kv_page_allocated(13) and not pool.is_kv_page_allocated(14)

# Unlock: everything goes back; expert page 3 merges back into a whole expert page.
cache.dec_lock_ref(match.last_device_node)
cache.evict(EvictParams(num_tokens=6))
assert alloc.available_size() == capacity0
assert pool.free_expert_page_count() == 5, pool.free_expert_page_count()
pool.check_invariants()

# clear() (SGLang's flush_cache) returns whatever the allocator still holds.
b = alloc.alloc(5)
alloc.clear()
assert alloc.available_size() == capacity0 and pool.kv_capacity_now() == capacity0
# The allocator never hands out more than SGLang's max_total_num_tokens.
small = PooledTokenToKVPoolAllocator(4, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False,
                                     runtime=types.SimpleNamespace(page_pool=pool))
assert small.available_size() == 4 and small.alloc(5) is None and small.alloc(4).numel() == 4
print("OK")
