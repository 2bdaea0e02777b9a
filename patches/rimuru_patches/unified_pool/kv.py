"""SGLang's KV allocator and KV buffers, drawn from the unified pool.

SGLang keeps calling ``alloc`` / ``free`` / ``available_size`` exactly as it
does on its own allocator; the radix cache's eviction frees through the same
``free``, so evicted prefixes go back to the pool. Page size 1 only: a KV
page is one token slot of every layer, and its id is the token index SGLang
writes into ``req_to_token`` (see ``sglang_rimuru/pool/README.md`` for the id
space, the holes, and why slot 0 is reserved).

Request affinity: SGLang's ``alloc(n)`` does not say whose slots it takes. The
``pool.kv_affinity_*`` seams (``affinity.py``) tell the allocator before each
prefill and decode allocation how the ``n`` slots split over requests and where
each request's KV ends, so the pool keeps every request in its own expert pages
(``UnifiedPagePool.alloc_kv_runs``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)

#: owner tag of the KV pages SGLang holds. One tag for all: affinity works on KV ids
#: (``near``), and the radix cache shares pages between requests and keeps them
#: after their request ends, so a per-request tag would be wrong for most pages.
KV_OWNER = "sglang_kv"

#: ``SGLANG_RIMURU_KV_TRACE=PATH``: one JSON line per allocation and free (bench/pool/)
TRACE_ENV = "SGLANG_RIMURU_KV_TRACE"


@dataclasses.dataclass(frozen=True)
class KVRuns:
    """How the next ``alloc(n)`` splits over requests, in ``out_cache_loc`` order.

    ``counts[i]`` slots go to request ``i``, whose KV ends at id ``near[i]``
    (``None``: none yet); ``tails`` are the last KV ids of live requests outside
    this allocation; ``kind`` names the step (``"extend"`` / ``"decode"``).
    """

    counts: list[int]
    near: list[int | None]
    tails: list[int]
    kind: str


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
        self._runs: KVRuns | None = None  # for the next alloc() only
        self._run_ends: list[int | None] | None = None  # last id of each run of the latest alloc()
        self._last_kv: dict[int, int] = {}  # req_to_token row -> last KV id, live requests (host side)
        self._trace = _KVTrace.from_env(runtime.page_pool)
        self.clear()

    def clear(self):
        self._last_kv.clear()
        if self._held:
            ids = sorted(self._held)
            self.runtime.page_pool.free_kv_pages(ids)
            self._held.clear()
            if self._trace:
                self._trace.write("clear", "f", ids)
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
        runs, self._runs = self._runs, None
        self._run_ends = None
        if need_size > self.available_size():
            return None
        pool = self.runtime.page_pool
        if runs is not None and sum(runs.counts) != need_size:
            runs = None  # not the allocation the seam announced (SGLang moved): plain order
        if runs is None:
            ids = pool.alloc_kv_pages(need_size, owner=KV_OWNER)
        else:
            ids = pool.alloc_kv_runs(runs.counts, runs.near, owner=KV_OWNER, tails=runs.tails)
        if ids is None:
            return None
        check_kv_ids_in_bounds(ids, self._kvcache)
        self._held.update(ids)
        if runs is not None:
            ends, at = [], 0
            for c in runs.counts:
                at += c
                ends.append(ids[at - 1] if c else None)
            self._run_ends = ends
        if self._trace:
            self._trace.write(runs.kind if runs else "plain", "a", ids)
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
        if self._trace:
            self._trace.write("free", "f", ids)

    # -- request affinity (called by the seams in affinity.py) -------------

    def expect_extend(self, extend_lens: list[int], near: list[int | None]) -> None:
        """The next ``alloc`` is a prefill batch: ``extend_lens[i]`` slots for request
        ``i``, whose KV so far ends at ``near[i]``; live requests' tails are kept clear."""
        self._runs = KVRuns(list(extend_lens), list(near), list(self._last_kv.values()), "extend")

    def expect_decode(self, rows: list[int], per_req: int) -> None:
        """The next ``alloc`` is a decode step of the requests in ``req_to_token`` rows
        ``rows`` (batch order), ``per_req`` slots each. The decode batch is every
        running request, so requests not in it have ended: they are forgotten."""
        last = self._last_kv
        self._last_kv = {r: last[r] for r in rows if r in last}
        self._runs = KVRuns([per_req] * len(rows), [last.get(r) for r in rows], [], "decode")

    def tail_shortfall(self) -> int:
        """KV slots the announced allocation would take from other requests' expert
        pages as the pool stands (``UnifiedPagePool.tail_shortfall``); 0 if none announced."""
        runs = self._runs
        if runs is None:
            return 0
        return self.runtime.page_pool.tail_shortfall(runs.counts, runs.near, runs.tails)

    def settle(self, rows: list[int] | None) -> None:
        """After the announced step: drop an unused announcement, and remember where
        each request's KV now ends (``rows``: the requests' ``req_to_token`` rows)."""
        self._runs = None
        ends, self._run_ends = self._run_ends, None
        if ends is None or rows is None:
            return
        for row, k in zip(rows, ends):
            if k is not None:
                self._last_kv[row] = k

    def merge_and_sort_free(self):
        pass  # the pool hands out the lowest free ids already

    def get_cpu_copy(self, indices, mamba_indices=None):
        return self._kvcache.get_cpu_copy(indices, mamba_indices=mamba_indices)

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices, mamba_indices=mamba_indices)


class _KVTrace:
    """``SGLANG_RIMURU_KV_TRACE``: a JSON line per allocation and free, for ``bench/pool/``.

    First line: the pool geometry and the KV ids held before SGLang's allocator
    existed. Then ``[seconds, step, op, ids, trapped, kv_split]``: ``op`` is ``a``
    (allocation; ``step`` ``extend`` / ``decode`` / ``plain``) or ``f`` (free);
    ``trapped`` and ``kv_split`` are the pool's counters after the event. TP rank
    ``r > 0`` writes ``PATH.tp<r>``.
    """

    def __init__(self, path: str, pool) -> None:
        self.pool = pool
        self.file = open(path, "a", buffering=1)
        g = pool.geometry
        held = [k for k in range(g.num_kv_page_ids) if pool.is_kv_page_allocated(k)]
        header = {"total_bytes": g.total_bytes, "expert_page_bytes": g.expert_page_bytes,
                  "kv_page_bytes": g.kv_page_bytes, "held_at_start": held, "pid": os.getpid()}
        self.file.write(json.dumps(header) + "\n")

    @classmethod
    def from_env(cls, pool) -> "_KVTrace | None":
        path = os.environ.get(TRACE_ENV)
        if not path:
            return None
        try:
            from sglang.srt.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # no model-parallel group (an allocator built in a test)
            rank = 0
        return cls(f"{path}.tp{rank}" if rank else path, pool)

    def write(self, step: str, op: str, ids: list[int]) -> None:
        s = self.pool.stats()
        self.file.write(json.dumps([round(time.monotonic(), 4), step, op, ids, s.trapped_kv_pages,
                                    s.kv_split_expert_pages]) + "\n")


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

        def _finalize_allocation_log(self, num_tokens: int):
            # SGLang's line counts this pool's size: the KV id space, i.e. the whole unified
            # pool as if it were all KV. Say right after it what KV really holds.
            super()._finalize_allocation_log(num_tokens)
            logger.info(kv_line_note(runtime, num_tokens))

    if not callable(getattr(MHATokenToKVPool, "_finalize_allocation_log", None)):
        raise RuntimeError("sglang-rimuru: MHATokenToKVPool._finalize_allocation_log is gone (SGLang moved); "
                           "the KV allocation line's correction has no hook (patches/README.md, pool.kv_buffers)")
    return PooledMHATokenToKVPool


def kv_line_note(runtime, id_space_tokens: int) -> str:
    """The line after SGLang's "KV Cache is allocated ... #tokens: N": N is the id space."""
    return (f"sglang-rimuru: the KV cache line above counts the unified pool's KV id space ({id_space_tokens} "
            f"token slots over {runtime.geometry.pool_bytes / 2**30:.3f} GiB shared with expert weights); "
            f"KV can hold {runtime.kv_tokens_now} tokens now, at most {runtime.kv_capacity_tokens}"
            + (" as experts are evicted" if runtime.config.mode == "elastic" else ""))
