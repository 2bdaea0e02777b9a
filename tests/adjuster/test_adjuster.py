"""Adjuster end to end on the rig's real pool and residency (see rig.py for the page map)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sglang_rimuru.adjuster import (
    Adjuster,
    AdjusterPolicy,
    Decision,
    ExpertMove,
    MigrationOrder,
    OrderSequencer,
    decode,
    encode,
)
from sglang_rimuru.experts import expert_owners
from sglang_rimuru.pool import PoolGeometry, UnifiedPagePool

from .rig import make_rig


def adjuster_for(rig, policy: AdjusterPolicy | None = None) -> Adjuster:
    return Adjuster(policy or AdjusterPolicy(), rig.pool, rig.residency, rig.ranking)


def owned_by(pool, pages, layer, expert) -> bool:
    owners = pool.expert_page_owners()
    return [owners.get(p) for p in pages] == expert_owners(layer, expert)


# ---------------------------------------------------------------- KV shortfall -> eviction


def test_shortfall_evicts_and_pages_free_only_after_complete() -> None:
    rig = make_rig(pages=60)  # 54 pages of experts, F_b = 6 = 12 KV pages
    adj = adjuster_for(rig)
    assert rig.pool.free_expert_page_count() == 6
    assert rig.pool.missing_expert_pages(26) == 7  # (26 - 12) / 2

    order = adj.plan_round(1, 26)  # R_b 7 -> evict ceil(8/3) = 3
    assert order == MigrationOrder(
        version=1, seq=1, round=1,
        evict=(ExpertMove(0, 2, (15, 16, 17)), ExpertMove(1, 2, (33, 34, 35)),
               ExpertMove(1, 3, (30, 31, 32))),
        restore=(), reason="kv_short: R_b=7 F_b=6 in_flight_pages=0")
    # victims keep their pages until the worker confirms: not free, not allocatable
    assert rig.pool.free_expert_page_count() == 6
    assert rig.residency.is_resident(0, 2) and owned_by(rig.pool, (15, 16, 17), 0, 2)
    assert rig.pool.alloc_kv_pages(26, "waiting") is None
    assert adj.in_flight_experts() == {(0, 2), (1, 2), (1, 3)}
    adj.check_invariants()

    # next round, still in flight and still short: the shortfall is not answered twice
    assert adj.plan_round(2, 26) is None
    last = adj.stats().last
    assert (last.short_pages, last.free_pages, last.in_flight_pages) == (7, 6, 9)
    assert last.decision == Decision(0, 0, "hold")  # projected: short 0, free 9 - 7 = 2

    adj.complete(order)  # the worker finished the forward pass and freed them
    assert not rig.residency.is_resident(0, 2) and rig.residency.num_offloaded(1) == 4
    assert rig.pool.free_expert_page_count() == 15
    assert rig.pool.missing_expert_pages(26) == 0
    adj.check_invariants()
    # the first round after complete: the waiting request gets its pages
    kv = rig.pool.alloc_kv_pages(26, "waiting")
    assert kv is not None and {rig.pool.geometry.expert_page_of_kv_page(k) for k in kv} == {
        15, 16, 17, 30, 31, 32, 33, 34, 35, 54, 55, 56, 57}
    assert rig.pool.free_expert_page_count() == 2
    assert adj.plan_round(3, 0) is None  # F_b 2: inside the band
    s = adj.stats()
    assert (s.rounds, s.orders, s.evictions, s.restores, s.completed_orders) == (3, 1, 3, 0, 1)
    assert (s.in_flight_orders, s.in_flight_victim_pages, s.reserved_restore_pages) == (0, 0, 0)
    assert s.decisions == {"kv_short": 1, "low_water": 0, "high_water": 0, "hold": 2, "priced_out": 0,
                           "restore_pays": 0, "restore_priced_out": 0}


def test_in_flight_projection_matches_instant_completion() -> None:
    """Short 8: evict 3 (9 pages). One round later, still in flight, the projection
    sees 9 - 8 = 1 free page, below the low water: one pre-emptive eviction, as
    if the first order had completed at once and the KV had taken its 8 pages."""
    rig = make_rig(pages=60)
    adj = adjuster_for(rig)
    first = adj.plan_round(10, 28)  # R_b 8
    assert [m.key for m in first.evict] == [(0, 2), (1, 2), (1, 3)]
    second = adj.plan_round(11, 28)
    assert second.seq == 2 and second.reason == "low_water: R_b=8 F_b=6 in_flight_pages=9"
    assert [m.key for m in second.evict] == [(0, 5)]  # not an expert of the first order
    assert len(adj.in_flight) == 2

    instant = make_rig(pages=60)
    other = adjuster_for(instant)
    adj_order = other.plan_round(10, 28)
    other.complete(adj_order)
    assert instant.pool.alloc_kv_pages(28, "waiting") is not None  # 14 of the 15 free pages
    assert instant.pool.free_expert_page_count() == 1
    assert [m.key for m in other.plan_round(11, 0).evict] == [(0, 5)]


def test_in_flight_experts_are_not_picked_again_and_use_the_offload_budget() -> None:
    rig = make_rig(pages=60)
    adj = adjuster_for(rig)
    adj.plan_round(1, 26)  # (0, 2), (1, 2), (1, 3): layer 1 at its limit once complete
    order = adj.plan_round(2, 40)  # R_b 14, P 9 -> short 5 -> evict 2
    assert [m.key for m in order.evict] == [(0, 5), (2, 5)]
    with pytest.raises(ValueError, match="seq order; seq=1 is still in flight"):
        adj.complete(order)
    adj.complete(1)
    adj.complete(order)
    assert [rig.residency.num_offloaded(l) for l in (0, 1, 2)] == [4, 4, 3]
    adj.check_invariants()


def test_nobody_can_give() -> None:
    rig = make_rig(pages=60, limit=2)  # every layer already at its limit
    adj = adjuster_for(rig)
    assert adj.plan_round(1, 100) is None
    s = adj.stats()
    assert s.unmet_evictions == s.last.decision.evict > 0 and s.orders == 0


# ---------------------------------------------------------------- quiet pool -> restores


def test_quiet_pool_restores_into_reserved_pages() -> None:
    rig = make_rig(pages=80)  # F_b = 26
    adj = adjuster_for(rig)
    order = adj.plan_round(5, 0)  # restore min(5, (26 - 9) // 3) = 5
    assert order.reason == "high_water: R_b=0 F_b=26 in_flight_pages=0"
    assert order.evict == ()
    assert order.restore == (
        ExpertMove(2, 6, (54, 55, 56)), ExpertMove(2, 7, (57, 58, 59)),
        ExpertMove(0, 7, (60, 61, 62)), ExpertMove(1, 1, (63, 64, 65)),
        ExpertMove(0, 6, (66, 67, 68)))
    # reserved now: owned by the experts' keys, F_b stays at the high water or above
    for m in order.restore:
        assert owned_by(rig.pool, m.pages, m.layer, m.expert)
        assert not rig.residency.is_resident(m.layer, m.expert)
    assert rig.pool.free_expert_page_count() == 11
    assert adj.stats().reserved_restore_pages == 15
    # the KV allocator cannot take them: it gets everything else and then nothing
    cap = rig.pool.kv_capacity_now()
    assert cap == 22
    kv = rig.pool.alloc_kv_pages(cap, "burst")
    assert {rig.pool.geometry.expert_page_of_kv_page(k) for k in kv} == set(range(69, 80))
    assert rig.pool.alloc_kv_pages(1, "more") is None
    for m in order.restore:
        assert owned_by(rig.pool, m.pages, m.layer, m.expert)
    adj.check_invariants()

    adj.complete(order)  # copied by the worker: resident on exactly those pages
    assert rig.residency.pages(2, 6) == (54, 55, 56)
    assert rig.residency.offloaded(2) == [] and rig.residency.offloaded(1) == [0]
    assert adj.stats().reserved_restore_pages == 0
    adj.check_invariants()
    # the burst took all free pages: the next round gives one expert back (low water)
    nxt = adj.plan_round(6, 0)
    assert nxt.reason == "low_water: R_b=0 F_b=0 in_flight_pages=0"
    assert [m.key for m in nxt.evict] == [(0, 6)]


def test_no_restores_while_short() -> None:
    rig = make_rig(pages=80)
    adj = adjuster_for(rig, AdjusterPolicy())
    first = adj.plan_round(1, 90)  # 52 KV pages free -> R_b 19 -> evict 7 ... (limited to 6)
    assert len(first.evict) == 6 and adj.stats().unmet_evictions == 1
    # demand drops a little: R_b 1, P 18 -> projected free 17 > 9, yet the pool is short now
    second = adj.plan_round(2, 54)
    assert second is None and adj.stats().last.decision.restore == 2


def test_abort_releases_reserved_pages() -> None:
    rig = make_rig(pages=80)
    adj = adjuster_for(rig)
    order = adj.plan_round(1, 0)
    adj.abort(order.seq)
    assert rig.pool.free_expert_page_count() == 26 and adj.in_flight == ()
    assert rig.residency.num_resident() == 18
    adj.check_invariants()
    again = adj.plan_round(2, 0)
    assert again.seq == 2 and again.restore == order.restore  # same experts, same pages
    with pytest.raises(ValueError, match="no migration order seq=1 in flight"):
        adj.complete(order)
    s = adj.stats()
    assert (s.orders, s.aborted_orders, s.restores) == (2, 1, 10)


# ---------------------------------------------------------------- contract checks


def test_complete_checks_before_changing_anything() -> None:
    rig = make_rig(pages=80)
    adj = adjuster_for(rig)
    order = adj.plan_round(1, 0)
    forged = MigrationOrder(1, order.seq, order.round, order.evict, order.restore[:1], "x")
    with pytest.raises(ValueError, match="differs from the one planned"):
        adj.complete(forged)
    with pytest.raises(ValueError, match="no migration order seq=9"):
        adj.complete(9)
    # someone else took one of the reserved pages: refused, nothing half-done
    rig.pool.free_expert_pages([order.restore[-1].pages[0]])
    with pytest.raises(ValueError, match="restore of layer 0 expert 6 onto"):
        adj.complete(order)
    assert all(not rig.residency.is_resident(m.layer, m.expert) for m in order.restore)
    assert len(adj.in_flight) == 1


def test_plan_round_arguments() -> None:
    rig = make_rig()
    adj = adjuster_for(rig)
    adj.plan_round(3, 0)
    with pytest.raises(ValueError, match="round_no must increase: got 3 after 3"):
        adj.plan_round(3, 0)
    for bad in ((-1, 0), (4, -1), (4, True), (4.0, 0)):
        with pytest.raises(ValueError):
            adj.plan_round(*bad)


def test_constructor_checks() -> None:
    rig = make_rig()
    with pytest.raises(ValueError, match="pages_per_expert=2"):
        Adjuster(AdjusterPolicy(pages_per_expert=2, restore_high_water=9), rig.pool,
                 rig.residency, rig.ranking)
    other = UnifiedPagePool(PoolGeometry(total_bytes=64 * 10, expert_page_bytes=64,
                                         kv_page_bytes=32))
    # the adjuster's residency is its own view of its own pool: placed there, or refused
    with pytest.raises(ValueError, match=r"the residency has layer 0 expert 3 on pages \(0, 1, 2\), which "
                                         r"the adjuster's page pool does not hold for it"):
        Adjuster(AdjusterPolicy(), other, rig.residency, rig.ranking)


# ---------------------------------------------------------------- randomized


def test_random_rounds_keep_every_invariant() -> None:
    """Bursts and quiet spells of KV demand (a FIFO waiting queue, as SGLang's), a
    worker that lags 0-3 orders behind and sometimes refuses one; every order crosses
    encode/decode and the worker's sequencer; invariants after every step."""
    rng = random.Random(1234)
    rig = make_rig(pages=90, limit=5, resident=6)
    pool, res = rig.pool, rig.residency
    adj = adjuster_for(rig)
    worker = OrderSequencer()
    queue: list[MigrationOrder] = []  # received by the worker, not yet confirmed
    running: list[list[int]] = []  # KV pages of running requests
    waiting: list[int] = []  # KV pages wanted by waiting requests, FIFO
    seen = {"evict": 0, "restore": 0, "abort": 0, "max_in_flight": 0, "short": 0}

    for rnd in range(1, 1201):
        burst = (rnd // 150) % 2 == 1
        for i in reversed(range(len(running))):  # requests finish
            if rng.random() < (0.05 if burst else 0.3):
                pool.free_kv_pages(running.pop(i))
        if sum(waiting) < 60:  # a bounded queue: the rest is turned away
            waiting += [rng.randrange(1, 24) for _ in range(rng.choice([0, 1, 2] if burst else [0, 0, 1]))]
        while waiting:  # admit in order while pages last
            got = pool.alloc_kv_pages(waiting[0], f"r{rnd}")
            if got is None:
                break
            running.append(got)
            waiting.pop(0)
        need = sum(waiting)
        seen["short"] += pool.missing_expert_pages(need) > 0
        free_before = pool.free_expert_page_count()
        order = adj.plan_round(rnd, need)
        adj.check_invariants()
        if order is not None:
            assert pool.free_expert_page_count() == free_before - 3 * len(order.restore)
            for m in order.evict:
                assert res.pages(m.layer, m.expert) == m.pages  # still resident and owned
            back = decode(encode(order))
            assert back == order
            worker.accept(back)
            queue.append(back)
            seen["evict"] += len(order.evict)
            seen["restore"] += len(order.restore)
        seen["max_in_flight"] = max(seen["max_in_flight"], len(adj.in_flight))
        # the worker confirms the oldest orders, lagging behind
        while queue and (len(queue) > 3 or rng.random() < 0.5):
            done = queue.pop(0)
            if rng.random() < 0.05:
                adj.abort(done)
                seen["abort"] += 1
            else:
                adj.complete(done)
            adj.check_invariants()
        for layer in res.shape.layer_ids:
            assert res.num_offloaded(layer) <= res.offload_limit

    while queue:
        adj.complete(queue.pop(0))
    for kv in running:
        pool.free_kv_pages(kv)
    adj.check_invariants()
    assert adj.in_flight == () and pool.stats().kv_pages_used == 0
    s = adj.stats()
    assert s.orders == worker.last_seq == adj.last_seq
    assert s.completed_orders + s.aborted_orders == s.orders
    assert s.evictions == seen["evict"] and s.restores == seen["restore"]
    # the sequence exercised what it is meant to
    assert seen["evict"] > 50 and seen["restore"] > 50 and seen["abort"] > 0
    assert seen["max_in_flight"] >= 3 and seen["short"] > 50 and s.unmet_evictions > 0
    assert all(v > 0 for r, v in s.decisions.items() if r not in ("priced_out", "restore_pays", "restore_priced_out")), s.decisions  # no cost model


# --- a cost model: evictions must pay for their PCIe time (issue 12) -------------------

def priced(rig, expert_ms: float) -> Adjuster:
    from sglang_rimuru.adjuster.cost import CostModel

    return Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                    cost=CostModel(expert_ms=expert_ms, base_ms=3.7, per_request_ms=0.023))


def test_cheap_pcie_evicts_as_the_paper_does():
    from sglang_rimuru.adjuster import Load

    rig = make_rig()  # F_b = 6, 20 KV pages needed: R_b = 4, two victims
    order = priced(rig, expert_ms=1e-6).plan_round(0, 20, Load(running=30, admits=1))
    assert [(m.layer, m.expert) for m in order.evict] == [(0, 2), (1, 2)]
    assert order.reason.startswith("kv_short")


def test_expensive_pcie_prices_the_eviction_out():
    from sglang_rimuru.adjuster import Load

    rig = make_rig()
    adj = priced(rig, expert_ms=5.0)  # each victim costs more than the request it admits
    assert adj.plan_round(0, 20, Load(running=30, admits=1)) is None
    s = adj.stats()
    assert s.decisions["priced_out"] == 1 and s.evictions == 0 and s.last.decision.reason == "priced_out"
    # nothing running: admitting is pure gain, whatever the price
    assert adj.plan_round(1, 20, Load(running=0, admits=1)).evict
    # without a load the paper's thresholds decide alone
    assert priced(make_rig(), expert_ms=5.0).plan_round(0, 20).evict


def test_urgent_decode_shortfall_keeps_or_retracts_by_price():
    from sglang_rimuru.adjuster import Load

    assert priced(make_rig(), expert_ms=1e-6).plan_round(0, 20, Load(running=8, admits=1, urgent=True)).evict
    assert priced(make_rig(), expert_ms=50.0).plan_round(0, 20, Load(running=8, admits=1, urgent=True)) is None
    # the last running request is never retracted for a price
    assert priced(make_rig(), expert_ms=50.0).plan_round(0, 20, Load(running=1, admits=1, urgent=True)).evict


def test_token_probabilities_follow_the_ranking_scaled_to_top_k():
    rig = make_rig()
    adj = adjuster_for(rig)
    # rig ranking: layer 0 offloads experts 7 (.04) and 6 (.02), layer 1 experts 1 (.02) and 0 (.01)
    # (both layers' probabilities sum to .95), layer 2 experts 6 and 7 (.125 each, sum 1); top_k = 2
    s = 2 / 0.95
    want = [.04 * s, .02 * s, .02 * s, .01 * s, .25, .25]
    assert sorted(adj.offloaded_token_probabilities()) == pytest.approx(sorted(want))


def test_no_ratchet_an_eviction_must_beat_bringing_experts_back():
    """The KV the running requests hold prices the alternative: fewer requests, experts back
    (cost.py). Here the marginal test alone would evict four experts for eight requests;
    bringing layer 2's hot experts back into the KV of a few requests beats it."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def rig_with_kv():
        rig = make_rig(pages=100)  # 46 free expert pages
        assert rig.pool.alloc_kv_pages(92) is not None  # all of them: 23 requests of 4 KV pages
        return rig

    cost = CostModel(expert_ms=0.1, base_ms=1.0, per_request_ms=0.05)
    load = Load(running=23, admits=8)
    free = Adjuster(AdjusterPolicy(), (r := rig_with_kv()).pool, r.residency, r.ranking,
                    cost=dataclasses.replace(cost, expert_ms=1e-9))
    victims = [(m.layer, m.expert) for m in free.plan_round(0, 20, load).evict]
    assert len(victims) == 4
    adj = Adjuster(AdjusterPolicy(), (r := rig_with_kv()).pool, r.residency, r.ranking, cost=cost)
    offloaded = adj.offloaded_token_probabilities()
    new = [adj._token_p[l][e] for l, e in victims]
    assert cost.eviction_pays(23, 8, offloaded, new)  # the marginal test alone
    kv_per_expert = 3 * 64 / 32  # three expert pages of two KV pages
    assert not cost.eviction_pays(23, 8, offloaded, new, 92 / 23, kv_per_expert)
    assert adj.plan_round(0, 20, load) is None
    assert adj.stats().decisions["priced_out"] == 1


def test_a_queue_prices_the_eviction_at_the_batch_the_kv_will_hold():
    """Two requests run, forty wait: the freed KV fills either way, so victims are
    priced at the batch the KV holds (23 requests of 4 pages), where every step reads
    them, not at today's batch of two, where they look almost free."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def plan(waiting):
        rig = make_rig(pages=100)  # 46 free expert pages: 92 KV pages
        for _ in range(2):
            assert rig.pool.alloc_kv_pages(4) is not None
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=0.05, base_ms=0.1, per_request_ms=0.01))
        return adj, adj.plan_round(0, 100, Load(running=2, admits=2, waiting=waiting))

    _, order = plan(waiting=0)  # nothing waits beyond the head: today's batch decides
    assert len(order.evict) == 3
    adj, order = plan(waiting=40)
    # no eviction; the rig's hot offloaded experts (layer 2, p = .25) come back instead
    assert not order.evict and order.reason.startswith("restore_pays")


def test_between_requests_an_eviction_is_free_only_if_the_head_cannot_run_at_all():
    """Nothing running, a queue waiting: the head's pages per request say how many the
    KV holds without evicting. One or more: priced as usual (here PCIe is dear: no);
    none: evicting is the only way to run anything (a CPU server evicted here because
    it priced every gap between requests as pure gain)."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def plan(kv_pages_needed):
        rig = make_rig(pages=100)  # 46 free expert pages: 92 KV pages, nothing used
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=1e3, base_ms=1.0, per_request_ms=0.05))
        return adj, adj.plan_round(0, kv_pages_needed, Load(running=0, admits=2, waiting=5))

    adj, order = plan(100)  # two requests of 50 pages: one fits in 92
    assert order is None and adj.stats().decisions["priced_out"] == 1
    adj, order = plan(200)  # two of 100: none fits
    assert order is not None and order.evict


def test_while_requests_run_the_victims_buy_what_their_kv_holds_not_the_heads_count():
    """Two long requests run (40 KV pages each), forty short ones wait and the head
    probe says twenty of them would get in with the victims' pages. They would, and
    then grow into the running requests' size while the victims stay out: the KV the
    victims free holds no third request of that size, so the eviction buys nothing.
    (On the H200 a burst's first eviction, 6 running and 144 waiting, passed on the
    head's count.) With nothing running the head's count stands (the test above)."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def plan(running):
        rig = make_rig(pages=100)  # 46 free expert pages: 92 KV pages
        for _ in range(running):
            assert rig.pool.alloc_kv_pages(40) is not None
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=0.05, base_ms=0.1, per_request_ms=0.01))
        return adj, adj.plan_round(0, 100, Load(running=running, admits=20, waiting=40))

    adj, order = plan(running=2)
    assert order is None and adj.stats().decisions["priced_out"] == 1
    # the same victims at the same price pay for twenty requests (the old count)
    offloaded, new = adj.offloaded_token_probabilities(), [adj._token_p[l][e] for l, e in ((0, 5), (1, 2))]
    assert adj.cost.eviction_pays(2, 20, offloaded, new)


def test_while_requests_wait_offloaded_experts_come_back_when_their_price_says_so():
    """The thresholds restore nothing while the queue's head is short, and SGLang's queue
    takes every page that comes free: experts an eviction sent out stayed out for a whole
    burst on the H200. With a cost model, whole free expert pages the head cannot use
    yet take back the experts whose PCIe time costs more than the requests those pages
    would hold (the mirror of an eviction's price)."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def plan(expert_ms, waiting=40):
        rig = make_rig(pages=100)
        for _ in range(10):  # ten requests of 4 KV pages run, 26 whole expert pages free
            assert rig.pool.alloc_kv_pages(4) is not None
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=expert_ms, base_ms=0.1, per_request_ms=0.01))
        cap = rig.pool.stats().kv_pages_used + rig.pool.kv_capacity_now()
        return adj, cap, adj.plan_round(0, 100, Load(running=10, admits=20, waiting=waiting))

    _, _, order = plan(1e-6)  # PCIe nearly free: the head's shortfall is met by evictions
    assert len(order.evict) == 6 and not order.restore
    adj, _, order = plan(0.01)  # neither an eviction nor a restore pays
    assert order is None and adj.stats().decisions["priced_out"] == 1
    adj, cap, order = plan(0.05)
    assert not order.evict and order.reason == "restore_pays: R_b=24 F_b=26 in_flight_pages=0"
    assert [(m.layer, m.expert) for m in order.restore] == [(2, 6), (2, 7), (0, 7), (1, 1), (0, 6)]
    assert adj.page_pool.free_expert_page_count() == 26 - 15
    # by hand: the KV's batch at 4 pages a request, with and without the 5 x 6 KV pages
    cost = adj.cost
    out = sorted(adj.offloaded_token_probabilities())  # all six, none complete yet
    rest = list(out)
    for m in order.restore:
        rest.remove(adj._token_p[m.layer][m.expert])
    assert len(rest) == 1
    now, after = cost.throughput(min(50, cap // 4), out), cost.throughput(min(50, (cap - 30) // 4), rest)
    assert after > 1.01 * now
    # nothing waits: the thresholds alone (a queue is what would fill the pages)
    assert not plan(0.05, waiting=0)[2].reason.startswith("restore_pays")
    # the high water stays free for the running requests' growth: 26 - 9 pages hold 5
    # restores, 11 - 9 none (a restore there made the next decode shortfall evict again)
    rig = make_rig(pages=100)
    for _ in range(10):
        assert rig.pool.alloc_kv_pages(4) is not None
    assert rig.pool.alloc_kv_pages(30) is not None  # 15 more pages: 11 whole ones free
    assert rig.pool.free_expert_page_count() == 11
    adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                   cost=CostModel(expert_ms=0.05, base_ms=0.1, per_request_ms=0.01))
    order = adj.plan_round(0, 100, Load(running=11, admits=20, waiting=40))
    assert order is None or not order.restore


def test_no_pre_emptive_first_eviction_where_it_turns_prefill_eager():
    """Low water with every expert resident: a free expert (PCIe at no cost) would go
    pre-emptively; with prefill graphs on, the first one out turns every longer prefill
    eager (cost.py's eager_prefill_share), which no pre-emptive eviction is worth."""
    import dataclasses

    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def low_water_rig():
        rig = make_rig(pages=80, resident=8)  # every expert resident
        per_page = len(rig.pool.geometry.kv_pages_of_expert_page(0))
        while rig.pool.free_expert_page_count() > 1:
            assert rig.pool.alloc_kv_pages(per_page, "running") is not None
        return rig

    free = CostModel(expert_ms=1e-9, base_ms=3.7, per_request_ms=0.023)
    rig = low_water_rig()
    order = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking, cost=free).plan_round(
        0, 0, Load(running=30, admits=1))
    assert order is not None and order.reason.startswith("low_water")
    rig = low_water_rig()
    adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                   cost=dataclasses.replace(free, eager_prefill_share=0.2))
    assert adj.plan_round(0, 0, Load(running=30, admits=1)) is None
    assert adj.stats().decisions["priced_out"] == 1
    # skewed routing: the coldest experts (a token picks layer 1's expert 0 with 0.021, layer 0's
    # expert 6 and layer 1's expert 1 with 0.042) under replay_max_p leave the prefills
    # replaying, so they go as they would without prefill graphs
    rig = low_water_rig()
    adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                   cost=dataclasses.replace(free, eager_prefill_share=0.2, replay_max_p=0.06))
    order = adj.plan_round(0, 0, Load(running=30, admits=1))
    assert order is not None and order.reason.startswith("low_water")
    assert all(adj._token_p[m.layer][m.expert] <= 0.06 for m in order.evict)


def test_leaving_every_expert_resident_is_priced_as_the_whole_move():
    """Every expert resident, 4 requests of 4 KV pages running, 40 waiting, the head one
    request short. One cold victim (layer 1's expert 0) admits one more request: +19 % of
    decode throughput, less than the eager-prefill share it would start paying. The
    coldest experts the limit lets go admit many more and win it back (so the first goes);
    when every read is dear they do not."""
    import dataclasses

    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def queued_rig():
        rig = make_rig(pages=80, resident=8)  # every expert resident, 8 free expert pages
        assert rig.pool.alloc_kv_pages(16, "running") is not None  # all of them: 4 requests x 4
        return rig

    cheap = CostModel(expert_ms=0.1, base_ms=1.0, per_request_ms=0.05, eager_prefill_share=0.2)
    load = Load(running=4, admits=1, waiting=40)
    # the shortfall's victim alone: 5 / (1.25 + 0.01) * 0.8 = 3.17 tokens/ms against 3.33 now
    assert not cheap.eviction_pays(4, 1, [], [0.02], 4, 6)
    rig = queued_rig()
    adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking, cost=cheap)
    order = adj.plan_round(0, 4, load)
    assert order is not None and [m.key for m in order.evict] == [(1, 0)]
    # the same with reads a hundred times dearer: no move out of the resident state pays
    rig = queued_rig()
    dear = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                    cost=dataclasses.replace(cheap, expert_ms=10.0))
    assert dear.plan_round(0, 4, load) is None
    assert dear.stats().decisions["priced_out"] == 1
    # a cold victim under replay_max_p keeps the prefills replaying: priced on decode alone
    # (p = 0.021: 5 / (1.25 + touched(0.021, 5) * 0.1) = 3.97 tokens/ms against 3.33), no larger
    # move asked
    rig = queued_rig()
    skew = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                    cost=dataclasses.replace(cheap, replay_max_p=0.06))
    order = skew.plan_round(0, 4, load)
    assert order is not None and [m.key for m in order.evict] == [(1, 0)]
    assert skew._leaving_memo is None


def test_the_last_experts_stay_out_while_leaving_would_pay_again():
    """Bringing the last offloaded experts back earns the eager-prefill share, so the
    priced restore would take back a cold expert that the whole-move price had just let
    go, and the next shortfall would send it out again. It stays out while leaving
    would pay from the state the restore makes; where reads are dear it comes back."""
    import dataclasses

    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    cheap = CostModel(expert_ms=0.1, base_ms=1.0, per_request_ms=0.02, eager_prefill_share=0.2)

    def one_cold_out(cost):
        rig = make_rig(pages=92, resident=8)  # every expert resident, 20 free expert pages
        kv = rig.pool.alloc_kv_runs([4] * 10)  # all of them: 10 requests x 4 KV pages
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking, cost=cheap)
        order = adj.plan_round(0, 4, Load(running=10, admits=1, waiting=40))
        assert [m.key for m in order.evict] == [(1, 0)]
        adj.complete(order)
        rig.pool.free_kv_pages(kv[16:])  # six requests finish: 4 run, 15 whole pages free
        adj.cost = cost
        return rig, adj

    load = Load(running=4, admits=1, waiting=40)
    rig, adj = one_cold_out(cheap)
    assert rig.pool.free_expert_page_count() == 15
    assert adj._restores_that_pay(load, 15, rig.pool.stats(), ()) == []
    rig, adj = one_cold_out(dataclasses.replace(cheap, expert_ms=10.0))  # reads dear: leaving would not pay
    assert adj._restores_that_pay(load, 15, rig.pool.stats(), ()) == [(1, 0)]


def test_a_larger_move_takes_each_layers_coldest_still_in_the_pool():
    """``_leave_candidates``: what a move out of a replaying state could still send out,
    per layer its coldest experts not out, up to the offload limit (4) less those out."""
    rig = make_rig(pages=80, resident=8)  # every expert resident
    adj = adjuster_for(rig)
    tp = adj._token_p

    def probs(keys):
        return pytest.approx(sorted(tp[l][e] for l, e in keys))

    coldest = {0: [6, 7, 2, 5], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3]}  # rig.py's PROBS; layer 2 uniform: by id
    assert adj._leave_candidates(frozenset()) == probs([(l, e) for l, es in coldest.items() for e in es])
    rest = [(l, e) for l in (0, 2) for e in coldest[l]]
    # layer 1's coldest (expert 0) out: room for three more there, its next coldest
    assert adj._leave_candidates(frozenset({(1, 0)})) == probs(rest + [(1, 1), (1, 2), (1, 3)])
    # layer 1's hottest (expert 7) out: room for three, its three coldest
    assert adj._leave_candidates(frozenset({(1, 7)})) == probs(rest + [(1, 0), (1, 1), (1, 2)])
    # layer 0 at its limit: nothing more from it
    assert adj._leave_candidates(frozenset({(0, 6), (0, 7), (0, 2), (0, 3)})) == probs(
        [(l, e) for l in (1, 2) for e in coldest[l]])


def test_bringing_back_the_experts_that_make_prefills_eager_earns_the_share():
    """6 of 8 resident a layer: layers 0 and 1 have their two coldest out (a token picks
    them with 0.021-0.084), layer 2 (uniform, 0.25) two as well. With ``replay_max_p``
    0.09 only layer 2's make the prefills eager: bringing those two back earns the
    eager-prefill share, so they come back while reads are cheap and the cold ones may
    stay out. Where every routed expert makes prefills eager (``replay_max_p`` 0, uniform
    semantics) no partial restore earns it, and with cheap reads nothing comes back."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def restores(replay_max_p):
        rig = make_rig(pages=80)  # 54 pages of experts, 26 free
        assert [rig.residency.offloaded(l) for l in (0, 1, 2)] == [[7, 6], [1, 0], [6, 7]]
        assert rig.pool.alloc_kv_runs([4] * 4) is not None  # 4 requests of 4 KV pages: 18 pages free
        cost = CostModel(expert_ms=0.1, base_ms=1.0, per_request_ms=0.02, eager_prefill_share=0.2,
                         replay_max_p=replay_max_p)
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking, cost=cost)
        assert cost.eager(adj.offloaded_token_probabilities())
        back = adj._restores_that_pay(Load(running=4, admits=1, waiting=40), 18, rig.pool.stats(), ())
        left = [adj._token_p[l][e] for l in (0, 1, 2) for e in rig.residency.offloaded(l) if (l, e) not in back]
        return back, cost.eager(left)

    back, still_eager = restores(0.09)
    assert back[:2] == [(2, 6), (2, 7)] and not still_eager
    assert restores(0.0) == ([], True)


def test_while_requests_wait_the_high_water_restores_only_what_pays():
    """R_b = 0 and 26 whole expert pages free, so the paper's rule restores five: but ten
    requests run and forty wait, and SGLang's queue takes every page that comes free.
    On the H200 (skewed routing, 20 req/s) five cold experts came back at 76 free pages
    with 7 waiting and went out again 0.3 s later, a dozen times a burst. With a cost
    model the restore is priced: where PCIe is cheap nothing comes back (the KV holds
    more requests), where it is dear the hot ones do; with nothing waiting the
    thresholds restore as before (load fell: bring experts back)."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    def plan(expert_ms, waiting=40, cost=True):
        rig = make_rig(pages=100)
        for _ in range(10):  # ten requests of 4 KV pages run, 26 whole expert pages free
            assert rig.pool.alloc_kv_pages(4) is not None
        model = CostModel(expert_ms=expert_ms, base_ms=0.1, per_request_ms=0.01) if cost else None
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking, cost=model)
        return adj, adj.plan_round(0, 0, Load(running=10, admits=1, waiting=waiting))

    adj, order = plan(1e-6)  # cheap PCIe: the pages hold more of the queue
    assert order is None and adj.stats().decisions["restore_priced_out"] == 1
    assert adj.page_pool.free_expert_page_count() == 26
    adj, order = plan(0.05)  # dear: the hot offloaded experts (layer 2, p = .125) pay
    assert order.reason == "restore_pays: R_b=0 F_b=26 in_flight_pages=0"
    assert [(m.layer, m.expert) for m in order.restore][:2] == [(2, 6), (2, 7)]
    for kwargs in (dict(waiting=0), dict(cost=False)):  # nothing waits / the paper's rule
        adj, order = plan(1e-6, **kwargs)
        assert order.reason == "high_water: R_b=0 F_b=26 in_flight_pages=0"
        assert len(order.restore) == 5


def test_a_queue_carries_on_a_step_that_gains_less_than_the_margin():
    """23 requests of 4 KV pages fill the pool, 40 wait, the head 10 expert pages short:
    four victims free the KV of 6 more. At a large batch one request is a small share of
    a step, so a shortfall's move gains less than the margin however clearly it pays (on
    one H100, Qwen3-30B-A3B, 11 victims for 2 more of 267 gained +0.5 % against 1 %, and
    the queue waited for 149 rounds). Here the margin is 10 % to show it at the rig's
    size: a move that gains (+6.2 %) is priced as the first step of the larger move the
    queue would carry on; one whose larger moves do not clear the margin (+3.7 %), or
    that loses (-2.6 %), stays out; with no queue the step alone decides."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    victims = [(0, 2), (1, 2), (1, 3), (0, 5)]  # the four coldest resident ones the limit (6) lets go

    def plan(expert_ms, waiting=40):
        rig = make_rig(pages=100, limit=6)  # 46 free expert pages: 92 KV pages
        assert rig.pool.alloc_kv_runs([4] * 23) is not None
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=expert_ms, base_ms=1.0, per_request_ms=0.05, margin=0.1))
        out = adj.offloaded_token_probabilities()
        order = adj.plan_round(0, 20, Load(running=23, admits=1, waiting=waiting))
        return adj, out, order

    def step_gain(adj, out):  # 4 victims, 24 KV pages: 29 requests instead of 23
        c, new = adj.cost, [adj._token_p[l][e] for l, e in victims]
        return c.throughput(29, out + new) / max(c.throughput(23, out), c.restored_throughput(23, out, 4, 6))

    adj, out, order = plan(0.03)
    assert step_gain(adj, out) == pytest.approx(1.0622, abs=1e-4)
    assert order.reason == "kv_short: R_b=10 F_b=0 in_flight_pages=0"
    assert [m.key for m in order.evict] == victims
    assert adj._leaving_memo[1] is True  # the larger move was asked, and pays
    # what the round priced (the controller logs it with a priced-out round)
    price = adj.last_price
    assert (price.batch, price.admits, price.victims, price.kv_per_request, price.larger_move) == (23, 6, 4, 4.0, True)
    assert price.after / price.reference == pytest.approx(1.0622, abs=1e-4)
    adj, out, order = plan(0.05)
    assert step_gain(adj, out) == pytest.approx(1.0372, abs=1e-4)
    assert order is None and adj.stats().decisions["priced_out"] == 1 and adj._leaving_memo[1] is False
    assert adj.last_price.larger_move is False
    adj, out, order = plan(0.1)
    assert step_gain(adj, out) == pytest.approx(0.9736, abs=1e-4)
    assert order is None and adj._leaving_memo is None  # a step that loses asks no larger move
    assert adj.last_price.larger_move is None and adj.last_price.after < adj.last_price.reference
    adj, _, order = plan(0.03, waiting=0)
    assert order is None and adj.stats().decisions["priced_out"] == 1 and adj._leaving_memo is None
    # no queue: priced at today's batch, for the head's one request
    assert adj.last_price[:3] == (23, 1, 4)
    # no shortfall: the low water's pre-emptive price is no shortfall's
    assert adj.plan_round(1, 0, Load(running=23, admits=1)).reason.startswith("low_water")
    assert adj.last_price is None


def test_a_refused_head_is_priced_at_sglangs_size_where_the_running_size_holds_everyone():
    """Ten requests of 4 KV pages run, five wait, and SGLang refuses the head 10 expert pages
    short, although 52 KV pages are free: at the running requests' size (4) the KV holds
    23, every waiting request. SGLang's admission also counts what the running requests
    will still take (its decode reservation). Priced at their size no victim admitted
    anyone (and a restore of free pages cost no request, so cheap reads brought experts
    back while the head waited); on one H100 every logged priced-out round of a Qwen3
    burst said "admit none". At SGLang's own size, the KV holding the running ten and no
    more (9.2 pages each), the four victims admit two."""
    from sglang_rimuru.adjuster import Load
    from sglang_rimuru.adjuster.cost import CostModel

    victims = [(0, 2), (1, 2), (1, 3), (0, 5)]

    def plan(expert_ms, waiting=5):
        rig = make_rig(pages=100, limit=6)
        assert rig.pool.alloc_kv_runs([4] * 10) is not None
        assert (rig.pool.stats().kv_pages_used, rig.pool.kv_capacity_now()) == (40, 52)
        adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking,
                       cost=CostModel(expert_ms=expert_ms, base_ms=1.0, per_request_ms=0.05))
        load = Load(running=10, admits=1, waiting=waiting)
        return adj, load, adj.plan_round(0, 52 + 20, load)

    adj, load, order = plan(0.01)
    assert order.reason == "kv_short: R_b=10 F_b=26 in_flight_pages=0"
    assert [m.key for m in order.evict] == victims and not order.restore
    assert adj.last_price[:3] == (10, 2, 4) and adj.last_price.kv_per_request == pytest.approx(9.2)
    assert adj._admission_size(load, 92, 4.0, refused=True) == pytest.approx(9.2)
    assert adj._admission_size(load, 92, 4.0, refused=False) == 4.0  # nothing refused: their size
    # twenty waiting: the KV at their size (23) does not hold everyone (30), their size stands
    assert adj._admission_size(load._replace(waiting=20), 92, 4.0, refused=True) == 4.0
    adj, _, order = plan(0.1)  # reads dear: the two requests do not pay for four experts
    assert order is None and adj.stats().decisions["priced_out"] == 1
