"""CpuExperts (routed experts computed on the host's CPUs) is SGLang's moe_forward_native,
bit for bit, restricted to the experts it is given; from the host store's layout, in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_rimuru.experts.cpu_experts import CpuExperts, store_weights

from .test_compute import SILU, moe_forward_native, route

CASES = [  # (T, k, E, I, H)
    (1, 1, 8, 4, 8),
    (5, 2, 8, 4, 8),
    (40, 4, 16, 8, 16),
    (100, 8, 32, 16, 32),
    (100, 8, 128, 24, 256),  # Qwen3-30B-A3B's routing (top-8 of 128) at a batch of 100; rows wide enough to vectorize
]


def layer(E: int, I: int, H: int, g: torch.Generator):
    """w13 [E, 2I, H], w2 [E, H, I] and the same weights as a host store layer [E, 3, I*H]."""
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    store = torch.stack([w13[:, :I].reshape(E, -1), w13[:, I:].reshape(E, -1), w2.reshape(E, -1)], dim=1)
    return w13, w2, store


def native(w13, w2, x, w, ids, only=None) -> torch.Tensor:
    """SGLang's moe_forward_native; with ``only``, every other expert's weights zeroed."""
    if only is not None:
        keep = torch.zeros(w13.shape[0], dtype=torch.bool)
        keep[list(only)] = True
        w13 = torch.where(keep[:, None, None], w13, torch.zeros_like(w13))
        w2 = torch.where(keep[:, None, None], w2, torch.zeros_like(w2))
    stub = SimpleNamespace(num_experts=w13.shape[0], w13_weight=w13, w2_weight=w2)
    return moe_forward_native(stub, x, (w, ids, None), SILU)


@pytest.mark.parametrize("engine", ["threads", "forked"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T, k, E, I, H", CASES)
def test_all_experts_is_sglangs_native_bit_for_bit(T, k, E, I, H, threads, engine) -> None:
    g = torch.Generator().manual_seed(T * 1000 + E)
    w13, w2, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = route(T, E, k, g)
    cpu = CpuExperts(threads, engine=engine)
    try:
        got = cpu(x, ids, w, store_weights(store, I, H), range(E))
    finally:
        cpu.close()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, native(w13, w2, x, w, ids))


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("T, k, E, I, H", CASES[1:])
def test_a_subset_is_native_without_the_other_experts(T, k, E, I, H, scattered) -> None:
    g = torch.Generator().manual_seed(7 + T)
    w13, w2, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = route(T, E, k, g)
    # static mode's out-set without a ranking (the highest ids), or a ranking's (anywhere)
    cold = sorted(torch.randperm(E, generator=g)[:E // 2].tolist()) if scattered else list(range(E // 2, E))
    out = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    got = CpuExperts(1)(x, ids, w, store_weights(store, I, H), cold, out=out)
    assert got is out
    assert torch.equal(got, native(w13, w2, x, w, ids, only=cold))
    # the two halves add up to the whole layer (within bf16: the halves are rounded apart)
    hot = CpuExperts(1)(x, ids, w, store_weights(store, I, H), sorted(set(range(E)) - set(cold)))
    whole = native(w13, w2, x, w, ids)
    assert torch.allclose((hot.float() + got.float()), whole.float(), rtol=2e-2, atol=2e-2)


def test_experts_nobody_routes_to_give_zeros_and_read_nothing() -> None:
    E, I, H, T, k = 8, 4, 8, 3, 2
    g = torch.Generator().manual_seed(3)
    _, _, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    w = torch.full((T, k), 0.5)
    read = []
    weights = store_weights(store, I, H)
    got = CpuExperts(1)(x, ids, w, lambda e: (read.append(e), weights(e))[1], [5, 6, 7])
    assert read == [] and torch.equal(got, torch.zeros(T, H, dtype=torch.bfloat16))
    forked = CpuExperts(2, engine="forked")  # the whole request in TorchScript: the same zeros
    assert torch.equal(forked(x, ids, w, weights, [5, 6, 7]), got)
    forked.close()
    assert CpuExperts.routed(ids, [2, 1, 7]).keys() == {1, 2}
    assert [s.tolist() for s in CpuExperts.routed(ids, [2, 1]).values()] == [[1, 2], [3, 4]]


def test_store_weights_are_views_of_the_store() -> None:
    E, I, H = 4, 3, 5
    _, _, store = layer(E, I, H, torch.Generator().manual_seed(1))
    w13, w2 = store_weights(store, I, H)(2)
    assert w13.shape == (2 * I, H) and w2.shape == (H, I)
    assert w13.data_ptr() == store[2, 0].data_ptr() and w2.data_ptr() == store[2, 2].data_ptr()
    with pytest.raises(ValueError, match=r"\(4, 3, 15\): expected \[E, 3, 18\]"):
        store_weights(store, I, H + 1)
    with pytest.raises(ValueError, match="at least one"):
        CpuExperts(0)


@pytest.mark.parametrize("T, k, E, I, H, experts", [
    (6, 2, 8, 64, 128, [3]),  # one expert, cut into 4 pieces each way
    (40, 4, 16, 96, 64, [1, 9]),  # two experts, 2 pieces each (rows in 16-row blocks: 48 + 48, 32 + 32)
    (100, 8, 128, 768 // 8, 2048 // 8, [5, 77, 100]),  # Qwen3's routing, its matrices at an eighth
])
def test_fewer_experts_than_threads_are_cut_into_row_pieces(T, k, E, I, H, experts) -> None:
    """Every thread works on a few experts (the server's CPU split), and each output
    element is the same dot product over the whole row: the one-thread result, bit for bit."""
    g = torch.Generator().manual_seed(T + I)
    w13, w2, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = route(T, E, k, g)
    for t in range(T):  # every listed expert routed, and no token routed twice to one expert
        want = experts[t % len(experts)]
        row = ids[t].tolist()
        if want not in row:
            row[0] = want
        ids[t] = torch.tensor(row, dtype=ids.dtype)
    calls = []
    weights = store_weights(store, I, H)

    def counted(e):
        calls.append(e)
        return weights(e)

    many = CpuExperts(4)
    try:
        got = many(x, ids, w, counted, experts)
    finally:
        many.close()
    assert sorted(calls) == sorted(experts)  # one weights() lookup an expert, whatever the pieces
    assert torch.equal(got, CpuExperts(1)(x, ids, w, weights, experts))
    for engine, pieces in (("threads", False), ("forked", True), ("forked", False)):
        other = CpuExperts(4, pieces=pieces, engine=engine)  # (without pieces, threads idle)
        try:
            assert torch.equal(got, other(x, ids, w, weights, experts)), (engine, pieces)
        finally:
            other.close()
    assert torch.equal(got, native(w13, w2, x, w, ids, only=experts))


def test_forked_experts_run_while_a_python_thread_holds_the_gil() -> None:
    """The forked engine's experts run on torch's inter-op pool with the GIL released:
    a request finishes while another Python thread keeps taking the GIL, and equals the
    threads engine's bits. (Its speed is bench/device/cpu_split_host.py's question.)"""
    import sys
    import threading

    E, I, H, T, k = 8, 64, 128, 24, 2
    g = torch.Generator().manual_seed(11)
    w13, w2, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = route(T, E, k, g)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    other = threading.Thread(target=busy, daemon=True)
    other.start()
    forked = CpuExperts(2, engine="forked")
    try:
        got = forked(x, ids, w, store_weights(store, I, H), [1, 4, 6])
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
        forked.close()
    assert torch.equal(got, CpuExperts(1)(x, ids, w, store_weights(store, I, H), [1, 4, 6]))
    assert torch.equal(got, native(w13, w2, x, w, ids, only=[1, 4, 6]))


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine 'gpu': one of forked, threads"):
        CpuExperts(2, engine="gpu")


@pytest.mark.parametrize("threads, experts", [(8, [3]), (8, [1, 9]), (4, [1, 9, 12])])
def test_forked_row_pieces_are_the_whole_experts_bits(threads, experts) -> None:
    """The forked engine's request with row pieces (the piece count from ``threads``,
    whatever torch's pool holds in this process) equals it without, and the native sum."""
    from sglang_rimuru.experts.cpu_experts import _layer_forked, _scripted

    T, k, E, I, H = 40, 4, 16, 96, 64
    g = torch.Generator().manual_seed(threads + len(experts))
    w13, w2, store = layer(E, I, H, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = route(T, E, k, g)
    for t in range(T):  # every listed expert routed, and no token routed twice to one expert
        row = ids[t].tolist()
        if experts[t % len(experts)] not in row:
            row[0] = experts[t % len(experts)]
        ids[t] = torch.tensor(row, dtype=ids.dtype)
    fn = _scripted(_layer_forked)
    mine = torch.tensor(experts)
    cut = fn(x, ids, w, store, mine, I, H, threads, True)
    whole = fn(x, ids, w, store, mine, I, H, threads, False)
    assert torch.equal(cut, whole)
    assert torch.equal(cut.to(torch.bfloat16), native(w13, w2, x, w, ids, only=experts))
