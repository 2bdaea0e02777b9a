"""Host -> device expert copies: matrices on consecutive pages go as one copy per run.

Every ``copy_`` out of the host store is recorded (monkeypatched ``Tensor.copy_``)
as ``(layer, expert, first matrix, first page, matrices)``, and the whole pool is
compared with what it must hold afterwards.
"""

from __future__ import annotations

import pytest
import torch

from sglang_rimuru.experts import ExpertRanking, ExpertResidency, LoadBuffers, page_runs

from .rig import make_pool, make_rig, tiny_shape

ME = 32  # elements of one matrix of the tiny shape


def ids(*pairs) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int32)


@pytest.mark.parametrize("pages,runs", [
    ((4, 5, 6), [(0, 3, 4)]),  # consecutive: one copy
    ((7, 8, 20), [(0, 2, 7), (2, 1, 20)]),  # W1+W3, then W2
    ((3, 10, 11), [(0, 1, 3), (1, 2, 10)]),  # W1, then W3+W2
    ((6, 5, 4), [(0, 1, 6), (1, 1, 5), (2, 1, 4)]),  # reversed: adjacent, wrong direction
    ((2, 4, 6), [(0, 1, 2), (1, 1, 4), (2, 1, 6)]),  # all apart
    ((9, 30, 10), [(0, 1, 9), (1, 1, 30), (2, 1, 10)]),  # W1 and W2 adjacent, W3 between
    ((0, 1, 2), [(0, 3, 0)]),
    ((5,), [(0, 1, 5)]),
    ((), []),
])
def test_page_runs(pages, runs) -> None:
    assert page_runs(pages) == runs
    assert page_runs(list(torch.tensor(pages, dtype=torch.int32))) == runs  # table rows


def test_host_store_matrices_is_a_flat_view_of_adjacent_matrices() -> None:
    rig = make_rig()
    h = rig.host
    v = h.matrices(1, 5, 1, 2)
    assert v.shape == (2 * ME,) and v.data_ptr() == h.matrix(1, 5, 1).data_ptr()
    assert torch.equal(v, torch.cat((rig.w13[1][5, 4:].reshape(-1), rig.w2[1][5].reshape(-1))))
    assert torch.equal(h.matrices(0, 2, 0, 3), h.layer_tensor(0)[2].reshape(-1))
    h.put(1, 5, *(torch.full(s, float(m + 1), dtype=torch.bfloat16)
                  for m, s in enumerate(((4, 8), (4, 8), (8, 4)))))
    assert v.tolist() == [2.0] * ME + [3.0] * ME  # no copy: writes show through
    for first, n in ((2, 2), (0, 0), (-1, 1), (0, 4)):
        with pytest.raises(ValueError, match="not within 0..2"):
            h.matrices(0, 0, first, n)


@pytest.fixture
def host_copies(monkeypatch):
    """Start recording: returns a function giving the copies out of ``rig.host`` so far."""
    seen = []
    orig = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        seen.append((self, src))
        return orig(self, src, non_blocking)

    def start(rig):
        seen.clear()
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        m = rig.manager

        def copies():
            out = []
            for dst, src in seen:
                for l in rig.shape.layer_ids:
                    lt = rig.host.layer_tensor(l)
                    if src.untyped_storage().data_ptr() != lt.untyped_storage().data_ptr():
                        continue
                    off = (src.data_ptr() - lt.data_ptr()) // src.element_size()
                    dst_off = (dst.data_ptr() - m.pool_flat.data_ptr()) // dst.element_size()
                    assert dst_off % m.page_elems == 0 and src.numel() % ME == 0
                    out.append((l, off // (3 * ME), off % (3 * ME) // ME, dst_off // m.page_elems,
                                src.numel() // ME))
            return out

        return copies

    return start


def expected_pool(rig, before: torch.Tensor, placed: dict[tuple[int, int], tuple[int, int, int]]):
    """``before`` with each (layer, expert)'s matrices written at the start of its pages."""
    want = before.clone()
    pe = rig.manager.page_elems
    for (l, e), pages in placed.items():
        for k, p in enumerate(pages):
            want[p * pe: p * pe + ME] = rig.host.matrix(l, e, k)
    return want


def test_load_buffer_slots_and_resident_experts_get_consecutive_pages() -> None:
    # production order (rimuru_patches.unified_pool.runtime): the dummy KV page, then
    # the load buffers, then placement -- every slot and every expert on p, p+1, p+2
    for shape, limit, resident in ((tiny_shape(), 3, 5), (tiny_shape(layer_ids=(1, 3, 5), E=6), 4, 2)):
        _, pool = make_pool(shape, 80)
        assert pool.alloc_kv_pages(1, "dummy") == [0]
        residency = ExpertResidency(shape, ExpertRanking.default(shape), limit)
        lb = LoadBuffers(shape, pool, limit)
        residency.place_initial(pool, resident)
        experts = [pages for l in shape.layer_ids for pages in residency.resident_pages(l).values()]
        slots = [lb.pages(b, s) for b in range(2) for s in range(limit)]
        assert all(page_runs(p) == [(0, 3, p[0])] for p in experts + slots)
        assert [p[0] for p in slots] == [1 + 3 * i for i in range(2 * limit)]
        assert [p[0] for p in experts] == [1 + 3 * (2 * limit + i) for i in range(len(experts))]
    # also after holes and a KV page ahead of them (the rig's fragmented pool)
    rig = make_rig(fragment=True)
    assert [rig.buffers.pages(b, s) for b in range(2) for s in range(3)] == \
        [(34 + 3 * i, 35 + 3 * i, 36 + 3 * i) for i in range(6)]


def test_loads_into_consecutive_slot_pages_are_one_copy_each(host_copies) -> None:
    rig = make_rig()
    m = rig.manager
    before = m.pool_flat.clone()
    copies = host_copies(rig)
    m.begin_forward()
    m.prepare_layer(0, ids((3, 2), (7, 1), (2, 6)))  # misses 2, 7, 6 -> slots 0, 1, 2 of buffer 0
    assert copies() == [(0, 2, 0, 30, 3), (0, 7, 0, 33, 3), (0, 6, 0, 36, 3)]  # 3 copies, not 9
    placed = {(0, 2): (30, 31, 32), (0, 7): (33, 34, 35), (0, 6): (36, 37, 38)}
    assert torch.equal(m.pool_flat, expected_pool(rig, before, placed))
    # a prefetch goes the same way
    h = torch.zeros(1, 8, dtype=torch.bfloat16)
    h[0, 1], h[0, 0] = 5, 4
    m.prefetch_next(0, h)  # layer 1 offloads 2, 1, 0: predicts 1, 0 -> buffer 1 slots 0, 1
    assert copies()[3:] == [(1, 1, 0, 39, 3), (1, 0, 0, 42, 3)]
    placed.update({(1, 1): (39, 40, 41), (1, 0): (42, 43, 44)})
    assert torch.equal(m.pool_flat, expected_pool(rig, before, placed))
    m.end_forward()


def test_partly_consecutive_pages_are_split_into_runs(host_copies) -> None:
    rig = make_rig()  # pages 48..63 are free
    m = rig.manager
    before = m.pool_flat.clone()
    copies = host_copies(rig)
    # restores of migration orders (pages as the pool reserved them): one copy per run
    m.start_uploads([(1, 2, (50, 51, 60)), (1, 0, (57, 56, 55))])
    m.start_uploads([(0, 6, (48, 61, 62)), (0, 7, (52, 54, 58))])
    m.wait_uploads()
    assert copies() == [(1, 2, 0, 50, 2), (1, 2, 2, 60, 1),
                        (1, 0, 0, 57, 1), (1, 0, 1, 56, 1), (1, 0, 2, 55, 1),
                        (0, 6, 0, 48, 1), (0, 6, 1, 61, 2),
                        (0, 7, 0, 52, 1), (0, 7, 1, 54, 1), (0, 7, 2, 58, 1)]
    placed = {(1, 2): (50, 51, 60), (1, 0): (57, 56, 55), (0, 6): (48, 61, 62), (0, 7): (52, 54, 58)}
    assert torch.equal(m.pool_flat, expected_pool(rig, before, placed))


def test_upload_resident_on_a_fragmented_pool(host_copies) -> None:
    rig = make_rig(fragment=True)
    m = rig.manager
    res = {(l, e): p for l in (0, 1) for e, p in rig.residency.resident_pages(l).items()}
    assert res[(0, 3)] == (2, 4, 6)  # the holes left by the junk pages
    zero = torch.zeros_like(m.pool_flat)
    m.pool_flat.zero_()
    copies = host_copies(rig)
    m.upload_resident()
    got = copies()
    assert [c for c in got if c[:2] == (0, 3)] == [(0, 3, 0, 2, 1), (0, 3, 1, 4, 1), (0, 3, 2, 6, 1)]
    assert len(got) == 3 + 9  # expert 3 of layer 0 per page, the 9 others one copy each
    assert torch.equal(m.pool_flat, expected_pool(rig, zero, res))


def test_padded_pages_are_copied_per_page(host_copies) -> None:
    # a page larger than a matrix (padding after it): consecutive page ids are not
    # adjacent matrices in the pool, so every matrix is its own copy
    rig = make_rig(page_bytes=128)  # 64 elements per page, 32 used
    m = rig.manager
    assert m.page_elems == 2 * ME and rig.buffers.pages(0, 0) == (30, 31, 32)
    before = m.pool_flat.clone()
    copies = host_copies(rig)
    m.begin_forward()
    m.prepare_layer(0, ids((3, 2), (7, 1)))
    assert copies() == [(0, 2, k, 30 + k, 1) for k in range(3)] + [(0, 7, k, 33 + k, 1) for k in range(3)]
    placed = {(0, 2): (30, 31, 32), (0, 7): (33, 34, 35)}
    assert torch.equal(m.pool_flat, expected_pool(rig, before, placed))
    m.end_forward()
