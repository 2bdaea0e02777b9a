"""Full consistency check of a ``UnifiedPagePool`` (tests and debugging only).

Recomputes every count from the owner maps and free sets and compares with the
pool's O(1) counters.  Raises ``AssertionError`` naming the page and the rule.
Kept apart from ``page_pool.py`` so the serving path stays short to read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .owners import ExpertKey

if TYPE_CHECKING:
    from .page_pool import UnifiedPagePool

__all__ = ["check_pool_invariants"]


def check_pool_invariants(p: UnifiedPagePool) -> None:
    from .page_pool import _SPLIT_EXPERT, _SPLIT_SSM, _WHOLE

    g = p.geometry
    epH, spH = g.expert_pages_per_huge_page, g.ssm_pages_per_huge_page

    for name, s in (
        ("free huge set", p._free_huge),
        ("free expert set", p._free_mid),
        ("free SSM set", p._free_ssm),
        ("trapped set", p._trapped),
    ):
        s._check(name)

    # ---- middle level: each expert page in at most one structure -----------
    owned, split, free = set(p._mid_owner), set(p._mid_kv), set(p._free_mid)
    for a, b, an, bn in (
        (owned, split, "owned", "split into KV"),
        (owned, free, "owned", "free"),
        (split, free, "split into KV", "free"),
    ):
        both = a & b
        assert not both, f"expert pages both {an} and {bn}: {sorted(both)[:8]}"
    for j in owned | split | free:
        assert 0 <= j < g.num_expert_pages, f"expert page id {j} out of range"
        h = j // epH
        assert p._huge_state[h] == _SPLIT_EXPERT, (
            f"expert page {j} tracked but its huge page {h} is not split into expert pages"
        )
    ssm_owned, ssm_free = set(p._ssm_owner), set(p._free_ssm)
    both = ssm_owned & ssm_free
    assert not both, f"SSM pages both owned and free: {sorted(both)[:8]}"
    for s in ssm_owned | ssm_free:
        assert 0 <= s < g.num_ssm_pages, f"SSM page id {s} out of range"
        h = s // spH
        assert p._huge_state[h] == _SPLIT_SSM, (
            f"SSM page {s} tracked but its huge page {h} is not split into SSM pages"
        )

    # ---- huge level ------------------------------------------------------------
    n_ssm_split = 0
    for h in range(g.num_huge_pages):
        state, used = p._huge_state[h], p._huge_used[h]
        if state == _WHOLE:
            assert h in p._free_huge, f"whole huge page {h} missing from the free huge set"
            assert used == 0, f"whole huge page {h} has used count {used}"
            continue
        assert h not in p._free_huge, f"split huge page {h} is in the free huge set"
        if state == _SPLIT_EXPERT:
            kids = g.expert_pages_of_huge_page(h)
            n_used = sum(1 for j in kids if j in owned or j in split)
            n_free = sum(1 for j in kids if j in free)
            total = epH
        elif state == _SPLIT_SSM:
            n_ssm_split += 1
            kids = g.ssm_pages_of_huge_page(h)
            n_used = sum(1 for s in kids if s in ssm_owned)
            n_free = sum(1 for s in kids if s in ssm_free)
            total = spH
        else:
            raise AssertionError(f"huge page {h} has unknown state {state}")
        assert n_used + n_free == total, (
            f"huge page {h}: {total - n_used - n_free} child pages leaked (neither free nor used)"
        )
        assert n_used == used, f"huge page {h}: used count {used}, recomputed {n_used}"
        assert n_used > 0, f"split huge page {h} has all children free (should have merged)"
    assert n_ssm_split == p._n_ssm_split, f"SSM-split count {p._n_ssm_split} != {n_ssm_split}"

    # ---- small level -----------------------------------------------------------
    n_trapped, n_used_kv, trapped_mids = 0, 0, set()
    for j, sp in p._mid_kv.items():
        ids = g.kv_pages_of_expert_page(j)
        heap = sp.free
        freeset = set(heap)
        assert len(freeset) == len(heap), f"expert page {j}: a KV page is listed free twice"
        assert all(ids.start <= k < ids.stop for k in freeset), (
            f"expert page {j}: free KV ids outside its range {ids}"
        )
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), (
            f"expert page {j}: free KV heap order broken"
        )
        both = [k for k in freeset if k in p._kv_owner]
        assert not both, f"KV pages both free and owned: {both[:8]}"
        owned_here = sum(1 for k in ids if k in p._kv_owner)
        assert owned_here + len(freeset) == len(ids), (
            f"expert page {j}: {len(ids) - owned_here - len(freeset)} KV pages leaked"
        )
        assert owned_here == sp.used, f"expert page {j}: used count {sp.used}, recomputed {owned_here}"
        assert owned_here > 0, f"split expert page {j} has all KV pages free (should have merged)"
        if freeset:
            trapped_mids.add(j)
        n_trapped += len(freeset)
        n_used_kv += owned_here
    for k in p._kv_owner:
        j = g.expert_page_of_kv_page(k)
        assert j is not None, f"KV page {k} is a hole (straddles an expert page) but is owned"
        assert j in p._mid_kv, f"KV page {k} owned inside expert page {j}, which is not split"
    assert n_used_kv == len(p._kv_owner), "KV owner map and split expert pages disagree"
    assert set(p._trapped) == trapped_mids, (
        f"trapped set {sorted(p._trapped)[:8]} != pages with free KV {sorted(trapped_mids)[:8]}"
    )
    assert p._n_trapped == n_trapped, f"trapped counter {p._n_trapped} != {n_trapped}"

    # ---- counters and totals ----------------------------------------------------
    n_expert = sum(1 for o in p._mid_owner.values() if isinstance(o, ExpertKey))
    assert p._n_expert_owned == n_expert, f"expert counter {p._n_expert_owned} != {n_expert}"
    cap = sum(p._kv_count(j) for j in free) + sum(p._kv_capacity_of_huge(h) for h in p._free_huge)
    assert p._free_kv_capacity == cap, f"free KV capacity {p._free_kv_capacity} != {cap}"
    st = p.stats()
    assert st.whole_huge_pages + st.expert_split_huge_pages + st.ssm_split_huge_pages == (
        g.num_huge_pages
    ), "huge pages do not add up"
    middle = (
        st.expert_pages
        + st.other_expert_pages
        + st.kv_split_expert_pages
        + st.free_expert_pages
        + st.ssm_split_huge_pages * epH
    )
    assert middle == g.num_expert_pages, f"expert pages add up to {middle}, not {g.num_expert_pages}"
    ssm = st.ssm_pages_used + st.ssm_pages_free
    assert ssm == st.ssm_split_huge_pages * spH, f"SSM pages add up to {ssm}"
