"""pick_victims / pick_restores on a real pool + residency + ranking (see rig.py)."""

from __future__ import annotations

import pytest

from sglang_rimuru.adjuster import pick_restores, pick_victims

from .rig import make_rig


@pytest.fixture
def rig():
    return make_rig()


def test_first_nominations_are_the_residencys(rig) -> None:
    assert [rig.residency.eviction_candidate(l) for l in (0, 1, 2)] == [2, 2, 5]
    assert [rig.residency.restore_candidate(l) for l in (0, 1, 2)] == [7, 1, 6]
    assert pick_victims(rig.residency, rig.ranking, 1) == [(0, 2)]
    assert pick_restores(rig.residency, rig.ranking, 1) == [(2, 6)]


def test_victims_least_probable_first(rig) -> None:
    # L0 2(.06) ties L1 2(.06): layer 0 first; then L1 2, L1 3(.07), L0 5(.08);
    # layers 0 and 1 have then used their budget (limit 4 - 2 offloaded); layer 2 (.125) last
    want = [(0, 2), (1, 2), (1, 3), (0, 5), (2, 5), (2, 4)]
    for n in range(len(want) + 1):
        assert pick_victims(rig.residency, rig.ranking, n) == want[:n]
    assert pick_victims(rig.residency, rig.ranking, 100) == want


def test_victims_do_not_mutate(rig) -> None:
    before = {l: rig.residency.resident_pages(l) for l in (0, 1, 2)}
    versions = [rig.residency.version(l) for l in (0, 1, 2)]
    stats = rig.pool.stats()
    pick_victims(rig.residency, rig.ranking, 100)
    pick_restores(rig.residency, rig.ranking, 100)
    assert {l: rig.residency.resident_pages(l) for l in (0, 1, 2)} == before
    assert [rig.residency.version(l) for l in (0, 1, 2)] == versions
    assert rig.pool.stats() == stats


def test_layer_at_offload_limit_never_gives_up_experts(rig) -> None:
    for e in (5, 4):  # layer 2 to its limit: 4 offloaded
        rig.pool.free_expert_pages(rig.residency.evict(2, e))
    assert rig.residency.num_offloaded(2) == 4
    assert rig.residency.eviction_candidate(2) is None
    assert pick_victims(rig.residency, rig.ranking, 100) == [(0, 2), (1, 2), (1, 3), (0, 5)]
    # the limit holds in a deeper setting too: limit 3 with 5 resident, every layer at it
    full = make_rig(limit=3, resident=5)
    assert pick_victims(full.residency, full.ranking, 10) == []


def test_restores_most_probable_first(rig) -> None:
    # L2 6, 7 (.125) first, then L0 7 (.04); L0 6 (.02) ties L1 1 (.02): layer 0 first; then L1 0
    want = [(2, 6), (2, 7), (0, 7), (0, 6), (1, 1), (1, 0)]
    for n in range(len(want) + 1):
        assert pick_restores(rig.residency, rig.ranking, n) == want[:n]
    assert pick_restores(rig.residency, rig.ranking, 50) == want


def test_nothing_to_restore_when_all_resident() -> None:
    full = make_rig(pages=80, resident=8)
    assert pick_restores(full.residency, full.ranking, 5) == []
    # L1 0 (.01); then L0 6 (.02) ties L1 1 (.02): layer 0 first
    assert pick_victims(full.residency, full.ranking, 3) == [(1, 0), (0, 6), (1, 1)]


def test_in_flight_experts_are_skipped_and_victims_use_budget(rig) -> None:
    # (0, 2) being evicted: not nominated again, and it takes one of layer 0's two slots
    assert pick_victims(rig.residency, rig.ranking, 100, in_flight={(0, 2)}) == [
        (1, 2), (1, 3), (0, 5), (2, 5), (2, 4)]
    # (2, 6) being restored: not nominated again; restores give no budget back until complete
    assert pick_restores(rig.residency, rig.ranking, 3, in_flight={(2, 6)}) == [
        (2, 7), (0, 7), (0, 6)]
    assert pick_victims(rig.residency, rig.ranking, 100, in_flight={(2, 6)}) == [
        (0, 2), (1, 2), (1, 3), (0, 5), (2, 5), (2, 4)]


@pytest.mark.parametrize("n", [-1, True, 1.0])
def test_bad_n(rig, n) -> None:
    with pytest.raises(ValueError):
        pick_victims(rig.residency, rig.ranking, n)
