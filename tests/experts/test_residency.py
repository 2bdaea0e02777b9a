"""ExpertResidency, LoadBuffers and HostExpertStore on a real pool: exact page ids."""

from __future__ import annotations

import pytest
import torch

from sglang_rimuru.experts import (
    ExpertRanking,
    ExpertResidency,
    HostExpertStore,
    LoadBuffers,
    NotEnoughPagesError,
    RankingError,
    expert_owners,
)
from sglang_rimuru.pool import ExpertKey

from .rig import make_pool, make_rig, tiny_shape

LAYER0 = {3: (0, 1, 2), 1: (3, 4, 5), 4: (6, 7, 8), 0: (9, 10, 11), 5: (12, 13, 14)}
LAYER1 = {7: (15, 16, 17), 6: (18, 19, 20), 5: (21, 22, 23), 4: (24, 25, 26), 3: (27, 28, 29)}


def test_initial_placement_page_ids_and_owners() -> None:
    rig = make_rig()
    r = rig.residency
    assert r.resident_pages(0) == LAYER0 and r.resident_pages(1) == LAYER1
    assert r.resident(0) == [3, 1, 4, 0, 5] and r.offloaded(0) == [2, 7, 6]
    assert r.resident(1) == [7, 6, 5, 4, 3] and r.offloaded(1) == [2, 1, 0]
    assert (r.num_resident(), r.num_resident(0), r.num_offloaded(1)) == (10, 5, 3)
    assert r.pages(0, 4) == (6, 7, 8) and r.pages(0, 2) is None
    assert rig.pool.expert_page_owner(7) == ExpertKey(0, 4, "w3")
    assert rig.pool.expert_page_owner(29) == ExpertKey(1, 3, "w2")
    s = rig.pool.stats()
    assert (s.expert_pages, s.other_expert_pages, s.free_expert_pages) == (30, 18, 16)
    rig.pool.check_invariants()


def test_load_buffer_page_ids_and_alternation() -> None:
    rig = make_rig()
    lb = rig.buffers
    assert [lb.pages(0, s) for s in range(3)] == [(30, 31, 32), (33, 34, 35), (36, 37, 38)]
    assert [lb.pages(1, s) for s in range(3)] == [(39, 40, 41), (42, 43, 44), (45, 46, 47)]
    assert rig.pool.expert_page_owner(44) == ("load_buffer", 1, 1, 2)
    assert [lb.buffer_of_layer(l) for l in (0, 1)] == [0, 1]
    three = LoadBuffers(tiny_shape(layer_ids=(1, 3, 5)), make_pool(tiny_shape(), 64)[1], 2)
    assert [three.buffer_of_layer(l) for l in (1, 3, 5)] == [0, 1, 0]
    with pytest.raises(ValueError, match=r"load buffer \(1, 3\) out of range"):
        lb.pages(1, 3)
    assert rig.pool.stats().other_expert_pages == 18  # owned for the server's life
    assert LoadBuffers(rig.shape, rig.pool, 0).all_pages() == []
    # the worker's copy: the same page ids, no pool
    copy = LoadBuffers.of_pages(rig.shape, 3, lb.all_pages())
    assert [copy.pages(b, s) for b in range(2) for s in range(3)] == [lb.pages(b, s) for b in range(2) for s in range(3)]
    assert not hasattr(copy, "page_pool") and not hasattr(lb, "page_pool")
    with pytest.raises(ValueError, match="need 18 distinct pages"):
        LoadBuffers.of_pages(rig.shape, 3, lb.all_pages()[:-1] + [30])


def test_offload_limit_and_resident_count_errors_name_the_flags() -> None:
    shape = tiny_shape()
    _, pool = make_pool(shape, 64)
    rank = ExpertRanking.default(shape)
    with pytest.raises(ValueError, match="--rimuru-expert-offload-limit must be in"):
        ExpertResidency(shape, rank, 9)
    r = ExpertResidency(shape, rank, 3)
    with pytest.raises(ValueError, match=r"--rimuru-resident-experts=4 would offload 4 experts per "
                                         r"layer, more than --rimuru-expert-offload-limit=3"):
        r.place_initial(pool, 4)
    with pytest.raises(ValueError, match="--rimuru-resident-experts=9 is more than the 8"):
        r.place_initial(pool, 9)
    assert pool.stats().expert_pages == 0
    r.place_initial(pool, 8)  # nothing offloaded is fine
    assert r.offloaded(0) == [] and r.num_resident() == 16
    with pytest.raises(RuntimeError, match="already ran"):
        r.place_initial(pool, 8)
    with pytest.raises(RankingError, match=r"missing MoE layer\(s\) \[1\]"):
        ExpertResidency(shape, ExpertRanking(8, {0: range(8)}, {0: [0.1] * 8}), 3)


def test_pages_too_small_for_a_matrix_are_refused_at_placement() -> None:
    shape = tiny_shape()
    _, pool = make_pool(shape, 64, kv_page_bytes=16, page_bytes=32)  # a matrix is 64 B
    r = ExpertResidency(shape, ExpertRanking.default(shape), 3)
    with pytest.raises(ValueError, match=r"the pool's expert page \(32 B\) is smaller than one expert matrix \(64 B\)"):
        r.place_initial(pool, 5)
    assert pool.stats().expert_pages == 0


def test_pool_too_small_changes_nothing() -> None:
    shape = tiny_shape()
    _, pool = make_pool(shape, 29)
    r = ExpertResidency(shape, ExpertRanking.default(shape), 3)
    with pytest.raises(NotEnoughPagesError, match="needs 30 expert pages .* the pool has 29 free"):
        r.place_initial(pool, 5)
    assert pool.stats().free_expert_pages == 29 and r.num_resident() == 0
    _, small = make_pool(shape, 17)
    with pytest.raises(NotEnoughPagesError, match="load buffers .* need 18 expert pages"):
        LoadBuffers(shape, small, 3)
    assert small.stats().free_expert_pages == 17


def test_evict_admit() -> None:
    rig = make_rig(limit=4, resident=5)  # one more eviction allowed per layer
    r, pool = rig.residency, rig.pool
    v = r.version(0)
    assert r.holder(12) == (0, 5) and r.holder(30) is None  # 30: a load-buffer page
    assert r.evict(0, 5) == (12, 13, 14)
    assert r.version(0) == v + 1
    assert pool.expert_page_owner(12) == ExpertKey(0, 5, "w1")  # not freed by evict
    assert r.offloaded(0) == [5, 2, 7, 6] and r.pages(0, 5) is None and r.holder(12) is None
    with pytest.raises(ValueError, match="already has 4 experts offloaded"):
        r.evict(0, 0)
    with pytest.raises(ValueError, match="not resident"):
        r.evict(1, 2)
    pool.free_expert_pages([12, 13, 14])
    # admit on pages the pool's owner took for it
    pages = pool.alloc_expert_pages(3, expert_owners(0, 2))
    assert pages == [12, 13, 14]
    r.admit(0, 2, pages)
    assert r.pages(0, 2) == (12, 13, 14) and r.holder(13) == (0, 2)
    assert r.resident(0) == [3, 1, 4, 0, 2] and r.offloaded(0) == [5, 7, 6]
    with pytest.raises(ValueError, match="already resident"):
        r.admit(0, 2, pages)
    # no page holds two experts; nothing changes on a refusal
    with pytest.raises(ValueError, match="page 13 of layer 1 expert 2 holds layer 0 expert 2"):
        r.admit(1, 2, (60, 13, 61))
    with pytest.raises(ValueError, match=r"needs 3 distinct expert pages \(W1, W3, W2\), got \(60, 60, 61\)"):
        r.admit(0, 5, (60, 60, 61))
    assert r.offloaded(1) == [2, 1, 0] and r.holder(60) is None
    pool.check_invariants()


def test_a_residency_built_from_a_placement_is_its_own() -> None:
    # The worker's residency starts from the scheduler's placement (plain data) and
    # shares nothing with it: changing one leaves the other as it was.
    rig = make_rig(limit=4, resident=5)
    placement = rig.residency.placement()
    assert placement == {0: LAYER0, 1: LAYER1}
    worker = ExpertResidency(rig.shape, rig.ranking, 4, resident=placement)
    assert {l: worker.resident_pages(l) for l in (0, 1)} == placement
    assert worker.holder(29) == (1, 3) and worker.version(0) == 1
    worker.evict(0, 5)
    assert rig.residency.pages(0, 5) == (12, 13, 14) and worker.pages(0, 5) is None
    placement[1].pop(7)  # the data given is not kept either
    assert worker.pages(1, 7) == (15, 16, 17)
    with pytest.raises(RuntimeError, match="already ran"):
        worker.place_initial(rig.pool, 5)
    with pytest.raises(ValueError, match=r"placement of layer 0 offloads 7 experts, more than "
                                         r"--rimuru-expert-offload-limit=4"):
        ExpertResidency(rig.shape, rig.ranking, 4, resident={0: {3: (0, 1, 2)}, 1: LAYER1})
    with pytest.raises(ValueError, match=r"placement covers layers \[0\]"):
        ExpertResidency(rig.shape, rig.ranking, 4, resident={0: LAYER0})
    with pytest.raises(ValueError, match="page 2 of layer 1 expert 3 holds layer 0 expert 3"):
        ExpertResidency(rig.shape, rig.ranking, 4, resident={0: LAYER0, 1: {**LAYER1, 3: (2, 40, 41)}})


def test_host_store_put_and_views() -> None:
    shape = tiny_shape()
    store = HostExpertStore(shape, pin_memory=True)  # no CUDA here: plain memory
    assert store.pinned is False or torch.cuda.is_available()
    assert store.nbytes == 2 * 8 * 3 * 32 * 2
    w1 = torch.arange(32, dtype=torch.bfloat16).view(4, 8)
    w3 = w1 + 100
    w2 = torch.arange(32, dtype=torch.bfloat16).view(8, 4) - 50
    store.put(1, 6, w1, w3, w2)
    assert torch.equal(store.matrix(1, 6, 0), w1.reshape(-1))
    assert torch.equal(store.matrix(1, 6, 1), w3.reshape(-1))
    assert torch.equal(store.matrix(1, 6, 2), w2.reshape(-1))
    assert store.layer_tensor(1)[6, 2].data_ptr() == store.matrix(1, 6, 2).data_ptr()  # a view
    with pytest.raises(ValueError, match=r"w2 has shape \(4, 8\), expected \(8, 4\)"):
        store.put(1, 6, w1, w3, w1)
    with pytest.raises(ValueError, match="dtype torch.float32, expected torch.bfloat16"):
        store.put(1, 6, w1.float(), w3, w2)
    with pytest.raises(ValueError, match=r"expert 8 out of range"):
        store.matrix(0, 8, 0)
    with pytest.raises(ValueError, match="matrix index"):
        store.matrix(0, 1, 3)
    with pytest.raises(ValueError, match="layer 2 is not a MoE layer"):
        store.matrix(2, 1, 0)
    w13 = torch.randn(8, 8, 8).to(torch.bfloat16)
    w2s = torch.randn(8, 8, 4).to(torch.bfloat16)
    store.put_fused(0, w13, w2s)
    assert torch.equal(store.matrix(0, 5, 0).view(4, 8), w13[5, :4])
    assert torch.equal(store.matrix(0, 5, 1).view(4, 8), w13[5, 4:])
    assert torch.equal(store.matrix(0, 5, 2).view(8, 4), w2s[5])
    with pytest.raises(ValueError, match=r"w13 has shape"):
        store.put_fused(0, w13[:, :4], w2s)


def test_place_all_but_leaves_out_exactly_the_given_experts() -> None:
    shape = tiny_shape()
    _, pool = make_pool(shape, 64)
    r = ExpertResidency(shape, ExpertRanking.default(shape), offload_limit=3)
    r.place_all_but(pool, {(0, 7), (1, 7), (0, 6)})  # (elastic start: chosen by pick_offloaded_at_start)
    assert r.offloaded(0) == [6, 7] and r.offloaded(1) == [7]
    # forward order, ranking order, three pages each, lowest ids first
    assert r.resident_pages(0) == {e: (3 * e, 3 * e + 1, 3 * e + 2) for e in range(6)}
    assert r.pages(1, 0) == (18, 19, 20)
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="already ran"):
        r.place_all_but(pool, set())


def test_place_all_but_checks_the_limit_and_the_pool_before_allocating() -> None:
    shape = tiny_shape()
    _, pool = make_pool(shape, 40)  # 40 pages < 3 x 16 experts
    r = ExpertResidency(shape, ExpertRanking.default(shape), offload_limit=2)
    with pytest.raises(ValueError, match=r"offloading \{0: 3\} experts per layer is more than --rimuru-expert-offload-limit=2"):
        r.place_all_but(pool, {(0, 7), (0, 6), (0, 5)})
    with pytest.raises(NotEnoughPagesError, match="keeping 15 experts resident over 2 MoE layers needs 45 expert pages"):
        r.place_all_but(pool, {(0, 7)})
    assert pool.free_expert_page_count() == 40  # nothing allocated
    r.place_all_but(pool, {(0, 7), (1, 7), (0, 6), (1, 6)})
    assert r.num_resident() == 12


def test_sglang_layout_places_full_layers_as_sglangs_weights() -> None:
    """Static mode's placement of a layer that keeps every expert: 3E pages in one
    allocation, W1/W3 of expert e on 2e and 2e + 1 and W2 on 2E + e from the layer's
    first page (the dummy-free rig pool starts at page 0)."""
    rig = make_rig(resident=8, pages=96, sglang_layout=True)
    r = rig.residency
    assert r.resident_pages(0) == {e: (2 * e, 2 * e + 1, 16 + e) for e in range(8)}
    assert r.resident_pages(1) == {e: (24 + 2 * e, 25 + 2 * e, 40 + e) for e in range(8)}
    assert rig.pool.expert_page_owner(7) == ExpertKey(0, 3, "w3")
    assert rig.pool.expert_page_owner(16) == ExpertKey(0, 0, "w2")
    assert rig.pool.expert_page_owner(47) == ExpertKey(1, 7, "w2")
    assert (r.sglang_layout_base(0), r.sglang_layout_base(1)) == (0, 24)
    rig.pool.check_invariants()
    # the manager's views are SGLang's tensors, in the pool's memory
    for layer in (0, 1):
        w13, w2 = rig.manager.sglang_weights(layer)
        assert torch.equal(w13, rig.w13[layer]) and torch.equal(w2, rig.w2[layer])
        assert w13.is_contiguous() and w2.is_contiguous()
        assert w13.untyped_storage().data_ptr() == rig.manager.pool_flat.untyped_storage().data_ptr()


def test_sglang_layout_only_where_a_layer_keeps_every_expert_in_order() -> None:
    # a layer with experts out is placed expert by expert, as without the layout
    part = make_rig(resident=5, sglang_layout=True)
    assert part.residency.resident_pages(0) == LAYER0 and part.residency.resident_pages(1) == LAYER1
    assert part.residency.sglang_layout_base(0) is None and part.manager.sglang_weights(0) is None
    # every expert resident without the layout: three pages an expert, not SGLang's order
    plain = make_rig(resident=8, pages=96)
    assert plain.residency.pages(0, 1) == (3, 4, 5)
    assert plain.residency.sglang_layout_base(0) is None and plain.manager.sglang_weights(1) is None
    # a fragmented pool: the layer's pages are not one run
    frag = make_rig(resident=8, pages=160, fragment=True, sglang_layout=True)
    assert frag.residency.sglang_layout_base(0) is None and frag.manager.sglang_weights(0) is None
    # pages larger than a matrix (padded): the layout holds, the views cannot
    padded = make_rig(resident=8, pages=96, sglang_layout=True, page_bytes=2 * tiny_shape().expert_page_bytes)
    assert padded.residency.sglang_layout_base(0) == 0 and padded.manager.sglang_weights(0) is None
