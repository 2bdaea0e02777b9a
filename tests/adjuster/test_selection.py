"""pick_victims / pick_restores on a real pool + residency + ranking (see rig.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from sglang_rimuru.adjuster import pick_restores, pick_victims
from sglang_rimuru.experts import ExpertRanking, ExpertResidency, MoEShape
from sglang_rimuru.pool import PoolGeometry, UnifiedPagePool

from .rig import make_rig


@pytest.fixture
def rig():
    return make_rig()


def test_first_picks(rig) -> None:
    # each layer's first nominations: victims 2, 2, 5 (lowest-ranked resident),
    # restores 7, 1, 6 (highest-ranked offloaded); the best over the layers wins
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
    assert pick_victims(rig.residency, rig.ranking, 100) == [(0, 2), (1, 2), (1, 3), (0, 5)]
    # the limit holds in a deeper setting too: limit 3 with 5 resident, every layer at it
    full = make_rig(limit=3, resident=5)
    assert pick_victims(full.residency, full.ranking, 10) == []


def test_restores_most_probable_first(rig) -> None:
    # L2 6, 7 (.125) first, then L0 7 (.04); L0 6 (.02) ties L1 1 (.02): layer 1 has
    # more offloaded now (2 against layer 0's 1), so it goes first; then L0 6, L1 0
    want = [(2, 6), (2, 7), (0, 7), (1, 1), (0, 6), (1, 0)]
    for n in range(len(want) + 1):
        assert pick_restores(rig.residency, rig.ranking, n) == want[:n]
    assert pick_restores(rig.residency, rig.ranking, 50) == want


def test_nothing_to_restore_when_all_resident() -> None:
    full = make_rig(pages=80, resident=8)
    assert pick_restores(full.residency, full.ranking, 5) == []
    # L1 0 (.01); then L0 6 (.02) ties L1 1 (.02): layer 0 has fewer offloaded (0 against 1)
    assert pick_victims(full.residency, full.ranking, 3) == [(1, 0), (0, 6), (1, 1)]


def test_in_flight_experts_are_skipped_and_victims_use_budget(rig) -> None:
    # (0, 2) being evicted: not nominated again, and it takes one of layer 0's two slots
    assert pick_victims(rig.residency, rig.ranking, 100, in_flight={(0, 2)}) == [
        (1, 2), (1, 3), (0, 5), (2, 5), (2, 4)]
    # (2, 6) being restored: not nominated again; restores give no budget back until complete
    assert pick_restores(rig.residency, rig.ranking, 3, in_flight={(2, 6)}) == [
        (2, 7), (0, 7), (1, 1)]
    assert pick_victims(rig.residency, rig.ranking, 100, in_flight={(2, 6)}) == [
        (0, 2), (1, 2), (1, 3), (0, 5), (2, 5), (2, 4)]


def _uniform_rig(layers=(0, 1, 2, 3), experts=8, limit=4):
    """Every expert of every layer resident, default ranking (all 1/E: every pick a tie)."""
    shape = MoEShape(layer_ids=layers, num_experts=experts, hidden=8, inter=4, top_k=2, dtype=torch.bfloat16)
    pages = 3 * experts * len(layers) + 12
    pool = UnifiedPagePool(PoolGeometry(total_bytes=pages * 64, expert_page_bytes=64, kv_page_bytes=32))
    ranking = ExpertRanking.default(shape)
    residency = ExpertResidency(shape, ranking, limit)
    residency.place_initial(pool, experts)
    return pool, ranking, residency


def test_tied_victims_rotate_over_layers() -> None:
    # The H200 run at 0dafc5d evicted 19 experts all from layer 0 (L0E59 ... L0E41).
    _, ranking, residency = _uniform_rig()
    assert pick_victims(residency, ranking, 6) == [(0, 7), (1, 7), (2, 7), (3, 7), (0, 6), (1, 6)]
    # every layer gives up to its limit before any is asked twice more than another
    picks = pick_victims(residency, ranking, 100)
    assert len(picks) == 16
    for n in range(1, 17):
        per_layer = Counter(l for l, _ in picks[:n])
        assert max(per_layer.values()) - min(per_layer.get(l, 0) for l in (0, 1, 2, 3)) <= 1


def test_tied_victims_follow_the_layers_offloaded_so_far() -> None:
    pool, ranking, residency = _uniform_rig()
    for e in (7, 6):  # layer 2 already has two out
        pool.free_expert_pages(residency.evict(2, e))
    assert pick_victims(residency, ranking, 7) == [
        (0, 7), (1, 7), (3, 7), (0, 6), (1, 6), (3, 6), (0, 5)]
    # an in-flight eviction counts as out: with (0, 7) under way, layers 1 and 3 give first
    assert pick_victims(residency, ranking, 3, in_flight={(0, 7)}) == [(1, 7), (3, 7), (0, 6)]


def test_tied_restores_go_to_the_layer_with_most_out() -> None:
    pool, ranking, residency = _uniform_rig()
    for l, e in ((0, 7), (1, 7), (1, 6), (1, 5), (3, 7), (3, 6)):
        pool.free_expert_pages(residency.evict(l, e))
    # layer 1 (3 out), then layer 3 and layer 1 (2 each: lower layer id), ...
    assert pick_restores(residency, ranking, 6) == [(1, 5), (1, 6), (3, 6), (0, 7), (1, 7), (3, 7)]


def test_ranked_victims_still_go_by_rank() -> None:
    # Only exact ties spread: layer 2's .125 experts never go before less probable ones.
    rig = make_rig(pages=80, resident=8)
    picks = pick_victims(rig.residency, rig.ranking, 12)
    probs = [rig.ranking.probability(l, e) for l, e in picks]
    assert probs == sorted(probs)


@pytest.mark.parametrize("n", [-1, True, 1.0])
def test_bad_n(rig, n) -> None:
    with pytest.raises(ValueError):
        pick_victims(rig.residency, rig.ranking, n)


def test_elastic_start_leaves_out_what_the_victims_rule_would() -> None:
    from sglang_rimuru.adjuster import pick_offloaded_at_start

    shape = MoEShape(layer_ids=(0, 1, 2), num_experts=8, hidden=8, inter=4, top_k=2, dtype=torch.bfloat16)
    uniform = ExpertRanking.default(shape)
    assert pick_offloaded_at_start(shape.layer_ids, uniform, 4, 5) == [(0, 7), (1, 7), (2, 7), (0, 6), (1, 6)]
    assert len(pick_offloaded_at_start(shape.layer_ids, uniform, 2, 100)) == 6  # the limit holds
    assert pick_offloaded_at_start(shape.layer_ids, uniform, 0, 3) == []
    # a real ranking: least probable first, exactly as pick_victims on a full residency
    full = make_rig(pages=80, resident=8)
    assert pick_offloaded_at_start((0, 1, 2), full.ranking, 4, 9) == pick_victims(full.residency, full.ranking, 9)
