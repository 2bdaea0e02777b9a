"""PoolGeometry: page counts, the global KV id space, holes, waste, validation."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from sglang_rimuru.pool import PoolGeometry, expert_page_bytes_for, kv_page_bytes_for

QWEN15_E = expert_page_bytes_for(hidden_size=2048, intermediate_size=1408, elem_bytes=2)
QWEN15_K = kv_page_bytes_for(num_layers=24, num_kv_heads=16, head_dim=128, elem_bytes=2, page_size=1)


def _brute_kv_pages(g: PoolGeometry, j: int) -> list[int]:
    """KV ids whose bytes lie wholly inside expert page j, by testing the byte condition."""
    lo, hi = j * g.expert_page_bytes, (j + 1) * g.expert_page_bytes
    kb = g.kv_page_bytes
    candidates = range(max(0, lo // kb - 2), min(g.num_kv_page_ids, hi // kb + 2))
    return [k for k in candidates
            if k * g.kv_page_bytes >= lo and (k + 1) * g.kv_page_bytes <= hi]


def test_qwen15_sizes() -> None:
    assert QWEN15_E == 5_767_168
    assert QWEN15_K == 196_608


def test_qwen15_kv_pages_alternate_with_holes() -> None:
    g = PoolGeometry(total_bytes=32 * 2**30, expert_page_bytes=QWEN15_E, kv_page_bytes=QWEN15_K)
    assert g.huge_page_bytes == QWEN15_E
    assert g.num_huge_pages == g.num_expert_pages == 5957
    assert g.tail_bytes == 4_718_592
    assert g.kv_period == 3
    assert g.max_kv_pages_per_expert_page == 29
    assert g.min_kv_pages_per_expert_page == 28
    # Period of 3 expert pages = 88 KV ids, 86 usable, 2 holes (29 and 58).
    assert g.kv_pages_of_expert_page(0) == range(0, 29)
    assert g.kv_pages_of_expert_page(1) == range(30, 58)
    assert g.kv_pages_of_expert_page(2) == range(59, 88)
    assert g.kv_pages_of_expert_page(3) == range(88, 117)
    assert g.expert_page_of_kv_page(28) == 0
    assert g.expert_page_of_kv_page(29) is None
    assert g.expert_page_of_kv_page(30) == 1
    assert g.expert_page_of_kv_page(58) is None
    assert g.expert_page_of_kv_page(87) == 2
    assert g.expert_page_of_kv_page(88) == 3
    assert [g.waste_bytes_of_expert_page(j) for j in range(4)] == [65_536, 262_144, 65_536, 65_536]
    # Mean waste 2/3 of a KV page = 131,072 B = 2.27 % of an expert page;
    # local packing would waste E - 29 K = 65,536 B (1.1 %), the figure quoted in the brief.
    assert g.waste_bytes_per_expert_page == 131_072
    assert QWEN15_E - 29 * QWEN15_K == 65_536
    assert float(g.waste_bytes_per_expert_page / QWEN15_E) == pytest.approx(0.0227, abs=1e-4)
    assert g.num_kv_page_ids == 174_738
    assert g.num_kv_holes == 3971
    assert g.num_usable_kv_pages == 170_767


def test_kv_divides_expert_page() -> None:
    g = PoolGeometry(total_bytes=10 * 4096 + 100, expert_page_bytes=4096, kv_page_bytes=1024)
    assert g.num_huge_pages == 10 and g.tail_bytes == 100
    assert g.kv_period == 1
    assert g.min_kv_pages_per_expert_page == g.max_kv_pages_per_expert_page == 4
    assert g.num_kv_page_ids == g.num_usable_kv_pages == 40
    assert g.num_kv_holes == 0
    assert g.waste_bytes_per_expert_page == 0
    assert all(g.waste_bytes_of_expert_page(j) == 0 for j in range(10))
    assert g.kv_pages_of_expert_page(7) == range(28, 32)
    assert [g.expert_page_of_kv_page(k) for k in (0, 3, 4, 39)] == [0, 0, 1, 9]


def test_ssm_huge_page_is_lcm() -> None:
    g = PoolGeometry(total_bytes=100, expert_page_bytes=12, kv_page_bytes=4, ssm_page_bytes=8)
    assert g.huge_page_bytes == 24
    assert g.num_huge_pages == 4 and g.pool_bytes == 96 and g.tail_bytes == 4
    assert g.expert_pages_per_huge_page == 2 and g.num_expert_pages == 8
    assert g.ssm_pages_per_huge_page == 3 and g.num_ssm_pages == 12
    assert g.expert_pages_of_huge_page(1) == range(2, 4)
    assert g.ssm_pages_of_huge_page(1) == range(3, 6)
    assert g.huge_page_of_ssm_page(5) == 1 and g.huge_page_of_expert_page(5) == 2
    assert g.num_kv_page_ids == 24
    # Non-hybrid: no SSM level.
    plain = PoolGeometry(total_bytes=100, expert_page_bytes=12, kv_page_bytes=4)
    assert not plain.has_ssm and plain.ssm_pages_per_huge_page == 0 and plain.num_ssm_pages == 0


def test_ssm_lcm_can_exceed_the_pool() -> None:
    # Coprime sizes: huge page = 12 * 7 = 84 bytes > 80.
    with pytest.raises(ValueError, match=r"smaller than one huge page \(huge_page_bytes=84\)"):
        PoolGeometry(total_bytes=80, expert_page_bytes=12, kv_page_bytes=4, ssm_page_bytes=7)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(total_bytes=0, expert_page_bytes=12, kv_page_bytes=4), "total_bytes"),
        (dict(total_bytes=100, expert_page_bytes=-12, kv_page_bytes=4), "expert_page_bytes"),
        (dict(total_bytes=100, expert_page_bytes=12, kv_page_bytes=0), "kv_page_bytes"),
        (dict(total_bytes=100, expert_page_bytes=12, kv_page_bytes=4, ssm_page_bytes=0),
         "ssm_page_bytes"),
        (dict(total_bytes=100, expert_page_bytes=12.0, kv_page_bytes=4), "expert_page_bytes"),
        (dict(total_bytes=100, expert_page_bytes=12, kv_page_bytes=13), "kv_page_bytes=13 is larger"),
        (dict(total_bytes=100, expert_page_bytes=12, kv_page_bytes=7), "kv_page_bytes=7 neither"),
        (dict(total_bytes=11, expert_page_bytes=12, kv_page_bytes=4), "total_bytes=11"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PoolGeometry(**kwargs)


def test_index_range_checks() -> None:
    g = PoolGeometry(total_bytes=48, expert_page_bytes=12, kv_page_bytes=5)
    with pytest.raises(ValueError, match="KV page id 9"):
        g.expert_page_of_kv_page(g.num_kv_page_ids)
    with pytest.raises(ValueError, match="expert page 4"):
        g.kv_pages_of_expert_page(4)


@pytest.mark.parametrize("seed", range(5))
def test_kv_maps_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        k = rng.randint(1, 40)
        e = rng.choice([k * rng.randint(1, 5), rng.randint(2 * k, 6 * k)])
        s = rng.choice([None, None, rng.randint(1, 20)])
        g = PoolGeometry(total_bytes=rng.randint(1, 8) * math.lcm(e, s or e) + rng.randint(0, e),
                         expert_page_bytes=e, kv_page_bytes=k, ssm_page_bytes=s)
        owner: dict[int, int] = {}
        usable = 0
        for j in range(g.num_expert_pages):
            ids = list(g.kv_pages_of_expert_page(j))
            assert ids == _brute_kv_pages(g, j)
            assert len(ids) >= max(1, g.min_kv_pages_per_expert_page)
            assert len(ids) <= g.max_kv_pages_per_expert_page
            assert g.waste_bytes_of_expert_page(j) == e - len(ids) * k
            for kid in ids:
                assert kid not in owner
                owner[kid] = j
            usable += len(ids)
        assert usable == g.num_usable_kv_pages
        assert g.num_kv_page_ids * k <= g.pool_bytes
        for kid in range(g.num_kv_page_ids):
            assert g.expert_page_of_kv_page(kid) == owner.get(kid)
        # Mean waste over one period of expert pages (when the pool covers one).
        p = g.kv_period
        if g.num_expert_pages >= p:
            period_waste = sum(g.waste_bytes_of_expert_page(j) for j in range(p))
            assert g.waste_bytes_per_expert_page == Fraction(period_waste, p)
