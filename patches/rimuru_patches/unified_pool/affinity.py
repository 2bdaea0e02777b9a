"""Request affinity: each request's KV slots come from its own expert pages.

SGLang's ``alloc_for_extend`` / ``alloc_for_decode`` (``mem_cache/allocation.py``,
called by name from ``managers/schedule_batch.py``) take one ``alloc(n)`` for a
whole batch at page size 1, with no word of whose slots they are. The wrappers
here run around them and tell the pooled allocator first how the ``n`` slots
split over the batch's requests (``out_cache_loc`` is request-major: request 0's
slots, then request 1's) and where each request's KV ends:

* prefill: ``extend_lens`` and the last id of each request's ``prefix_indices``
  (its earlier chunks, or a radix-cache prefix); one device-to-host copy per
  prefill batch, and none when no request has a prefix;
* decode: one slot per request; where each request's KV ends is the
  allocator's host record of the ids it handed out (``_last_kv``, by
  ``req_to_token`` row), so the decode path reads nothing from the device.

When a step needs more KV slots than the pool has outside the live requests'
expert pages (in free expert pages and in partly used pages nobody is writing
into), SGLang may still not evict: the free slots it counts include the
unfilled ends of those pages, and the batch would fill them with other
requests' KV. So before the step, the
wrappers evict that shortfall from SGLang's radix cache (least recently used
first, as SGLang's own ``evict_from_tree_cache`` does when short): in a full
pool those entries are the next SGLang evicts anyway, a few steps earlier.

The allocator falls back to its plain order when the allocation it sees is not
the one announced (a count that does not match), so an SGLang that allocates
differently loses affinity but keeps working. The hint never changes which ids
SGLang writes where: SGLang still writes ``out_cache_loc`` into ``req_to_token``.

``SGLANG_RIMURU_KV_AFFINITY=0`` leaves these seams out (the plain order, for A/B
runs: ``bench/pool/affinity_sharegpt.py``).
"""

from __future__ import annotations

import os

ENV_VAR = "SGLANG_RIMURU_KV_AFFINITY"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def prefix_ends(reqs) -> list[int | None]:
    """Each request's last KV id before this prefill (``None``: no prefix)."""
    import torch

    near: list[int | None] = [None] * len(reqs)
    with_prefix = [i for i, r in enumerate(reqs) if len(r.prefix_indices)]
    if with_prefix:
        last = torch.cat([reqs[i].prefix_indices[-1:] for i in with_prefix]).tolist()  # one copy
        for i, k in zip(with_prefix, last):
            near[i] = int(k)
    return near


def make_room(batch, alloc) -> None:
    """Evict from the radix cache what the announced step would otherwise take from
    other requests' expert pages (nothing when the cache holds nothing evictable)."""
    short = alloc.tail_shortfall()
    if short and batch.tree_cache is not None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        batch.tree_cache.evict(EvictParams(num_tokens=short))


def wrap_alloc_for_extend(orig, ctx):
    from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator

    def alloc_for_extend(batch):
        alloc = batch.token_to_kv_pool_allocator
        if not isinstance(alloc, PooledTokenToKVPoolAllocator):
            return orig(batch)
        alloc.expect_extend(list(batch.extend_lens), prefix_ends(batch.reqs))
        rows = None
        try:
            make_room(batch, alloc)
            result = orig(batch)
            rows = [r.req_pool_idx for r in batch.reqs]  # assigned inside orig for new requests
            return result
        finally:
            alloc.settle(rows)

    return alloc_for_extend


def wrap_alloc_for_decode(orig, ctx):
    from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator

    def alloc_for_decode(batch, token_per_req):
        alloc = batch.token_to_kv_pool_allocator
        if not isinstance(alloc, PooledTokenToKVPoolAllocator):
            return orig(batch, token_per_req)
        rows = [r.req_pool_idx for r in batch.reqs]
        alloc.expect_decode(rows, token_per_req)
        done = False
        try:
            make_room(batch, alloc)
            result = orig(batch, token_per_req)
            done = True
            return result
        finally:
            alloc.settle(rows if done else None)

    return alloc_for_decode
