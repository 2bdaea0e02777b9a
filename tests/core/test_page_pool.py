"""UnifiedPagePool: split order, affinity, merge, all-or-nothing, accounting, invariants.

Geometries are in abstract byte units so page ids stay readable:

* ``HYBRID``: E=12, K=4, S=8 -> H=24; 4 huge pages, 2 expert pages and 3 SSM
  pages per huge page; expert page j holds KV ids 3j..3j+2.
* ``PLAIN``:  E=12, K=4, no SSM -> H=E; 6 huge = 6 expert pages, KV ids 0..17.
* ``HOLES``:  E=12, K=5 -> KV per expert page 2,1,2,1,2; ids 2,4,7,9 are holes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import pytest

from sglang_rimuru.pool import (
    ExpertKey,
    PoolGeometry,
    UnifiedPagePool,
    load_buffer_owner,
)

HYBRID = PoolGeometry(total_bytes=96, expert_page_bytes=12, kv_page_bytes=4, ssm_page_bytes=8)
PLAIN = PoolGeometry(total_bytes=72, expert_page_bytes=12, kv_page_bytes=4)
HOLES = PoolGeometry(total_bytes=60, expert_page_bytes=12, kv_page_bytes=5)


def ek(layer: int, expert: int = 0, matrix: str = "w1") -> ExpertKey:
    return ExpertKey(layer, expert, matrix)


def checked(g: PoolGeometry) -> UnifiedPagePool:
    p = UnifiedPagePool(g)
    p.check_invariants()
    return p


# ---------------------------------------------------------------- split order


def test_kv_split_order_free_kv_then_expert_page_then_huge_page() -> None:
    p = checked(HYBRID)
    assert p.alloc_kv_pages(1, "a") == [0]  # huge 0 -> expert pages 0,1; expert 0 -> KV 0..2
    s = p.stats()
    assert (s.whole_huge_pages, s.expert_split_huge_pages, s.kv_split_expert_pages) == (3, 1, 1)
    assert (s.free_expert_pages, s.trapped_kv_pages, s.kv_pages_used) == (7, 2, 1)
    assert p.alloc_kv_pages(2, "b") == [1, 2]  # (1) free KV pages first
    assert p.alloc_kv_pages(1, "c") == [3]  # (2) free expert page 1 in split huge page 0
    assert p.stats().whole_huge_pages == 3
    assert p.alloc_expert_pages(1, [ek(0)]) == [2]  # splits huge 1 -> expert pages 2,3
    assert p.alloc_kv_pages(3, "d") == [4, 5, 9]  # KV 4,5 of expert 1, then expert 3
    assert p.alloc_kv_pages(3, "e") == [10, 11, 12]  # (3) split huge 2 -> expert 4 -> KV 12
    s = p.stats()
    assert (s.whole_huge_pages, s.expert_split_huge_pages, s.kv_split_expert_pages) == (1, 3, 4)
    assert (s.expert_pages, s.free_expert_pages, s.trapped_kv_pages, s.kv_pages_used) == (1, 3, 2, 10)
    p.check_invariants()


def test_expert_pages_prefer_split_huge_pages_and_skip_kv_split_ones() -> None:
    p = checked(HYBRID)
    assert p.alloc_expert_pages(1, [ek(0)]) == [0]
    assert p.alloc_kv_pages(1, "r") == [3]  # expert page 1 becomes KV-split
    assert p.alloc_expert_pages(2, [ek(1), ek(2)]) == [2, 3]  # not 1: split huge 1
    p.free_expert_pages([2])
    assert p.alloc_expert_pages(1, [ek(3)]) == [2]  # free page in split huge 1 before huge 2
    assert p.expert_page_owner(2) == ek(3)
    assert p.stats().whole_huge_pages == 2
    p.check_invariants()


def test_large_request_fills_one_expert_page_before_the_next() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_pages(7, "x") == [0, 1, 2, 3, 4, 5, 6]
    s = p.stats()
    assert (s.kv_split_expert_pages, s.trapped_kv_pages) == (3, 2)
    assert p.alloc_kv_pages(1, "y") == [7]


# ---------------------------------------------------------------- affinity


def test_near_prefers_the_expert_page_of_the_request() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_pages(3, "a") == [0, 1, 2]
    assert p.alloc_kv_pages(2, "b") == [3, 4]
    assert p.alloc_kv_pages(3, "c") == [5, 6, 7]
    p.free_kv_pages([1, 5])  # free KV: 1 (expert 0), 5 (expert 1), 8 (expert 2)
    assert p.alloc_kv_pages(1, "c", near=7) == [8]  # not the lowest (1)
    assert p.alloc_kv_pages(1, "b", near=3) == [5]
    assert p.alloc_kv_pages(1, "c", near=6) == [1]  # near's page full: lowest free KV page
    p.free_kv_pages([3])
    p.free_kv_pages([0])
    # near's page first, then lowest partially used page, then a fresh expert page
    assert p.alloc_kv_pages(3, "b", near=4) == [3, 0, 9]
    p.check_invariants()


def test_near_on_a_hole_is_ignored_and_out_of_range_raises() -> None:
    p = checked(HOLES)
    assert HOLES.num_kv_page_ids == 12
    assert [len(HOLES.kv_pages_of_expert_page(j)) for j in range(5)] == [2, 1, 2, 1, 2]
    assert p.alloc_kv_pages(1, "a") == [0]
    assert p.alloc_expert_pages(1, [ek(0)]) == [1]
    assert p.alloc_kv_pages(2, "b") == [1, 5]  # expert 1 is owned; expert 2 holds KV 5, 6
    assert p.alloc_kv_pages(1, "c", near=2) == [6]  # 2 is a hole: no affinity
    with pytest.raises(ValueError, match="KV page id 12"):
        p.alloc_kv_pages(1, "c", near=12)
    p.check_invariants()


def test_runs_keep_each_request_in_its_own_expert_page() -> None:
    """One prefill of two requests, then decode steps: each request in its own expert
    page; when one request ends, its expert pages are whole again at once."""
    p = checked(PLAIN)
    assert p.alloc_kv_runs([2, 2]) == [0, 1, 3, 4]  # b does not start in a's page 0
    assert p.alloc_kv_runs([1, 1], near=[1, 4]) == [2, 5]
    assert p.alloc_kv_runs([1, 1], near=[2, 5]) == [6, 9]  # both pages full: a fresh page each
    p.free_kv_pages([0, 1, 2, 6])  # a ends
    s = p.stats()
    assert (s.kv_split_expert_pages, s.trapped_kv_pages, s.free_expert_pages) == (2, 2, 4)
    p.check_invariants()

    # The same traffic in the plain order (SGLang's alloc(n) before affinity) interleaves them.
    q = checked(PLAIN)
    assert q.alloc_kv_pages(4) + q.alloc_kv_pages(2) + q.alloc_kv_pages(2) == [0, 1, 2, 3, 4, 5, 6, 7]
    q.free_kv_pages([0, 1, 4, 6])  # a held 0, 1, 4, 6; b holds 2, 3, 5, 7
    s = q.stats()
    assert (s.kv_split_expert_pages, s.trapped_kv_pages, s.free_expert_pages) == (3, 5, 3)


def test_tails_of_requests_outside_the_call_stay_clear() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_runs([2]) == [0, 1]  # a: room left at 2
    assert p.alloc_kv_runs([1], tails=[1]) == [3]  # a new request does not take a's room
    assert p.alloc_kv_runs([1]) == [2]  # without the tail: the lowest partially used page
    p.check_invariants()


def test_holes_first_then_fresh_pages_then_tails() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_runs([3, 2]) == [0, 1, 2, 3, 4]  # a fills page 0; b has room at 5
    p.free_kv_pages([1])  # a hole in page 0
    assert p.alloc_kv_runs([2], tails=[4]) == [1, 6]  # c: the hole, then a fresh page, not b's room
    assert p.alloc_kv_runs([9], tails=[4, 6]) == list(range(9, 18))  # d: the three free pages
    assert p.free_expert_page_count() == 0
    assert p.alloc_kv_runs([3], tails=[4, 6]) == [5, 7, 8]  # e: only tails left, lowest first
    assert p.alloc_kv_runs([1]) is None
    p.check_invariants()


def test_runs_in_one_call_follow_their_own_near() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_runs([1, 1, 1]) == [0, 3, 6]  # three new requests, three pages
    # decode: every request continues in its page, in batch order, whatever its id order
    assert p.alloc_kv_runs([1, 1, 1], near=[6, 0, 3]) == [7, 1, 4]
    # a zero-length run takes nothing, but its near page is still a tail
    p.free_kv_pages([1])
    assert p.alloc_kv_runs([0, 2], near=[0, None], tails=[4, 7]) == [9, 10]
    # without the tails, pages 1 and 2 are holes for a new request, lowest first
    assert p.alloc_kv_runs([0, 2], near=[0, None]) == [5, 8]
    p.check_invariants()


def test_runs_all_or_nothing_and_checked() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_runs([10, 9]) is None
    assert p.kv_capacity_now() == 18 and p.stats().kv_split_expert_pages == 0
    assert p.alloc_kv_runs([]) == [] and p.alloc_kv_runs([0, 0]) == []
    with pytest.raises(ValueError, match="one near id per run"):
        p.alloc_kv_runs([1, 1], near=[None])
    with pytest.raises(ValueError, match="counts >= 0"):
        p.alloc_kv_runs([-1])
    with pytest.raises(ValueError, match="KV page id 18"):
        p.alloc_kv_runs([1], near=[18])
    with pytest.raises(ValueError, match="KV page id 18"):
        p.alloc_kv_runs([1], tails=[18])
    p.check_invariants()


def test_runs_near_and_tails_on_holes_are_ignored() -> None:
    p = checked(HOLES)  # KV per expert page 2,1,2,1,2; ids 2, 4, 7, 9 are holes
    assert p.alloc_kv_runs([1, 1], near=[2, 4], tails=[7, 9]) == [0, 3]
    p.check_invariants()


def test_tail_shortfall_is_what_would_enter_other_requests_pages() -> None:
    p = checked(PLAIN)
    assert p.alloc_expert_pages(3, [ek(i) for i in range(3)]) == [0, 1, 2]
    assert p.alloc_kv_runs([2, 1]) == [9, 10, 12]  # a: page 3, room 11; b: page 4, room 13, 14
    assert p.tail_shortfall([2, 2], near=[10, 12]) == 0  # page 5 is free
    assert p.alloc_kv_runs([3], tails=[10, 12]) == [15, 16, 17]  # c fills page 5
    assert p.tail_shortfall([1, 2], near=[10, 12]) == 0  # within each request's room
    assert p.tail_shortfall([2, 1], near=[10, 12]) == 1  # a needs one beyond its room
    assert p.tail_shortfall([3], tails=[10, 12]) == 3  # all that is free is a's and b's room
    p.free_kv_pages([16])  # c ends part-way: a hole in page 5
    assert p.tail_shortfall([3], tails=[10, 12]) == 2
    assert p.tail_shortfall([3]) == 0  # no live request named: every free page is fair
    p.check_invariants()


# ---------------------------------------------------------------- merge


def test_kv_free_merges_expert_page_then_huge_page() -> None:
    p = checked(HYBRID)
    assert p.alloc_kv_pages(4, "a") == [0, 1, 2, 3]
    p.free_kv_pages([0, 1])
    s = p.stats()
    assert (s.kv_split_expert_pages, s.trapped_kv_pages, s.whole_huge_pages) == (2, 4, 3)
    p.free_kv_pages([2])  # expert page 0 whole again; huge 0 still split (KV 3 used)
    s = p.stats()
    assert (s.kv_split_expert_pages, s.trapped_kv_pages) == (1, 2)
    assert (s.free_expert_pages, s.whole_huge_pages, s.expert_split_huge_pages) == (7, 3, 1)
    p.free_kv_pages([3])  # huge 0 whole again
    s = p.stats()
    assert (s.whole_huge_pages, s.free_expert_pages, s.trapped_kv_pages) == (4, 8, 0)
    assert p.kv_capacity_now() == 24
    p.check_invariants()


def test_expert_free_merges_huge_page() -> None:
    p = checked(HYBRID)
    assert p.alloc_expert_pages(2, [ek(0), ek(1)]) == [0, 1]
    p.free_expert_pages([0])
    assert (p.stats().expert_split_huge_pages, p.free_expert_page_count()) == (1, 7)
    p.free_expert_pages([1])
    assert (p.stats().whole_huge_pages, p.free_expert_page_count()) == (4, 8)
    p.check_invariants()


# ---------------------------------------------------------------- all-or-nothing


def _snapshot(p: UnifiedPagePool) -> tuple:
    return (p.stats(), dict(p._mid_owner), dict(p._kv_owner), dict(p._ssm_owner))


def test_allocation_is_all_or_nothing() -> None:
    p = checked(PLAIN)
    assert p.alloc_expert_pages(5, [ek(i) for i in range(5)]) == [0, 1, 2, 3, 4]
    before = _snapshot(p)
    assert p.alloc_kv_pages(4, "a") is None
    assert p.alloc_expert_pages(2, [ek(5), ek(6)]) is None
    assert _snapshot(p) == before
    assert p.alloc_kv_pages(3, "a") == [15, 16, 17]
    assert p.alloc_kv_pages(1, "b") is None
    assert p.alloc_expert_pages(1, [ek(7)]) is None
    assert p.alloc_kv_pages(0, "b") == [] and p.alloc_expert_pages(0, []) == []
    p.check_invariants()


def test_bad_free_raises_and_changes_nothing() -> None:
    p = checked(PLAIN)
    assert p.alloc_expert_pages(1, [ek(0)]) == [0]
    assert p.alloc_kv_pages(2, "a") == [3, 4]
    before = _snapshot(p)
    with pytest.raises(ValueError, match=r"not allocated: \[5\]"):
        p.free_kv_pages([3, 5])
    with pytest.raises(ValueError, match="repeat"):
        p.free_kv_pages([3, 3])
    with pytest.raises(ValueError, match=r"expert pages that are not allocated: \[1\]"):
        p.free_expert_pages([0, 1])  # 1 is split into KV pages, not owned whole
    with pytest.raises(ValueError, match="KV pages that are not allocated"):
        p.free_kv_pages([0])  # KV id 0 lies in an expert-owned page
    assert _snapshot(p) == before
    with pytest.raises(ValueError, match="len\\(owners\\) == n"):
        p.alloc_expert_pages(2, [ek(1)])
    with pytest.raises(ValueError, match="n must be >= 0"):
        p.alloc_kv_pages(-1)
    p.check_invariants()


# ---------------------------------------------------------------- accounting


def test_accounting_trapped_fb_rb() -> None:
    p = checked(PLAIN)
    assert p.alloc_expert_pages(2, [ek(0, 0, "w1"), ek(0, 0, "w3")]) == [0, 1]
    assert p.alloc_expert_pages(1, [load_buffer_owner(0)]) == [2]
    assert p.alloc_kv_pages(2, "a") == [9, 10]
    assert p.alloc_kv_pages(1, "b") == [11]
    assert p.alloc_kv_pages(1, "c") == [12]
    p.free_kv_pages([10])  # expert 3: 10 trapped; expert 4: 13, 14 trapped
    s = p.stats()
    assert s.whole_huge_pages == 1 and s.expert_split_huge_pages == 5
    assert (s.expert_pages, s.other_expert_pages, s.kv_split_expert_pages) == (2, 1, 2)
    assert (s.free_expert_pages, s.kv_pages_used, s.trapped_kv_pages) == (1, 3, 3)
    assert s.free_kv_capacity == 3 and s.kv_capacity_now() == p.kv_capacity_now() == 6
    assert [p.missing_expert_pages(n) for n in (0, 6, 7, 9, 10, 18)] == [0, 0, 1, 1, 2, 4]
    assert s.missing_expert_pages(10) == 2
    with pytest.raises(ValueError, match="kv_pages_needed"):
        s.missing_expert_pages(-1)


def test_accounting_with_holes_uses_exact_capacity_and_min_divisor() -> None:
    p = checked(HOLES)
    assert p.kv_capacity_now() == HOLES.num_usable_kv_pages == 8
    assert p.alloc_kv_pages(1, "a") == [0]
    assert p.alloc_expert_pages(1, [ek(0)]) == [1]
    s = p.stats()
    # free expert pages 2, 3, 4 hold 2 + 1 + 2 KV pages; KV 1 is trapped
    assert (s.free_expert_pages, s.free_kv_capacity, s.trapped_kv_pages) == (3, 5, 1)
    assert s.min_kv_pages_per_expert_page == 1
    assert [p.missing_expert_pages(n) for n in (6, 7, 9)] == [0, 1, 3]


def test_hybrid_accounting_and_ssm_pages() -> None:
    p = checked(HYBRID)
    assert p.alloc_ssm_pages(2, ["s0", "s1"]) == [0, 1]  # huge 0 -> SSM pages 0,1,2
    s = p.stats()
    assert (s.ssm_split_huge_pages, s.ssm_pages_used, s.ssm_pages_free) == (1, 2, 1)
    assert (s.free_expert_pages, p.kv_capacity_now()) == (6, 18)
    assert p.alloc_expert_pages(1, [ek(0)]) == [2]  # huge 1 -> expert pages 2,3
    assert p.alloc_ssm_pages(2, ["s2", "s3"]) == [2, 6]  # SSM 2, then huge 2 -> SSM 6,7,8
    assert p.ssm_page_owner(6) == "s3"
    assert p.alloc_kv_pages(1, "r") == [9]  # expert page 3; SSM huge pages untouched
    s = p.stats()
    assert (s.whole_huge_pages, s.expert_split_huge_pages, s.ssm_split_huge_pages) == (1, 1, 2)
    assert (s.free_expert_pages, s.ssm_pages_free, s.trapped_kv_pages) == (2, 2, 2)
    assert p.alloc_ssm_pages(6, [f"t{i}" for i in range(6)]) is None  # 2 free + 3 in huge 3
    p.check_invariants()
    p.free_ssm_pages([0, 1, 2])
    assert p.stats().ssm_split_huge_pages == 1
    p.free_ssm_pages([6])
    assert p.stats().ssm_split_huge_pages == 0 and p.stats().whole_huge_pages == 3
    with pytest.raises(ValueError, match="SSM pages that are not allocated"):
        p.free_ssm_pages([6])
    p.check_invariants()
    with pytest.raises(ValueError, match="without ssm_page_bytes"):
        UnifiedPagePool(PLAIN).alloc_ssm_pages(1, ["x"])


def test_owner_lookups() -> None:
    p = checked(PLAIN)
    assert p.alloc_kv_pages(1) == [0]  # SGLang passes no owner
    assert p.is_kv_page_allocated(0) and p.kv_page_owner(0) is None
    assert not p.is_kv_page_allocated(1)
    with pytest.raises(KeyError):
        p.kv_page_owner(1)
    assert p.alloc_expert_pages(1, [ek(3, 7, "w2")]) == [1]
    assert p.expert_page_owners() == {1: ek(3, 7, "w2")}
    with pytest.raises(TypeError):
        p.expert_page_owners()[2] = ek(0)  # type: ignore[index]
    with pytest.raises(ValueError, match="matrix"):
        ExpertKey(0, 0, "w4")  # type: ignore[arg-type]


# ---------------------------------------------------------------- invariant checker


def _corrupt_pool() -> UnifiedPagePool:
    """HYBRID: expert 0 owned, expert 1 KV-split (KV 3, 4 used, 5 free), huge 1 SSM (3 used)."""
    p = checked(HYBRID)
    assert p.alloc_expert_pages(1, [ek(0)]) == [0]
    assert p.alloc_kv_pages(2, "a") == [3, 4]
    assert p.alloc_ssm_pages(1, ["s"]) == [3]
    p.check_invariants()
    return p


def _kv_all_free_unmerged(p: UnifiedPagePool) -> None:
    split = p._mid_kv[1]
    for k in (3, 4):
        del p._kv_owner[k]
        heapq.heappush(split.free, k)
    split.used = 0


def _ssm_all_free_unmerged(p: UnifiedPagePool) -> None:
    del p._ssm_owner[3]
    p._free_ssm.add(3)
    p._huge_used[1] = 0


CORRUPTIONS: dict[str, tuple[Callable[[UnifiedPagePool], object], str]] = {
    "kv_free_and_owned": (lambda p: p._kv_owner.__setitem__(5, "x"), "both free and owned"),
    "kv_leak": (lambda p: p._kv_owner.__delitem__(4), "KV pages leaked"),
    "expert_owned_and_split": (
        lambda p: p._mid_owner.__setitem__(1, ek(9)), "both owned and split into KV"),
    "expert_leak": (lambda p: p._mid_owner.__delitem__(0), "child pages leaked"),
    "expert_page_unmerged": (_kv_all_free_unmerged, "all KV pages free \\(should have merged\\)"),
    "huge_page_unmerged": (_ssm_all_free_unmerged, "huge page 1 has all children free"),
    "split_huge_in_free_set": (lambda p: p._free_huge.add(1), "split huge page 1 is in the free"),
    "trapped_set_out_of_sync": (lambda p: p._trapped.discard(1), "trapped set"),
    "trapped_counter": (lambda p: setattr(p, "_n_trapped", p._n_trapped + 1), "trapped counter"),
    "capacity_counter": (
        lambda p: setattr(p, "_free_kv_capacity", p._free_kv_capacity - 1), "free KV capacity"),
    "kv_in_unsplit_page": (lambda p: p._kv_owner.__setitem__(20, "x"), "which is not split"),
    "heap_duplicate": (lambda p: p._free_huge._heap.append(2), "queued twice"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_check_invariants_catches_corruption(name: str) -> None:
    corrupt, message = CORRUPTIONS[name]
    p = _corrupt_pool()
    corrupt(p)
    with pytest.raises(AssertionError, match=message):
        p.check_invariants()


def test_check_invariants_catches_owned_hole() -> None:
    p = checked(HOLES)
    assert p.alloc_kv_pages(1, "a") == [0]
    p._kv_owner[2] = "x"  # KV 2 straddles expert pages 0 and 1
    with pytest.raises(AssertionError, match="KV page 2 is a hole"):
        p.check_invariants()
