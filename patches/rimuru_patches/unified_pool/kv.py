"""SGLang's KV allocator and KV buffers, drawn from the unified pool.

SGLang keeps calling ``alloc`` / ``free`` / ``available_size`` exactly as it
does on its own allocator; the radix cache's eviction frees through the same
``free``, so evicted prefixes go back to the pool. Page size 1 only: a KV
page is one token slot of every layer, and its id is the token index SGLang
writes into ``req_to_token`` (see ``sglang_rimuru/pool/README.md`` for the id
space, the holes, and why slot 0 is reserved).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

#: owner tag of the KV pages SGLang holds (the pool knows no requests here)
KV_OWNER = "sglang_kv"


class PooledTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """``TokenToKVPoolAllocator`` (page size 1) over the unified page pool.

    ``available_size`` is what the pool can give KV right now (free KV pages
    plus the KV pages of free expert and huge pages), capped so that SGLang
    never holds more than ``size`` = its ``max_total_num_tokens`` (a
    ``--max-total-tokens`` below the pool's capacity still holds): SGLang's
    idle leak check compares ``available + evictable`` against ``size``.
    """

    def __init__(self, size, dtype, device, kvcache, need_sort, runtime):
        super().__init__(size, 1, dtype, device, kvcache, need_sort)
        self.runtime = runtime
        self._held: set[int] = set()
        self.clear()

    def clear(self):
        if self._held:
            self.runtime.page_pool.free_kv_pages(sorted(self._held))
            self._held.clear()
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_pages = empty  # kept for SGLang code that reads it; the pool is the truth
        self.release_pages = empty
        self.is_not_in_free_group = True
        self.free_group = []

    @property
    def held_count(self) -> int:
        """KV slots SGLang holds (in requests or its radix cache)."""
        return len(self._held)

    def available_size(self):
        return min(self.runtime.page_pool.kv_capacity_now(), self.size - len(self._held))

    def alloc(self, need_size: int):
        if need_size > self.available_size():
            return None
        ids = self.runtime.page_pool.alloc_kv_pages(need_size, owner=KV_OWNER)
        if ids is None:
            return None
        check_kv_ids_in_bounds(ids, self._kvcache)
        self._held.update(ids)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        ids = free_index.tolist()
        self._held.difference_update(ids)
        self.runtime.page_pool.free_kv_pages(ids)

    def merge_and_sort_free(self):
        pass  # the pool hands out the lowest free ids already

    def get_cpu_copy(self, indices, mamba_indices=None):
        return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices)

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices)


def sglang_kv_pool_size(runtime) -> int:
    """``size`` of SGLang's KV pool over the unified pool: the whole KV id space.

    SGLang bounds every KV index by its KV pool's ``size + page_size`` (the JIT
    KV store asserts it on CUDA, ``SGLANG_ENABLE_ASYNC_ASSERT`` everywhere),
    while pool KV ids are byte offsets that run over the whole buffer. So the KV
    pool spans every id (its buffers are the views ``PoolBuffer.kv_views``
    makes, exactly ``size + page_size`` rows); admission does not follow it:
    the allocator's ``size`` (SGLang's ``max_total_num_tokens``) is what the
    pool can give KV. See ``sglang_rimuru/pool/README.md``.
    """
    return runtime.kv_id_limit - runtime.plan.page_size


class KVIdOutOfBounds(RuntimeError):
    """A KV id the pool handed out is outside SGLang's KV pool (its kernels would
    fault or, on CUDA, assert: ``store_cache``'s ``index < size + page_size``)."""


def check_kv_ids_in_bounds(ids, kvcache) -> None:
    """Every id handed to SGLang is below its KV pool's ``size + page_size``.

    Checked on every allocation (one ``max`` over ids already in a list): on CPU
    nothing in SGLang bounds the ids, so without this an id past the KV views
    would pass every CPU test and only crash on a GPU.
    """
    if kvcache is None:  # an allocator built without SGLang's pool (unit tests)
        return
    limit = kvcache.size + kvcache.page_size
    top = max(ids) if ids else -1
    if top >= limit or (ids and min(ids) < 0):
        raise KVIdOutOfBounds(
            f"sglang-rimuru: KV id {top if top >= limit else min(ids)} is outside SGLang's KV pool "
            f"[0, size + page_size = {limit})"
        )


def pooled_kv_pool_class(runtime) -> type:
    """``MHATokenToKVPool`` whose per-layer K/V buffers are views of the pool's bytes."""

    class PooledMHATokenToKVPool(MHATokenToKVPool):
        def _create_buffers_normal(self):
            if self.kv_cache_layout != "nhd" or self.v_head_dim != self.head_dim:
                raise RuntimeError(
                    f"--rimuru-mode needs SGLang's NHD KV layout with equal K/V head dims "
                    f"(got layout {self.kv_cache_layout}, head dims {self.head_dim}/{self.v_head_dim})"
                )
            views = runtime.buffer.kv_views(
                self.layer_num, self.head_num, self.head_dim, self.store_dtype, runtime.plan.page_size
            )
            if views.token_bytes != runtime.plan.token_bytes:
                raise RuntimeError(
                    f"KV token size {views.token_bytes} B differs from the pool plan's "
                    f"{runtime.plan.token_bytes} B (KV dtype or head count mismatch)"
                )
            rows = views.k[0].shape[0]
            if rows != self.size + self.page_size:
                raise RuntimeError(
                    f"SGLang's KV pool has size + page_size = {self.size + self.page_size} slots, the pool's "
                    f"KV views {rows}: every KV id must be inside both (unified_pool/__init__.py)"
                )
            self.k_buffer, self.v_buffer = views.k, views.v

    return PooledMHATokenToKVPool
