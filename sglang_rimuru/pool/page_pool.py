"""``UnifiedPagePool``: ownership bookkeeping of the three page levels.

No tensors here; ``PoolBuffer`` holds the bytes.  Every decision is
deterministic: among equal candidates the lowest id wins, so tests can assert
exact page ids.

State map (``H``: huge pages, ``M``: expert (middle) pages, ``K``: KV ids)::

    huge h      WHOLE        -> h in _free_huge; none of its children tracked
                SPLIT_EXPERT -> children j in exactly one of
                                  _free_mid (free), _mid_owner (owned), _mid_kv (split)
                SPLIT_SSM    -> children s in exactly one of _free_ssm, _ssm_owner
                _huge_used[h] == children not free (> 0 while split; 0 merges)
    middle j in _mid_kv      -> its KV ids are in exactly one of
                                  _mid_kv[j].free (heap) or _kv_owner
                                _mid_kv[j].used == owned KV ids (> 0; 0 merges)
                                j in _trapped  <=>  _mid_kv[j].free non-empty
                                (between calls: alloc_kv_runs holds tails aside)
    KV id k                  -> owned only if its expert page is in _mid_kv; holes never

Complexity: every free set is a ``_MinIdSet`` (binary heap with lazy
deletion), so taking or returning one KV page is O(log n) plus, when a page is
split or merged, O(pages per parent) -- bounded by ``E/K`` or ``H/E``, not by
the pool size.  SGLang calls ``alloc_kv_pages`` every decode step on pools of
~100k pages; no path scans the pool except ``check_invariants`` (tests only).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

from .geometry import PoolGeometry
from .owners import ExpertKey
from .stats import PoolStats

__all__ = ["UnifiedPagePool"]

_WHOLE, _SPLIT_EXPERT, _SPLIT_SSM = 0, 1, 2


class _MinIdSet:
    """A set of ints with O(log n) ``min``/``pop_min``; deletion is lazy.

    ``_live`` is the set; ``_heap`` holds every live id plus stale ones;
    ``_queued`` mirrors the heap's contents so an id is never queued twice
    (heap size <= universe size).
    """

    __slots__ = ("_live", "_heap", "_queued")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._live: set[int] = set(ids)
        self._heap: list[int] = sorted(self._live)
        self._queued: set[int] = set(self._live)

    def add(self, i: int) -> None:
        self._live.add(i)
        if i not in self._queued:
            heapq.heappush(self._heap, i)
            self._queued.add(i)

    def discard(self, i: int) -> None:
        self._live.discard(i)

    def min(self) -> int | None:
        heap, live = self._heap, self._live
        while heap and heap[0] not in live:
            self._queued.discard(heapq.heappop(heap))
        return heap[0] if heap else None

    def pop_min(self) -> int:
        i = self.min()
        if i is None:
            raise IndexError("pop_min from an empty _MinIdSet")
        heapq.heappop(self._heap)
        self._queued.discard(i)
        self._live.discard(i)
        return i

    def __contains__(self, i: object) -> bool:
        return i in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def _check(self, what: str) -> None:
        assert self._live <= self._queued, f"{what}: live ids missing from the heap"
        assert self._queued == set(self._heap), f"{what}: heap and queued set disagree"
        assert len(self._heap) == len(self._queued), f"{what}: id queued twice"


class _KVSplit:
    """An expert page split into KV pages: a heap of its free KV ids and a used count."""

    __slots__ = ("free", "used")

    def __init__(self, kv_ids: range) -> None:
        self.free: list[int] = list(kv_ids)  # sorted == valid heap
        self.used = 0


class UnifiedPagePool:
    """Ownership of huge, expert (middle), SSM (middle) and KV (small) pages.

    Contract:
      * allocation calls are all-or-nothing: they return ``None`` and change
        nothing when the request cannot be met;
      * free calls validate every id first and raise ``ValueError`` (changing
        nothing) on an id that is not currently owned at that level or repeats;
      * a huge page is split only into expert pages or only into SSM pages, and
        never straight into KV pages; KV pages come from split expert pages;
      * release merges bottom-up at once: an expert page whose KV pages are all
        free is a free expert page again; a huge page whose children are all
        free is whole again.
    """

    def __init__(self, geometry: PoolGeometry) -> None:
        self.geometry = geometry
        g = geometry
        self._epH = g.expert_pages_per_huge_page
        self._spH = g.ssm_pages_per_huge_page
        # huge level
        self._huge_state = bytearray(g.num_huge_pages)  # all _WHOLE
        self._huge_used = [0] * g.num_huge_pages
        self._free_huge = _MinIdSet(range(g.num_huge_pages))
        self._n_ssm_split = 0
        # middle level
        self._free_mid = _MinIdSet()  # free expert pages inside SPLIT_EXPERT huge pages
        self._mid_owner: dict[int, Hashable] = {}
        self._n_expert_owned = 0  # owners that are ExpertKey
        self._mid_kv: dict[int, _KVSplit] = {}
        self._free_ssm = _MinIdSet()
        self._ssm_owner: dict[int, Hashable] = {}
        # small level
        self._kv_owner: dict[int, Hashable] = {}
        self._trapped = _MinIdSet()  # expert pages in _mid_kv with a free KV page
        self._n_trapped = 0  # free KV pages inside split expert pages
        # sum of len(kv_pages_of_expert_page(j)) over free expert pages j (F_b),
        # including those of whole huge pages
        self._free_kv_capacity = g.num_usable_kv_pages

    # ================================================================ expert pages

    def alloc_expert_pages(self, n: int, owners: Sequence[Hashable]) -> list[int] | None:
        """Take ``n`` whole expert pages, page ``i`` owned by ``owners[i]``.

        Order: the lowest free expert page inside an already split huge page,
        else split the lowest whole huge page.  Never takes an expert page that
        is split into KV pages.  Returns the ids in ``owners`` order, or ``None``.
        """
        owners = list(owners)
        if n < 0 or len(owners) != n:
            raise ValueError(f"need n >= 0 and len(owners) == n, got n={n}, {len(owners)} owners")
        if n > self.free_expert_page_count():
            return None
        out = []
        for owner in owners:
            j = self._take_free_mid()
            self._mid_owner[j] = owner
            self._n_expert_owned += isinstance(owner, ExpertKey)
            out.append(j)
        return out

    def free_expert_pages(self, ids: Iterable[int]) -> None:
        """Return whole expert pages; a huge page whose children are all free merges."""
        ids = self._validated(ids, self._mid_owner, "expert page")
        for j in ids:
            owner = self._mid_owner.pop(j)
            self._n_expert_owned -= isinstance(owner, ExpertKey)
            self._release_mid(j)

    def expert_page_owner(self, j: int) -> Hashable:
        """Owner of expert page ``j``; ``KeyError`` if it is not owned as a whole page."""
        return self._mid_owner[j]

    def expert_page_owners(self) -> Mapping[int, Hashable]:
        """Read-only live map of owned expert pages to their owners."""
        return MappingProxyType(self._mid_owner)

    def free_expert_page_count(self) -> int:
        """F_b: whole free expert pages, including those of whole huge pages."""
        return len(self._free_mid) + len(self._free_huge) * self._epH

    # ================================================================ KV pages

    def alloc_kv_pages(
        self, n: int, owner: Hashable = None, near: int | None = None
    ) -> list[int] | None:
        """Take ``n`` KV pages for one request: :meth:`alloc_kv_runs` with one run."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self.alloc_kv_runs([n], [near], owner)

    def alloc_kv_runs(
        self,
        counts: Sequence[int],
        near: Sequence[int | None] | None = None,
        owner: Hashable = None,
        tails: Iterable[int] = (),
    ) -> list[int] | None:
        """Take KV pages for several requests at once (one prefill batch, one decode step).

        Run ``i`` is ``counts[i]`` pages for a request whose last KV id is
        ``near[i]`` (``None``: it holds none yet); the ids come back run after
        run, each run in allocation order, or ``None`` (nothing taken) when the
        total exceeds :meth:`kv_capacity_now`.

        A *tail* is an expert page a live request continues in: the page of any
        ``near[i]`` or ``tails`` id (the last KV ids of requests not in this
        call), and the page where an earlier run of this call stopped with room
        left.  Per page of run ``i``, in order:
          1. a free KV page in the expert page the run is in (at first ``near[i]``'s);
          2. the lowest partially used expert page that is no tail (a hole that
             no request is filling);
          3. split the lowest free expert page (those in split huge pages first),
             else the lowest whole huge page into expert pages and its first
             expert page into KV pages;
          4. the lowest tail, only when no expert page is free.
        So a request fills its own expert page before it starts another, and
        requests share an expert page only where the pool would otherwise have
        to leave it partly empty.  Lowest id first within a page.  Cost: O(log n)
        per page, run and tail, plus O(E/K) or O(H/E) for a split.
        """
        counts, near_mid, tail_ids = self._runs_args(counts, near, tails)
        total = sum(counts)
        if total == 0:
            return []
        if total > self.kv_capacity_now():
            return None
        # Tails leave _trapped for this call (so step 2 cannot pick them) and come back at the end.
        claimed = _MinIdSet()
        for j in (*near_mid, *tail_ids):
            if j is not None and j in self._trapped:
                self._trapped.discard(j)
                claimed.add(j)
        out: list[int] = []
        try:
            for count, j in zip(counts, near_mid):
                left = count
                while left:
                    if j is None or not self._has_free_kv(j):
                        j = self._trapped.min()
                        if j is None:
                            j = self._split_mid_into_kv() if self.free_expert_page_count() else claimed.min()
                    left -= self._take_kv(j, left, owner, out)
                    if not self._has_free_kv(j):
                        claimed.discard(j)
                if count and self._has_free_kv(j):  # this run's request continues here
                    self._trapped.discard(j)
                    claimed.add(j)
        finally:
            for j in claimed:
                self._trapped.add(j)
        return out

    def tail_shortfall(
        self, counts: Sequence[int], near: Sequence[int | None] | None = None, tails: Iterable[int] = ()
    ) -> int:
        """KV pages that ``alloc_kv_runs(counts, near, tails=tails)`` would have to take
        from tails (its step 4) as the pool stands: freeing that many KV pages first
        (a cache eviction) keeps every request out of the others' expert pages.

        Counted in KV pages: each run's need beyond the room left in its ``near``
        page, against the free KV pages outside every tail. O(runs + tails).
        """
        counts, near_mid, tail_ids = self._runs_args(counts, near, tails)
        room: dict[int, int] = {}
        for j in (*near_mid, *tail_ids):
            if j is not None and j not in room and self._has_free_kv(j):
                room[j] = len(self._mid_kv[j].free)
        outside = self._n_trapped - sum(room.values()) + self._free_kv_capacity
        need = 0
        for count, j in zip(counts, near_mid):
            own = min(count, room.get(j, 0))
            if own:
                room[j] -= own
            need += count - own
        return max(0, need - outside)

    def free_kv_pages(self, ids: Iterable[int]) -> None:
        """Return KV pages; merges expert pages and then huge pages bottom-up."""
        ids = self._validated(ids, self._kv_owner, "KV page")
        e_of = self.geometry.expert_page_of_kv_page
        for k in ids:
            del self._kv_owner[k]
            j = e_of(k)
            split = self._mid_kv[j]
            heapq.heappush(split.free, k)
            split.used -= 1
            self._n_trapped += 1
            if split.used == 0:  # merge: the expert page is whole and free again
                del self._mid_kv[j]
                self._trapped.discard(j)
                self._n_trapped -= len(split.free)
                self._release_mid(j)
            elif len(split.free) == 1:
                self._trapped.add(j)

    def kv_page_owner(self, k: int) -> Hashable:
        """Owner of KV page ``k``; ``KeyError`` if it is not allocated."""
        return self._kv_owner[k]

    def is_kv_page_allocated(self, k: int) -> bool:
        return k in self._kv_owner

    def kv_capacity_now(self) -> int:
        """KV pages allocatable right now (trapped + those of free expert pages)."""
        return self._n_trapped + self._free_kv_capacity

    def missing_expert_pages(self, kv_pages_needed: int) -> int:
        """R_b for a KV request of ``kv_pages_needed`` pages; see ``PoolStats``."""
        return self.stats().missing_expert_pages(kv_pages_needed)

    # ================================================================ SSM pages

    def alloc_ssm_pages(self, n: int, owners: Sequence[Hashable]) -> list[int] | None:
        """Take ``n`` SSM pages (middle level, hybrid models only); same rules as experts.

        Lowest free SSM page in an SSM-split huge page first, else split the
        lowest whole huge page into SSM pages.  ``None`` when impossible.
        """
        if not self.geometry.has_ssm:
            raise ValueError("alloc_ssm_pages on a geometry without ssm_page_bytes")
        owners = list(owners)
        if n < 0 or len(owners) != n:
            raise ValueError(f"need n >= 0 and len(owners) == n, got n={n}, {len(owners)} owners")
        if n > len(self._free_ssm) + len(self._free_huge) * self._spH:
            return None
        out = []
        for owner in owners:
            s = self._free_ssm.min()
            if s is None:
                h = self._free_huge.pop_min()
                self._huge_state[h] = _SPLIT_SSM
                self._n_ssm_split += 1
                self._free_kv_capacity -= self._kv_capacity_of_huge(h)
                for c in self.geometry.ssm_pages_of_huge_page(h):
                    self._free_ssm.add(c)
                s = self._free_ssm.min()
            self._free_ssm.discard(s)
            self._huge_used[s // self._spH] += 1
            self._ssm_owner[s] = owner
            out.append(s)
        return out

    def free_ssm_pages(self, ids: Iterable[int]) -> None:
        """Return SSM pages; a huge page whose SSM pages are all free merges."""
        ids = self._validated(ids, self._ssm_owner, "SSM page")
        for s in ids:
            del self._ssm_owner[s]
            self._free_ssm.add(s)
            h = s // self._spH
            self._huge_used[h] -= 1
            if self._huge_used[h] == 0:
                for c in self.geometry.ssm_pages_of_huge_page(h):
                    self._free_ssm.discard(c)
                self._huge_state[h] = _WHOLE
                self._n_ssm_split -= 1
                self._free_kv_capacity += self._kv_capacity_of_huge(h)
                self._free_huge.add(h)

    def ssm_page_owner(self, s: int) -> Hashable:
        return self._ssm_owner[s]

    # ================================================================ accounting

    def stats(self) -> PoolStats:
        """O(1) snapshot of the counters."""
        n_split_expert = self.geometry.num_huge_pages - len(self._free_huge) - self._n_ssm_split
        return PoolStats(
            num_huge_pages=self.geometry.num_huge_pages,
            whole_huge_pages=len(self._free_huge),
            expert_split_huge_pages=n_split_expert,
            ssm_split_huge_pages=self._n_ssm_split,
            num_expert_pages=self.geometry.num_expert_pages,
            expert_pages=self._n_expert_owned,
            other_expert_pages=len(self._mid_owner) - self._n_expert_owned,
            kv_split_expert_pages=len(self._mid_kv),
            free_expert_pages=self.free_expert_page_count(),
            ssm_pages_used=len(self._ssm_owner),
            ssm_pages_free=len(self._free_ssm),
            kv_pages_used=len(self._kv_owner),
            trapped_kv_pages=self._n_trapped,
            free_kv_capacity=self._free_kv_capacity,
            min_kv_pages_per_expert_page=self.geometry.min_kv_pages_per_expert_page,
        )

    def check_invariants(self) -> None:
        """Recompute everything from scratch; ``AssertionError`` on any disagreement.

        O(pool size): for tests and debugging, not for the serving path.
        """
        from ._invariants import check_pool_invariants

        check_pool_invariants(self)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"UnifiedPagePool(huge={s.num_huge_pages} whole={s.whole_huge_pages}, "
            f"expert={s.expert_pages} other={s.other_expert_pages} "
            f"kv_split={s.kv_split_expert_pages} free_expert={s.free_expert_pages}, "
            f"kv_used={s.kv_pages_used} trapped={s.trapped_kv_pages}, ssm={s.ssm_pages_used})"
        )

    # ================================================================ internals

    def _take_free_mid(self) -> int:
        """Pop the lowest free expert page, splitting the lowest whole huge page if needed."""
        j = self._free_mid.min()
        if j is None:
            h = self._free_huge.pop_min()
            self._huge_state[h] = _SPLIT_EXPERT
            for c in self.geometry.expert_pages_of_huge_page(h):
                self._free_mid.add(c)
            j = self._free_mid.min()
        self._free_mid.discard(j)
        self._huge_used[j // self._epH] += 1
        self._free_kv_capacity -= self._kv_count(j)
        return j

    def _release_mid(self, j: int) -> None:
        """Expert page ``j`` (no longer owned or split) becomes free; merge its huge page."""
        self._free_mid.add(j)
        self._free_kv_capacity += self._kv_count(j)
        h = j // self._epH
        self._huge_used[h] -= 1
        if self._huge_used[h] == 0:
            for c in self.geometry.expert_pages_of_huge_page(h):
                self._free_mid.discard(c)
            self._huge_state[h] = _WHOLE
            self._free_huge.add(h)

    def _split_mid_into_kv(self) -> int:
        j = self._take_free_mid()
        split = _KVSplit(self.geometry.kv_pages_of_expert_page(j))
        self._mid_kv[j] = split
        self._n_trapped += len(split.free)
        self._trapped.add(j)
        return j

    def _runs_args(self, counts, near, tails) -> tuple[list[int], list[int | None], list[int | None]]:
        """Checked runs: counts, the expert page of each ``near`` and of each tail id."""
        counts = [int(c) for c in counts]
        near = [None] * len(counts) if near is None else list(near)
        if len(near) != len(counts) or any(c < 0 for c in counts):
            raise ValueError(f"need one near id per run and counts >= 0, got {counts} and {near}")
        e_of = self.geometry.expert_page_of_kv_page  # validates the range; a hole -> None
        return counts, [None if k is None else e_of(k) for k in near], [e_of(k) for k in tails]

    def _has_free_kv(self, j: int) -> bool:
        split = self._mid_kv.get(j)
        return split is not None and bool(split.free)

    def _take_kv(self, j: int, want: int, owner: Hashable, out: list[int]) -> int:
        """Move up to ``want`` of expert page ``j``'s free KV pages (lowest first) to ``owner``."""
        split = self._mid_kv[j]
        free = split.free
        take = min(want, len(free))
        for _ in range(take):
            k = heapq.heappop(free)
            self._kv_owner[k] = owner
            out.append(k)
        split.used += take
        self._n_trapped -= take
        if not free:
            self._trapped.discard(j)
        return take

    def _kv_count(self, j: int) -> int:
        e, k = self.geometry.expert_page_bytes, self.geometry.kv_page_bytes
        return (j + 1) * e // k + (j * e // -k)

    def _kv_capacity_of_huge(self, h: int) -> int:
        return sum(self._kv_count(j) for j in self.geometry.expert_pages_of_huge_page(h))

    @staticmethod
    def _validated(ids: Iterable[int], owned: Mapping[int, Hashable], what: str) -> list[int]:
        ids = [int(i) for i in ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what} ids repeat in one free call: {sorted(ids)}")
        bad = [i for i in ids if i not in owned]
        if bad:
            raise ValueError(f"freeing {what}s that are not allocated: {bad[:8]}")
        return ids
