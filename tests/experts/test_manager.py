"""ExpertManager on CPU: exact tables, load-buffer slots, prefetch hit/miss, alternation,
residency changes reaching the tables only between forward passes."""

from __future__ import annotations

import pytest
import torch

from sglang_rimuru.experts import BufferContent, ExpertManager, ExpertStats, LoadBuffers
from sglang_rimuru.pool import PoolBuffer, PoolGeometry

from .rig import host_row, identity_gates, make_rig, page_holds, rows, tiny_shape

LAYER0 = {3: (0, 1, 2), 1: (3, 4, 5), 4: (6, 7, 8), 0: (9, 10, 11), 5: (12, 13, 14)}
LAYER1 = {7: (15, 16, 17), 6: (18, 19, 20), 5: (21, 22, 23), 4: (24, 25, 26), 3: (27, 28, 29)}
XB = 192  # bytes of one expert (3 x 32 bf16)


def ids(*pairs) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int32)


def tokens(*picks: dict[int, float]) -> torch.Tensor:
    """Hidden states whose identity-gate logits are ``picks`` (feature e -> value)."""
    h = torch.zeros(len(picks), 8, dtype=torch.bfloat16)
    for t, p in enumerate(picks):
        for e, v in p.items():
            h[t, e] = v
    return h


def test_initial_tables_are_resident_pages_and_host_pages() -> None:
    m = make_rig().manager
    assert rows(m.table(0)) == LAYER0 and rows(m.table(1)) == LAYER1
    t = m.table(0)
    assert t.dtype == torch.int32 and tuple(t.shape) == (8, 3)
    assert [t[e].tolist() for e in (2, 6, 7)] == [host_row(2), host_row(6), host_row(7)]
    assert m.host_pages(0).data_ptr() == m.host_store.layer_tensor(0).data_ptr()
    assert m.stats() == ExpertStats()


def test_forward_with_prefetch_hit_miss_and_stale_rows() -> None:
    rig = make_rig()
    m = rig.manager
    m.begin_forward()
    home = m.table(0).clone()
    t0 = m.prepare_layer(0, ids((3, 2), (7, 1), (2, 6)))
    assert t0 is not m.table(0)  # the copy path's own persistent table
    assert torch.equal(m.table(0), home)  # the home table (what graphs read) never points into a buffer
    # offloaded 2, 7, 6 all routed: misses into buffer 0, ranking order 2, 7, 6
    assert rows(t0) == {**LAYER0, 2: (30, 31, 32), 7: (33, 34, 35), 6: (36, 37, 38)}
    assert m.buffer_content(0) == BufferContent(0, {2: 0, 7: 1, 6: 2})
    assert page_holds(rig, 33, 0, 7, 0) and page_holds(rig, 35, 0, 7, 2) and page_holds(rig, 36, 0, 6, 0)
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=1, on_demand_loads=3, bytes_copied=3 * XB)

    # layer 1 predicted from layer 0's input: tokens pick (0, 7), (1, 0), (1, 6)
    m.prefetch_next(0, tokens({0: 5, 7: 4}, {1: 5, 0: 4}, {1: 5, 6: 4}))
    # offloaded of layer 1: 2, 1, 0; 1 and 0 picked twice each -> ranking order 1, 0
    assert m.buffer_content(1) == BufferContent(1, {1: 0, 0: 1})
    assert page_holds(rig, 39, 1, 1, 0) and page_holds(rig, 44, 1, 0, 2)
    assert rows(m.table(1)) == LAYER1  # the table changes only in prepare_layer
    t1 = m.prepare_layer(1, ids((1, 5), (2, 3), (1, 2)))
    # 1: hit in slot 0; 2: miss into the lowest empty slot 2; 0 prefetched but not routed: host
    assert rows(t1) == {**LAYER1, 1: (39, 40, 41), 2: (45, 46, 47)}
    assert t1[0].tolist() == host_row(0)
    assert m.buffer_content(1) == BufferContent(1, {1: 0, 0: 1, 2: 2})
    assert page_holds(rig, 46, 1, 2, 1)
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=2, prefetched=2, prefetch_hits=1,
                                    on_demand_loads=4, bytes_copied=6 * XB)
    assert m.stats().prefetch_hit_rate == 0.2
    m.prefetch_next(1, tokens({0: 1}))  # last layer: nothing to prefetch
    m.end_forward()
    assert m.buffer_content(1).layer == 1  # forgotten at the next begin_forward

    m.begin_forward()
    assert m.buffer_content(0) == m.buffer_content(1) == BufferContent(None, {})
    t0 = m.prepare_layer(0, ids((3, 7), (1, 4)))
    # the buffer was forgotten: 7 is loaded again, into slot 0; rows of 2 and 6 back to host
    assert rows(t0) == {**LAYER0, 7: (30, 31, 32)}
    assert t0[2].tolist() == host_row(2) and t0[6].tolist() == host_row(6)
    assert page_holds(rig, 30, 0, 7, 0)
    t0 = m.prepare_layer(0, ids((3, 4),))  # a second step of the same layer: only resident
    assert rows(t0) == LAYER0
    assert m.stats().on_demand_loads == 5 and m.stats().layers_prepared == 4
    m.end_forward()


def test_all_resident_layer_returns_the_table_without_routing() -> None:
    rig = make_rig(limit=0, resident=8)
    m = rig.manager
    m.begin_forward()
    # ids are not even looked at (no device sync): out-of-range ids pass through
    assert rows(m.prepare_layer(0, ids((0, 99)))) == rig.residency.resident_pages(0)
    m.prefetch_next(0, tokens({0: 1}))
    assert m.stats().prefetched == 0 and m.stats().bytes_copied == 0


def test_routed_id_out_of_range_is_an_error() -> None:
    m = make_rig().manager
    m.begin_forward()
    with pytest.raises(ValueError, match=r"outside \[0, 8\): \[8\]"):
        m.prepare_layer(0, ids((0, 8)))
    with pytest.raises(ValueError, match="layer 4 is not a MoE layer"):
        m.prepare_layer(4, ids((0, 1)))


def test_prefetch_capped_at_slots_most_tokens_first() -> None:
    rig = make_rig(limit=2, resident=6)  # layer 1 offloads 1, 0; two slots
    m = rig.manager
    assert rig.residency.offloaded(1) == [1, 0]
    m.begin_forward()
    m.prefetch_next(0, tokens({0: 5, 3: 4}, {0: 5, 1: 4}, {7: 5, 6: 4}))
    assert m.buffer_content(1) == BufferContent(1, {0: 0, 1: 1})  # 0 twice, 1 once
    m.prefetch_next(0, tokens({0: 5, 3: 4}))  # same layer again: already there, nothing copied
    assert m.stats().prefetched == 2
    t1 = m.prepare_layer(1, ids((0, 1)))
    assert m.stats().prefetch_hits == 2 and m.stats().on_demand_loads == 0
    assert t1[0].tolist() == list(rig.buffers.pages(1, 0)) and t1[1].tolist() == list(rig.buffers.pages(1, 1))


def test_buffers_alternate_by_position_over_three_layers() -> None:
    shape = tiny_shape(layer_ids=(1, 3, 5))
    rig = make_rig(shape, limit=2, resident=6, pages=72)  # default ranking: 6, 7 offloaded
    m, lb = rig.manager, rig.buffers
    assert lb.all_pages() == list(range(54, 66))  # after 3 layers x 6 experts x 3 pages
    m.begin_forward()
    m.prepare_layer(1, ids((7, 0)))
    m.prefetch_next(1, tokens({6: 5, 7: 4}))  # layer 3 -> buffer 1
    assert m.buffer_content(0) == BufferContent(1, {7: 0})
    assert m.buffer_content(1) == BufferContent(3, {6: 0, 7: 1})
    assert rows(m.prepare_layer(3, ids((6, 0))))[6] == lb.pages(1, 0)
    m.prefetch_next(3, tokens({6: 5, 0: 4}))  # layer 5 -> buffer 0 again: layer 1's is replaced
    assert m.buffer_content(0) == BufferContent(5, {6: 0})
    t5 = m.prepare_layer(5, ids((6, 7)))
    assert rows(t5)[6] == lb.pages(0, 0) == (54, 55, 56) and rows(t5)[7] == lb.pages(0, 1)
    assert page_holds(rig, 54, 5, 6, 0) and page_holds(rig, 57, 5, 7, 0)
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=3, prefetched=3, prefetch_hits=2,
                                    on_demand_loads=2, bytes_copied=5 * XB)


def test_eviction_reaches_the_table_after_the_forward_pass() -> None:
    rig = make_rig(limit=4, resident=5)
    m, r = rig.manager, rig.residency
    pages5 = r.pages(0, 5)
    m.begin_forward()
    assert r.evict(0, 5) == pages5
    t0 = m.prepare_layer(0, ids((5, 3)))
    assert rows(t0)[5] == pages5 and m.stats().on_demand_loads == 0  # still usable in this pass
    m.end_forward()
    assert 5 not in rows(m.table(0))
    rig.pool.free_expert_pages(pages5)  # the caller frees after the pass
    m.begin_forward()
    t0 = m.prepare_layer(0, ids((5, 3)))
    assert rows(t0)[5] == rig.buffers.pages(0, 0) and m.stats().on_demand_loads == 1
    m.end_forward()
    # restore expert 5 into fresh pages as an order does: the copy starts with a pass,
    # lands, then the residency admits it; the next forward's table points there
    from sglang_rimuru.experts import expert_owners

    new = rig.pool.alloc_expert_pages(3, expert_owners(0, 5))
    m.begin_forward()
    m.start_uploads([(0, 5, tuple(new))])
    m.end_forward()
    assert rows(m.table(0)).get(5) is None  # not before the admit
    m.wait_uploads()
    r.admit(0, 5, tuple(new))
    m.begin_forward()
    assert rows(m.table(0))[5] == tuple(new)
    assert all(page_holds(rig, p, 0, 5, k) for k, p in enumerate(new))
    assert 5 not in m.prepare_layer(0, ids((5, 3))).tolist()[0]  # no load
    assert m.stats().on_demand_loads == 1 and m.stats().restored == 1


def test_manager_construction_checks() -> None:
    rig = make_rig()
    args = (rig.shape, rig.buffer, rig.residency, rig.host, rig.buffers)
    with pytest.raises(ValueError, match=r"gates: no router weight for MoE layer 1"):
        ExpertManager(*args, {0: torch.zeros(8, 8)}, "cpu")
    with pytest.raises(ValueError, match=r"gates\[1\] has shape \(8, 4\)"):
        ExpertManager(*args, {1: torch.zeros(8, 4)}, "cpu")
    small = type(rig.buffers)(rig.shape, rig.pool, 2)
    with pytest.raises(ValueError, match="2 slots, fewer than the offload limit 3 .* cannot be read in place"):
        ExpertManager(rig.shape, rig.buffer, rig.residency, rig.host, small, None, "cpu", host_reads=False)
    ExpertManager(rig.shape, rig.buffer, rig.residency, rig.host, small, None, "cpu")  # the rest read in place
    # the manager has no pool to ask: its page ids must at least be distinct and in the pool
    on_experts = LoadBuffers.of_pages(rig.shape, 3, list(range(12, 30)))  # 12..14: layer 0 expert 5
    beyond = LoadBuffers.of_pages(rig.shape, 3, list(range(50, 68)))  # a 64-page pool
    for bad in (on_experts, beyond):
        with pytest.raises(ValueError, match="resident experts and load buffers must be on distinct pages "
                                             "of the pool's 64 expert pages"):
            ExpertManager(rig.shape, rig.buffer, rig.residency, rig.host, bad, None, "cpu")
    with pytest.raises(ValueError, match=r"the pool's expert page \(32 B\) is smaller than one expert matrix"):
        ExpertManager(rig.shape, PoolBuffer(PoolGeometry(total_bytes=64 * 32, expert_page_bytes=32,
                                                         kv_page_bytes=16), "cpu"),
                      rig.residency, rig.host, rig.buffers, None, "cpu")
    m = ExpertManager(*args, None, "cpu")
    m.begin_forward()
    m.prefetch_next(0, tokens({2: 1}))  # no gates: no prefetch
    assert m.stats().prefetched == 0


def test_restore_under_way_is_read_from_its_reserved_pages_not_copied_twice() -> None:
    # elastic mode: an order restores layer 1 expert 1 during this pass; the prediction
    # for layer 1 skips it, and routing to it reads its reserved pages (deduplicated)
    from sglang_rimuru.experts.residency import expert_owners

    rig = make_rig()
    m = rig.manager
    pages = tuple(rig.pool.alloc_expert_pages(3, expert_owners(1, 1)))
    assert pages == (48, 49, 50)
    m.begin_forward()
    m.start_uploads([(1, 1, pages)])
    assert all(page_holds(rig, p, 1, 1, k) for k, p in enumerate(pages))
    m.prefetch_next(0, tokens({0: 5, 7: 4}, {1: 5, 0: 4}, {1: 5, 6: 4}))  # predicts 1 and 0
    assert m.buffer_content(1) == BufferContent(1, {0: 0})
    t1 = m.prepare_layer(1, ids((1, 7), (0, 6)))
    assert rows(t1) == {**LAYER1, 1: (48, 49, 50), 0: (39, 40, 41)}
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=1, prefetched=1, prefetch_hits=1,
                                    restored=1, restore_hits=1, bytes_copied=2 * XB)
    m.end_forward()
    m.wait_uploads()
    # until the scheduler admits it, the next pass treats expert 1 as offloaded again
    m.begin_forward()
    assert rows(m.prepare_layer(1, ids((1, 7)))) == {**LAYER1, 1: (39, 40, 41)}
    rig.residency.admit(1, 1, pages)
    m.end_forward()
    assert rows(m.table(1)) == {**LAYER1, 1: (48, 49, 50)}


def test_home_table_changes_in_place_across_eviction_and_restore() -> None:
    # A CUDA graph captured the home table's address once; evictions and restores must
    # rewrite that same tensor (no recapture) and never leave a routed expert at -1.
    from sglang_rimuru.experts import expert_owners

    rig = make_rig(limit=4, resident=5)
    m, r = rig.manager, rig.residency
    home = m.table(0)
    address = home.data_ptr()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ids = torch.tensor([[5, 2], [5, 3], [0, 5], [1, 7]], dtype=torch.int32)
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(4))
    before = m.compute_cpu(0, x, w, ids, home)

    pages5 = r.evict(0, 5)  # the order's eviction; the pass that may read the pages ends first
    m.end_forward()
    rig.pool.free_expert_pages(pages5)
    assert m.table(0) is home and home.data_ptr() == address
    assert home[5].tolist() == host_row(5)
    assert -1 not in home.view(-1).tolist()
    assert torch.equal(m.compute_cpu(0, x, w, ids, home), before)  # read from the host, same output

    new = tuple(rig.pool.alloc_expert_pages(3, expert_owners(0, 5)))
    m.start_uploads([(0, 5, new)])  # the order's restore, between passes
    m.wait_uploads()
    r.admit(0, 5, new)
    m.begin_forward()
    assert m.table(0) is home and home.data_ptr() == address and home[5].tolist() == list(new)
    assert torch.equal(m.compute_cpu(0, x, w, ids, home), before)


def test_load_buffers_smaller_than_the_offload_limit_read_the_rest_in_place() -> None:
    """--rimuru-load-buffer-slots 1 under an offload limit of 3: the routed offloaded
    expert with the most tokens is copied, the others keep their host rows (read in
    place); a slot holding a mispredicted prefetch is given back before anything
    overflows. Outputs equal the all-in-place path's exactly."""
    rig = make_rig()
    small = LoadBuffers(rig.shape, rig.pool, 1)  # buffer 0 slot 0: pages 48-50, buffer 1 slot 0: 51-53
    assert list(small.all_pages()) == list(range(48, 54))
    m = ExpertManager(rig.shape, rig.buffer, rig.residency, rig.host, small, identity_gates(rig.shape), "cpu")
    m.begin_forward()
    # layer 0's offloaded experts 2, 7, 6 are routed 1, 2 and 3 times: 6 is copied, 7 and 2 read in place
    routing = ids((6, 7), (6, 7), (6, 2))
    t0 = m.prepare_layer(0, routing)
    assert rows(t0) == {**LAYER0, 6: (48, 49, 50)}
    assert t0[7].tolist() == host_row(7) and t0[2].tolist() == host_row(2)
    assert m.buffer_content(0) == BufferContent(0, {6: 0}) and page_holds(rig, 49, 0, 6, 1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, generator=g).to(torch.bfloat16)
    w = torch.softmax(torch.randn(3, 2, generator=g), dim=-1)
    assert torch.equal(m.compute(0, x, w, routing, t0), m.compute(0, x, w, routing, m.table(0)))
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=1, on_demand_loads=1, bytes_copied=XB,
                                    in_place_overflow=2)

    # layer 1 (offloaded 2, 1, 0): the prefetch predicts 1 and 0, and keeps the one slot for 1
    m.prefetch_next(0, tokens({1: 5, 0: 4}))
    assert m.buffer_content(1) == BufferContent(1, {1: 0})
    # but the pass routes 2: the mispredicted slot is given back, 2 copied into it
    t1 = m.prepare_layer(1, ids((2, 5)))
    assert m.buffer_content(1) == BufferContent(1, {2: 0})
    assert rows(t1) == {**LAYER1, 2: (51, 52, 53)} and t1[1].tolist() == host_row(1)
    assert page_holds(rig, 53, 1, 2, 2)
    assert m.stats() == ExpertStats(forwards=1, layers_prepared=2, prefetched=1, on_demand_loads=2,
                                    bytes_copied=3 * XB, in_place_overflow=2)
    m.end_forward()
