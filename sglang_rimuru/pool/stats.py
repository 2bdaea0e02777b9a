"""``PoolStats``: an O(1) snapshot of the pool, in the units the adjuster uses.

Page accounting identity (checked by ``UnifiedPagePool.check_invariants``)::

    num_expert_pages == expert_pages + other_expert_pages + kv_split_expert_pages
                        + free_expert_pages
                        + ssm_split_huge_pages * expert_pages_per_huge_page
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolStats"]


@dataclass(frozen=True)
class PoolStats:
    """Counts of pages by level and owner kind.

    Huge level: ``whole_huge_pages + expert_split_huge_pages + ssm_split_huge_pages
    == num_huge_pages``.
    Middle level (expert pages): owned by an ``ExpertKey`` (``expert_pages``), by
    any other tag (``other_expert_pages``: load buffers), split into KV pages
    (``kv_split_expert_pages``), or free (``free_expert_pages`` = F_b, including
    the expert pages of whole huge pages).
    Small level (KV): ``kv_pages_used``; ``trapped_kv_pages`` are free KV pages
    inside expert pages that still have a used sibling (usable for KV only).
    """

    num_huge_pages: int
    whole_huge_pages: int
    expert_split_huge_pages: int
    ssm_split_huge_pages: int
    num_expert_pages: int
    expert_pages: int
    other_expert_pages: int
    kv_split_expert_pages: int
    free_expert_pages: int
    ssm_pages_used: int
    ssm_pages_free: int
    kv_pages_used: int
    trapped_kv_pages: int
    free_kv_capacity: int
    min_kv_pages_per_expert_page: int

    def kv_capacity_now(self) -> int:
        """KV pages allocatable right now: trapped pages + KV pages of free expert pages."""
        return self.trapped_kv_pages + self.free_kv_capacity

    def missing_expert_pages(self, kv_pages_needed: int) -> int:
        """R_b: expert pages that must be freed before ``kv_pages_needed`` KV pages fit.

        ``ceil((needed - trapped - kv_of_free_expert_pages) / kv_per_expert_page)``,
        floored at 0.  ``kv_of_free_expert_pages`` is exact (holes counted);
        the divisor is ``min_kv_pages_per_expert_page`` because which expert
        pages get freed is not known yet, so R_b is an upper bound that is exact
        when the KV page divides the expert page.
        """
        if kv_pages_needed < 0:
            raise ValueError(f"kv_pages_needed must be >= 0, got {kv_pages_needed}")
        short = kv_pages_needed - self.kv_capacity_now()
        if short <= 0:
            return 0
        return -(-short // self.min_kv_pages_per_expert_page)
