"""The CPU split: which experts the host takes, the split table beside the home table,
and a whole split layer (handshake kernels under the Triton interpreter, a real host
thread) against the GPU's share and the host's share computed apart."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_rimuru.experts.cpu_experts import CpuExperts, store_weights
from sglang_rimuru.experts.cpu_split import (AUTO_START_SHARE, GATE_MARGIN, HOST_SAMPLES, REPROBE_S, CpuSplit,
                                             CpuSplitFailed, balance_count, choose_host_experts, host_line)

from .rig import host_row, make_rig, tiny_shape
from .test_compute import _interpreter_only, route


def test_choose_takes_the_most_routed_share_of_the_offloaded() -> None:
    p = [0.30, 0.05, 0.20, 0.10, 0.10, 0.25]
    assert choose_host_experts([1, 3, 4, 5], p, 0.5) == [3, 5]  # 0.25, then 0.10 (3 before 4: offloaded order)
    assert choose_host_experts([1, 4, 3, 5], p, 0.5) == [4, 5]  # the tie goes to the one offloaded first
    assert choose_host_experts([1, 3, 4, 5], p, 0.25) == [5]
    assert choose_host_experts([1, 3, 4, 5], p, 0.1) == []  # 0.4 rounds to none
    assert choose_host_experts([], p, 0.9) == []
    assert choose_host_experts([0, 1, 2], p, 0.5) == [0, 2]  # 1.5 rounds half up


NEVER = 1 << 30  # rimuru_kernels.handshake.NEVER (imported lazily there: triton)


def _split(rig, share=0.5, min_tokens=1, max_tokens=16, threads=2, max_spins=2_000_000, expert_ms=None,
           engine="threads") -> CpuSplit:
    return CpuSplit(rig.shape, rig.host, "cpu", share=share, min_tokens=min_tokens, max_tokens=max_tokens,
                    threads=threads, max_spins=max_spins, expert_ms=expert_ms, engine=engine)


def _tiny_attached(resident=5, **kw):
    """A two-layer rig of 8 experts (3 offloaded a layer, unless ``resident`` says all are
    in) and a split attached to its manager: ``(rig, manager, split)``. ``fragment`` and
    ``pages`` go to the rig, the rest to ``_split``."""
    rig_kw = {key: kw.pop(key) for key in ("fragment", "pages") if key in kw}
    rig = make_rig(tiny_shape(E=8, I=16, H=32, k=2), limit=3, resident=resident, gates="random", **rig_kw)
    split = _split(rig, **kw)
    rig.manager.attach_cpu_split(split)
    return rig, rig.manager, split


def _least_paying(expert_ms, ps, host_ms, lo, hi):
    """The gate by its definition, counted up one token at a time."""
    for t in range(lo, hi + 1):
        if expert_ms * sum(1 - (1 - p) ** t for p in ps) > (1 + GATE_MARGIN) * host_ms:
            return t
    return NEVER


def test_gates_open_where_the_offloaded_reads_outlast_the_host() -> None:
    """Without a measured host time every layer with host experts splits from min_tokens;
    with one, from the least batch whose expected offloaded reads take longer than the
    host (plus the margin), or never; the host's median of its last requests decides."""
    pytest.importorskip("triton")
    rig = make_rig(limit=4)  # layer 0 offloads 2, 7, 6; layer 1 offloads 2, 1, 0 (rig.py)
    m = rig.manager
    split = _split(rig, share=0.34, min_tokens=2, max_tokens=64, expert_ms=0.5)
    m.attach_cpu_split(split)
    assert split.host_ms is None and split.gates() == [2, 2]
    ps = {l: [m._token_p[l][e] for e in rig.residency.offloaded(l)] for l in (0, 1)}
    # three offloaded experts a layer can take at most 1.5 ms a layer: a 1.0 ms host pays
    # from some batch, a 1.4 ms host (1.54 with the margin) never (a median without a line:
    # too few samples to fit one)
    split.host_ms = 1.0
    split.regate()
    assert split.line is None
    want = [_least_paying(0.5, ps[l], 1.0, 2, 64) for l in (0, 1)]
    assert split.gates() == want and split._gate.tolist() == want
    assert all(2 < g <= 64 for g in want)
    split.host_ms = 1.4
    split.regate()
    assert split.gates() == [NEVER, NEVER]
    # a change within REGATE_SHARE leaves the gates alone (no copy a pass)
    split.host_ms = 1.0
    split.regate()
    split.host_ms = 1.05
    split.regate()
    assert split.gates() == want
    # an eviction moves the layer's reads, so its gate: more offloaded experts open it sooner
    rig.residency.evict(0, 5)
    m.refresh_tables()
    ps0 = [m._token_p[0][e] for e in rig.residency.offloaded(0)]
    assert split.gates()[0] == _least_paying(0.5, ps0, split.host_ms, 2, 64) <= want[0]  # (1.05 ms now)


def test_closed_gates_open_again_to_measure_the_host() -> None:
    pytest.importorskip("triton")
    rig = make_rig(limit=4)
    split = _split(rig, share=0.34, min_tokens=2, max_tokens=64, expert_ms=0.5)
    rig.manager.attach_cpu_split(split)
    split.host_ms = 50.0  # a slow host: no batch pays
    split.regate()
    assert split.gates() == [NEVER, NEVER]
    split._last_request_at -= REPROBE_S + 1  # no request since
    split.regate()
    assert split.host_ms is None and split.gates() == [2, 2]  # open, so the next passes measure it


def test_the_host_thread_keeps_the_median_of_its_last_requests() -> None:
    _interpreter_only("CUDA present")
    rig, m, split = _tiny_attached(share=0.67, expert_ms=0.5)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    w, ids = route(3, 8, 2, g)
    mb = split.mailbox
    mb.x[:3].copy_(x)
    mb.ids[:3].copy_(ids)
    mb.weights[:3].copy_(w)
    mb.table.copy_(split.split_table(0)[:, 0])
    for n in range(1, HOST_SAMPLES + 1):
        assert split.host_ms is None
        mb.flags[2] = (0 << 16) | 3
        mb.flags[0] = n
        assert split.serve_once() and int(mb.flags[1]) == n
    assert len(split._samples) == HOST_SAMPLES
    assert split.host_ms == sorted(ms for _, _, ms in split._samples)[HOST_SAMPLES // 2]  # the median
    # each sample: the routed experts of its own it computed, the tokens, the time
    own = set(split.host_experts(0))
    routed = len(own & set(ids.reshape(-1).tolist()))
    assert routed >= 1 and {(n, t) for n, t, _ in split._samples} == {(routed, 3)}
    assert not split.serve_once()  # nothing new posted
    split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_split_tables_follow_the_home_tables() -> None:
    _interpreter_only("CUDA present: the split's tables are covered on the GPU by the server runs")
    rig = make_rig(limit=4)  # layer 0 offloads 2, 7, 6; layer 1 offloads 2, 1, 0 (rig.py)
    m = rig.manager
    split = _split(rig, share=0.34)  # one of three
    m.attach_cpu_split(split)
    # ranking probabilities fall with rank: the most routed offloaded expert is the first offloaded
    assert split.host_experts(0) == [2] and split.host_experts(1) == [2]
    for l in (0, 1):
        home, table = m.table(l).tolist(), split.split_table(l).tolist()
        assert table[2] == [-1, -1, -1]
        assert [r for e, r in enumerate(table) if e != 2] == [r for e, r in enumerate(home) if e != 2]
    assert split.gates() == [1, 1]  # no expert_ms: every layer with host experts splits from min_tokens
    # layer 0 evicts expert 5 (ranked above 2): the host's expert moves to it at the next refresh
    rig.residency.evict(0, 5)
    assert split.host_experts(0) == [2]  # tables move only between passes
    m.refresh_tables()
    assert split.host_experts(0) == [5] and split.host_experts(1) == [2]
    table = split.split_table(0).tolist()
    assert table[5] == [-1, -1, -1] and table[2] == host_row(2) == m.table(0).tolist()[2]


def test_split_tables_follow_evictions_and_restores_through_passes() -> None:
    """The order protocol as the worker runs it (evict, pass, restore copy, admit, pass):
    after every step the split table is the home table less the host's rows. A split
    table left behind points at pages the pool has since handed to KV (the GPU would
    read them as weights: fast and wrong), so each pass checks it."""
    from sglang_rimuru.experts import expert_owners

    rig = make_rig(limit=4)
    m, r = rig.manager, rig.residency
    split = _split(rig, share=0.5)
    m.attach_cpu_split(split)

    def agrees() -> None:
        for l in (0, 1):
            home, table = m.table(l).tolist(), split.split_table(l).tolist()
            mine = choose_host_experts(r.offloaded(l), m._token_p[l], 0.5)
            assert split.host_experts(l) == mine
            assert table == [[-1, -1, -1] if e in mine else row for e, row in enumerate(home)]

    m.begin_forward()
    agrees()
    pages5 = r.evict(0, 5)  # layer 0 offloads 5, 2, 7, 6: the host takes 5 and 2
    m.end_forward()
    agrees()
    assert split.host_experts(0) == [2, 5]
    rig.pool.free_expert_pages(pages5)
    new = rig.pool.alloc_expert_pages(3, expert_owners(0, 5))
    m.begin_forward()
    m.start_uploads([(0, 5, tuple(new))])
    m.end_forward()
    m.wait_uploads()
    r.admit(0, 5, tuple(new))
    m.begin_forward()
    agrees()
    assert split.host_experts(0) == [2, 7] and split.split_table(0).tolist()[5] == list(new)
    r.evict(0, 5)  # and again, after an upload finished
    m.end_forward()
    agrees()
    assert split.host_experts(0) == [2, 5]


def test_a_layer_with_nothing_offloaded_is_inactive() -> None:
    _interpreter_only("CUDA present")
    rig = make_rig(limit=3, resident=8, pages=96)  # every expert resident
    split = _split(rig)
    rig.manager.attach_cpu_split(split)
    assert split.host_experts(0) == [] and split.host_counts() == [0, 0]
    assert split.gates() == [NEVER, NEVER] and split._gate.tolist() == [NEVER, NEVER]
    assert torch.equal(split.split_table(0), rig.manager.table(0))


def test_no_split_without_host_reads() -> None:
    rig = make_rig()
    rig.manager.host_reads = False
    with pytest.raises(ValueError, match="host reads"):
        rig.manager.attach_cpu_split(object())


@pytest.mark.parametrize("share, tokens", [(0.5, 0), (1.0, 4), (0.5, 4)])
def test_bad_settings_are_refused(share, tokens) -> None:
    rig = make_rig()
    if share >= 1:
        with pytest.raises(ValueError, match="share"):
            _split(rig, share=share)
    elif tokens == 0:
        with pytest.raises(ValueError, match="tokens"):
            _split(rig, min_tokens=0)
    else:
        split = _split(rig, min_tokens=2, max_tokens=4)
        assert [split.applies(t) for t in (1, 2, 4, 5)] == [False, True, True, False]


def _layer_reference(rig, split, layer, x, w, ids):
    """The GPU's share (the paged kernel over the split table) and the host's (CpuExperts
    over the split's experts), summed in fp32 and rounded once."""
    m = rig.manager
    gpu = m.compute_cuda(layer, x, w, ids, split.split_table(layer), absent_is_zero=True)
    sh = rig.shape
    cpu = CpuExperts(1)
    try:
        host = cpu(x, ids, w, store_weights(rig.host.layer_tensor(layer), sh.inter, sh.hidden),
                   split.host_experts(layer))
    finally:
        cpu.close()
    total = gpu.float() + host.float()
    # the interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even):
    # the kernel's one rounding, as the interpreter does it
    truncated = (total.view(torch.int32) & ~0xFFFF).view(torch.float32).to(x.dtype)
    return truncated, gpu


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("engine", ["threads", "forked"])
@pytest.mark.parametrize("T", [1, 7])
def test_a_split_layer_is_the_gpus_share_plus_the_hosts(T, engine) -> None:
    _interpreter_only("CUDA present: the server runs cover the split on the GPU")
    E, I, H, k = 8, 16, 32, 2
    rig, m, split = _tiny_attached(fragment=True, share=0.67, engine=engine)  # two of three offloaded a layer
    split.start()
    try:
        g = torch.Generator().manual_seed(T)
        for layer in rig.shape.layer_ids:
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            # every token routed to an offloaded expert of this layer, so both sides work
            w, ids = route(T, E, k, g)
            ids[:, 0] = torch.tensor(split.host_experts(layer)[0], dtype=ids.dtype)
            ids[:, 1] = torch.tensor([e for e in rig.residency.offloaded(layer)
                                      if e not in split.host_experts(layer)][0], dtype=ids.dtype)
            got = split.forward(layer, x, w, ids,
                                lambda t: m.compute_cuda(layer, x, w, ids, t, absent_is_zero=True))
            want, gpu_only = _layer_reference(rig, split, layer, x, w, ids)
            assert torch.equal(got, want)
            assert not torch.equal(got, gpu_only)  # the host's share is in it
            # and it is the whole layer, to rounding: against every expert read in place
            whole = m.compute_cuda(layer, x, w, ids, m.table(layer))
            assert (got.float() - whole.float()).abs().max() <= 0.02 * whole.float().abs().max() + 1e-3
        split.check()
        assert split.stats()["requests"] == 2
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_inactive_layer_skips_the_host() -> None:
    _interpreter_only("CUDA present")
    rig, m, split = _tiny_attached(resident=8, pages=96)
    split.start()
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
        w, ids = route(5, 8, 2, g)
        got = split.forward(0, x, w, ids, lambda t: m.compute_cuda(0, x, w, ids, t, absent_is_zero=True))
        assert torch.equal(got, m.compute_cuda(0, x, w, ids, m.table(0)))
        assert split.stats()["requests"] == 0 and int(split.mailbox.flags[0]) == 0
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_pass_below_the_gate_runs_every_expert_on_the_gpu() -> None:
    """A layer with host experts whose gate the pass does not reach: no request, and the
    GPU's share runs the home table (every offloaded expert read in place), not the split
    table (which would drop the host's experts); the same layer at its gate splits."""
    _interpreter_only("CUDA present")
    E, H, k = 8, 32, 2
    rig, m, split = _tiny_attached(fragment=True, share=0.67, min_tokens=1, max_tokens=16)
    split.start()
    try:
        g = torch.Generator().manual_seed(6)
        T = 3
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        w, ids = route(T, E, k, g)
        ids[:, 0] = split.host_experts(0)[0]
        gpu = lambda t: m.compute_cuda(0, x, w, ids, t, absent_is_zero=True)  # noqa: E731
        split._gates[0] = T + 1  # as regate would: this pass is below layer 0's gate
        split._gate[0] = T + 1
        got = split.forward(0, x, w, ids, gpu)
        assert torch.equal(got, m.compute_cuda(0, x, w, ids, m.table(0)))
        assert torch.equal(split._used[0], m.table(0))
        assert split.stats()["requests"] == 0 and int(split.mailbox.flags[0]) == 0
        split._gate[0] = T  # at the gate: split
        got = split.forward(0, x, w, ids, gpu)
        assert torch.equal(split._used[0], split.split_table(0))
        assert torch.equal(got, _layer_reference(rig, split, 0, x, w, ids)[0])
        assert split.stats()["requests"] == 1
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_dead_host_thread_is_reported_not_hung() -> None:
    _interpreter_only("CUDA present")
    rig, m, split = _tiny_attached(share=0.67, max_spins=50)
    split._thread = threading.Thread(target=lambda: None)  # "running", but nobody serves
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    w, ids = route(3, 8, 2, g)
    t0 = time.monotonic()
    split.forward(0, x, w, ids, lambda t: m.compute_cuda(0, x, w, ids, t, absent_is_zero=True))
    assert time.monotonic() - t0 < 60
    with pytest.raises(CpuSplitFailed, match="gave up waiting for the host's reply to request 1"):
        split.check()
    split._thread = None
    split.close()


def test_forward_before_start_is_an_error() -> None:
    rig = make_rig()
    split = _split(rig)
    x = torch.zeros(1, rig.shape.hidden, dtype=torch.bfloat16)
    with pytest.raises(CpuSplitFailed, match="not running"):
        split.forward(0, x, None, None, None)
    split.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 40])
def test_split_layers_in_a_cuda_graph(T) -> None:
    """Both layers split inside one captured graph, replayed on new inputs: each layer is
    the GPU's share plus the host's (rounded to nearest on a GPU), and close to the layer
    with every offloaded expert read in place; with the gates raised above the graph's
    batch the same graph splits nothing."""
    from rimuru_kernels.handshake import add_reply_reference

    from sglang_rimuru.experts import ExpertManager, HostExpertStore
    from sglang_rimuru.pool import PoolBuffer

    E, I, H, k = 8, 64, 128, 2
    shape = tiny_shape(E=E, I=I, H=H, k=k)
    rig = make_rig(shape, limit=3, resident=5, gates="random", fragment=True)
    host = HostExpertStore(shape, pin_memory=True)
    for l in shape.layer_ids:
        host.put_fused(l, rig.w13[l], rig.w2[l])
    buf = PoolBuffer(rig.buffer.geometry, "cuda", zero=True)
    m = ExpertManager(shape, buf, rig.residency, host, rig.buffers, None, "cuda")
    m.upload_resident()
    split = CpuSplit(shape, host, "cuda", share=0.67, min_tokens=1, max_tokens=64, threads=2,
                     engine="forked").start()  # the server's default engine
    m.attach_cpu_split(split)
    torch.cuda.synchronize()
    g = torch.Generator().manual_seed(T)
    xs = torch.zeros(2, T, H, dtype=torch.bfloat16, device="cuda")
    ws = torch.zeros(2, T, k, dtype=torch.float32, device="cuda")
    ids = torch.zeros(2, T, k, dtype=torch.int32, device="cuda")
    outs = {}

    def step():
        for j, l in enumerate(shape.layer_ids):
            outs[l] = split.forward(l, xs[j], ws[j], ids[j], lambda t, j=j, l=l: m.compute_cuda(
                l, xs[j], ws[j], ids[j], t, absent_is_zero=True))

    def fill():
        for j, l in enumerate(shape.layer_ids):
            xs[j].copy_(torch.randn(T, H, generator=g).to(torch.bfloat16))
            w, i = route(T, E, k, g)
            i[:, 0] = split.host_experts(l)[0]  # every token on a host expert and on a GPU-read one
            i[:, 1] = [e for e in rig.residency.offloaded(l) if e not in split.host_experts(l)][0]
            ws[j].copy_(w)
            ids[j].copy_(i)

    try:
        fill()
        step()  # eager: compiles, and the host serves it
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        def replay_and_check() -> None:
            fill()
            graph.replay()
            torch.cuda.synchronize()
            split.check()
            for j, l in enumerate(shape.layer_ids):
                gpu = m.compute_cuda(l, xs[j], ws[j], ids[j], split.split_table(l), absent_is_zero=True)
                cpu = CpuExperts(1)
                hostpart = cpu(xs[j].cpu(), ids[j].cpu(), ws[j].cpu(),
                               store_weights(host.layer_tensor(l), I, H), split.host_experts(l))
                cpu.close()
                want = add_reply_reference(gpu.cpu(), hostpart, active=True)
                assert torch.equal(outs[l].cpu(), want)
                whole = m.compute_cuda(l, xs[j], ws[j], ids[j], m.table(l)).float().cpu()
                assert (outs[l].float().cpu() - whole).abs().max() <= 0.02 * whole.abs().max() + 1e-3

        for _ in range(3):
            replay_and_check()
        assert split.stats()["requests"] == 2 * 4  # the eager step and 3 replays (a capture runs nothing)
        # the host's experts move between replays (auto's counts as the host's line moves): the
        # split tables are rewritten in stream order and the same graph follows them
        for l in shape.layer_ids:
            before = split.host_experts(l)
            split._write_split(l, [rig.residency.offloaded(l)[0]])
            assert len(before) == 2 and len(split.host_experts(l)) == 1
        replay_and_check()
        assert split.stats()["requests"] == 2 * 5
        # the same graph with both gates above its batch: read at replay, so no layer splits,
        # the host gets nothing and each layer is the GPU's over its home table
        split._gate.fill_(T + 1)
        fill()
        graph.replay()
        torch.cuda.synchronize()
        split.check()
        for j, l in enumerate(shape.layer_ids):
            assert torch.equal(outs[l], m.compute_cuda(l, xs[j], ws[j], ids[j], m.table(l)))
        assert split.stats()["requests"] == 2 * 5
    finally:
        split.close()


def test_host_line_fits_the_hosts_time_over_its_experts() -> None:
    assert host_line([(2, 5.0), (4, 6.0), (6, 7.0), (8, 8.0)], 0.3) == (4.0, 0.5)  # exact: 4 + 0.5 n
    # counts that do not spread: the prior slope, the intercept the median of the rest
    a, b = host_line([(4, 5.0), (4, 6.0), (4, 9.0)], 0.25)
    assert (a, b) == (5.0, 0.25)
    # a slope far from the prior is held within 1/4..4x of it
    assert host_line([(1, 1.0), (2, 11.0), (3, 21.0)], 0.5)[1] == 2.0
    assert host_line([(1, 5.0), (9, 5.0)], 0.4)[1] == 0.1
    assert host_line([(1, 0.1), (9, 8.1)], 1.0) == (0.0, 1.0)  # never below 0 ms fixed
    with pytest.raises(ValueError):
        host_line([], 0.3)


def _balance_by_definition(ps, tokens, expert_ms, a, b):
    """Every count's wait, the least kept (the first on ties), 0 meaning all on the GPU."""
    t = [1 - (1 - p) ** tokens for p in ps]
    waits = [expert_ms * sum(t)] + [max(a + b * sum(t[:n]), expert_ms * sum(t[n:])) for n in range(1, len(t) + 1)]
    return min(range(len(waits)), key=lambda n: (waits[n], n))


def test_balance_count_gives_the_host_what_it_finishes_beside_the_gpu() -> None:
    ps = [1 / 15] * 48  # Qwen1.5 at 24 GB: 48 out of 60, uniform routing
    # at full batch every expert is routed: 0.34 ms each on the GPU, the host 5 ms + 0.33 each
    n = balance_count(ps, 128, 0.34, (5.0, 0.33))
    assert n == _balance_by_definition(ps, 128, 0.34, 5.0, 0.33) == 17
    r = 1 - (14 / 15) ** 128
    assert abs((5.0 + 0.33 * 17 * r) - 0.34 * 31 * r) < 0.34  # the two sides end within one expert's read
    assert balance_count(ps, 128, 0.34, (0.0, 0.001)) == 48  # a nearly free host takes them all
    assert balance_count(ps, 128, 0.34, (20.0, 0.33)) == 0  # a host slower than every read: none
    # at a small batch the reads are fewer, and so is the host's count
    small = balance_count(ps, 8, 0.34, (5.0, 0.33))
    assert small == _balance_by_definition(ps, 8, 0.34, 5.0, 0.33) < n
    skew = [0.3, 0.2, 0.05, 0.01, 0.01]
    for tokens in (1, 4, 16, 64):
        assert balance_count(skew, tokens, 0.5, (0.2, 0.4)) == _balance_by_definition(skew, tokens, 0.5, 0.2, 0.4)


def test_auto_counts_follow_the_hosts_line() -> None:
    """``share=None``: every layer starts at AUTO_START_SHARE; once the host has its samples,
    each layer's count balances its line against the GPU's reads at the samples' median
    batch, the split tables follow, and a reprobe starts over."""
    pytest.importorskip("triton")
    rig = make_rig(limit=4)  # layer 0 offloads 2, 7, 6; layer 1 offloads 2, 1, 0 (rig.py)
    m = rig.manager
    with pytest.raises(ValueError, match="needs expert_ms"):
        _split(rig, share=None)
    split = _split(rig, share=None, min_tokens=2, max_tokens=64, expert_ms=0.5)
    m.attach_cpu_split(split)
    start = {l: choose_host_experts(rig.residency.offloaded(l), m._token_p[l], AUTO_START_SHARE) for l in (0, 1)}
    assert start[0] == [2] and all(split.host_experts(l) == start[l] for l in (0, 1))
    split.regate()  # too few samples: no line, nothing moves
    assert split.line is None and all(split.host_experts(l) == start[l] for l in (0, 1))

    def agrees() -> None:
        for l in (0, 1):
            mine = split.host_experts(l)
            home, table = m.table(l).tolist(), split.split_table(l).tolist()
            assert table == [[-1, -1, -1] if e in mine else row for e, row in enumerate(home)]

    # a fast host (0.1 ms + 0.2 an expert) beside 0.5 ms reads: it takes more than it started with
    split._samples = [(1 + i % 3, 32 + i % 2, 0.1 + 0.2 * (1 + i % 3)) for i in range(HOST_SAMPLES)]
    split.host_ms = 0.5
    split.regate()
    assert split.line == pytest.approx((0.1, 0.2)) and split.design_tokens == 33  # the median batch
    for l in (0, 1):
        out = rig.residency.offloaded(l)
        ps = [m._token_p[l][e] for e in sorted(out, key=lambda e: -m._token_p[l][e])]
        assert len(split.host_experts(l)) == balance_count(ps, 33, 0.5, split.line) > len(start[l])
    agrees()
    assert split.gates() == [_least_paying_line(split, l) for l in (0, 1)]
    # a slow host (3 ms fixed): no layer's reads outlast it, the host takes none
    split._samples = [(1 + i % 3, 32, 3.0 + 0.5 * (1 + i % 3)) for i in range(HOST_SAMPLES)]
    split.host_ms = 4.0
    split.regate()
    assert split.host_counts() == [0, 0] and split.gates() == [NEVER, NEVER]
    agrees()
    # no request for REPROBE_S: the line is dropped and every layer starts over
    split._last_request_at -= REPROBE_S + 1
    split.regate()
    assert split.line is None and split.host_ms is None
    assert all(split.host_experts(l) == start[l] for l in (0, 1)) and split.gates() == [2, 2]
    agrees()


def _least_paying_line(split, layer):
    """The gate by its definition with the host's line, one token at a time."""
    out_p = [split._given[layer][2][e] for e in split._given[layer][1]]
    mine = [split._given[layer][2][e] for e in split.host_experts(layer)]
    a, b = split.line
    for t in range(split.min_tokens, split.max_tokens + 1):
        host = a + b * sum(1 - (1 - p) ** t for p in mine)
        if split.expert_ms * sum(1 - (1 - p) ** t for p in out_p) > (1 + GATE_MARGIN) * host:
            return t
    return NEVER


def test_gpu_read_share_is_what_the_host_leaves_the_gpu() -> None:
    pytest.importorskip("triton")
    rig = make_rig(limit=4)  # three offloaded a layer
    split = _split(rig, share=0.34)  # one of them on the host
    rig.manager.attach_cpu_split(split)
    assert split.gpu_read_share() == 4 / 6
    rig.residency.evict(0, 5)  # layer 0: four out, the host still one (0.34 x 4 rounds to 1)
    rig.manager.refresh_tables()
    assert split.host_counts() == [1, 1] and split.gpu_read_share() == 5 / 7


def test_passes_are_counted_against_the_splits_token_range() -> None:
    """``note_pass``: each forward pass shorter than, within or longer than
    ``min_tokens..max_tokens`` (both ends within), in ``stats()``: what says the split sat
    out a traffic whose passes were all longer."""
    pytest.importorskip("triton")
    rig = make_rig(limit=4)
    split = _split(rig, min_tokens=16, max_tokens=128)
    for tokens in (1, 15, 16, 100, 128, 129, 2348, 300):
        split.note_pass(tokens)
    cs = split.stats()
    assert (cs["passes_shorter"], cs["passes_within"], cs["passes_longer"]) == (2, 3, 3)
    assert cs["requests"] == 0  # counting passes serves nothing on the host


def test_the_host_experts_of_an_eager_pass_follow_the_range_and_the_gate() -> None:
    """``host_experts_at``: a layer's host experts where a pass of that many tokens splits
    (within ``min_tokens..max_tokens`` and at or past the layer's gate), else none."""
    pytest.importorskip("triton")
    rig, m, split = _tiny_attached(fragment=True, share=0.67, min_tokens=2, max_tokens=8)
    mine = split.host_experts(0)
    assert len(mine) == 2
    assert [split.host_experts_at(0, t) for t in (1, 2, 8, 9)] == [[], mine, mine, []]
    split._gates[0] = 5  # as regate would set it: layer 0 splits from 5 tokens
    assert [split.host_experts_at(0, t) for t in (4, 5)] == [[], mine]
    assert split.host_experts_at(1, 4) == split.host_experts(1)  # the other layer's gate is its own


def _copy_path_pass(m, split, layer, T, seed):
    """One layer's inputs, routed to one host expert and one GPU-offloaded expert (both
    offloaded) besides the rest, and the manager ready for a pass."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 32, generator=g).to(torch.bfloat16)
    w, ids = route(T, 8, 2, g)
    gpu_out = [e for e in m.residency.offloaded(layer) if e not in split.host_experts(layer)]
    ids[:, 0] = split.host_experts(layer)[0]
    ids[:, 1] = gpu_out[0]
    m.begin_forward()
    return x, w, ids, gpu_out[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("T", [3, 6])
def test_the_copy_path_splits_with_the_hosts_experts_uncopied(T) -> None:
    """An eager pass past the in-place range (the copy path) where the layer splits: the
    GPU's offloaded experts are copied into the load buffer, the host's are not (their
    working rows stay home rows), and the layer is the GPU's share over the copies plus
    the host's, as the in-place split computes it (the same pages' values either way)."""
    _interpreter_only("CUDA present: the server runs cover the split on the GPU")
    rig, m, split = _tiny_attached(fragment=True, share=0.67)  # two of three offloaded on the host
    split.start()
    try:
        for layer in rig.shape.layer_ids:
            x, w, ids, copied = _copy_path_pass(m, split, layer, T, seed=T + layer)
            loads = m.stats().on_demand_loads
            got = m.forward_copy_path(layer, x, w, ids)
            held = m.buffer_content(rig.shape.position(layer) % 2).slots
            assert copied in held and not set(split.host_experts(layer)) & set(held)
            assert m.stats().on_demand_loads == loads + 1  # the GPU's one, not the host's
            want, _ = _layer_reference(rig, split, layer, x, w, ids)
            assert torch.equal(got, want)
            # the split's table for the GPU: the working rows, the host's -1
            host = split.host_experts(layer)
            assert all(r == [-1, -1, -1] for r in split._used[layer][host].tolist())
            assert split._used[layer][copied].tolist() == m._work[layer][copied].tolist()
            m.end_forward()
        split.check()
        assert split.stats()["requests"] == 2
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_copy_path_copies_every_routed_expert_where_the_layer_does_not_split() -> None:
    """Past the split's range (and below a layer's gate) the copy path is what it was: every
    routed offloaded expert copied, no request to the host; and the next layer's prefetch
    leaves out its host experts only where that layer splits at this pass's tokens."""
    _interpreter_only("CUDA present")
    rig, m, split = _tiny_attached(fragment=True, share=0.67, min_tokens=1, max_tokens=4)
    split.start()
    try:
        x, w, ids, copied = _copy_path_pass(m, split, 0, 5, seed=11)  # 5 > max_tokens
        got = m.forward_copy_path(0, x, w, ids)
        held = m.buffer_content(0).slots
        assert copied in held and split.host_experts(0)[0] in held
        assert torch.equal(got, m.compute(0, x, w, ids, m._work[0]))  # (on CPU tensors: compute_cpu)
        assert split.stats()["requests"] == 0 and int(split.mailbox.flags[0]) == 0
        m.end_forward()
        # the next layer's prefetch, from layer 0 (random gates route every expert of layer 1
        # that some token picks): within the range, the host's experts of layer 1 stay home
        g = torch.Generator().manual_seed(12)
        wide = torch.randn(64, 32, generator=g).to(torch.bfloat16)
        for tokens, host_prefetched in ((5, True), (3, False)):
            m.begin_forward()
            m.prefetch_next(0, wide, skip=split.host_experts_at(1, tokens))
            held = set(m.buffer_content(1).slots)
            assert bool(held & set(split.host_experts(1))) == host_prefetched
            assert held - set(split.host_experts(1))  # the GPU's are prefetched either way
            m.end_forward()
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_copied_pass_whose_device_gate_stays_shut_reads_the_host_experts_in_place() -> None:
    """Where the device's gate does not open (``forward_copied`` run past what the host's
    copy of the gate said), the GPU's share runs the working table whole: the host's
    experts, not copied, are read in place from their home rows; no request, still right."""
    _interpreter_only("CUDA present")
    rig, m, split = _tiny_attached(fragment=True, share=0.67, min_tokens=1, max_tokens=16)
    split.start()
    try:
        T = 3
        x, w, ids, _ = _copy_path_pass(m, split, 0, T, seed=21)
        host = split.host_experts_at(0, T)
        table = m.prepare_layer(0, ids, skip=host)
        assert table[host[0]].tolist() == m.table(0)[host[0]].tolist()  # its home row: host pages
        split._gate[0] = T + 1  # the device's gate shut for this pass
        got = split.forward_copied(0, x, w, ids, table,
                                   lambda t: m.compute_cuda(0, x, w, ids, t, absent_is_zero=True))
        assert torch.equal(got, m.compute_cuda(0, x, w, ids, table))
        assert torch.equal(split._used[0], table)
        assert split.stats()["requests"] == 0
    finally:
        split.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_copy_path_split_at_qwen3s_routing_and_a_decode_batch_past_the_graphs() -> None:
    """Qwen3-30B-A3B's routing geometry (128 experts, top-8; narrow matrices to keep the
    interpreter quick) at 300 tokens, the eager decode batch the copy path serves there, with
    96 of 128 experts out a layer and 24 of them on the host: the host's experts cross no
    copy, every other routed one out is copied or prefetched, and the layer equals the
    in-place split's (the GPU's share over the split table plus the host's)."""
    _interpreter_only("CUDA present: the server runs cover the split on the GPU")
    shape = tiny_shape(E=128, I=16, H=32, k=8)
    rig = make_rig(shape, limit=96, resident=32, pages=1000, gates="random")  # slots for every one out
    m = rig.manager
    split = _split(rig, share=0.25, min_tokens=16, max_tokens=512)
    m.attach_cpu_split(split)
    split.start()
    try:
        g = torch.Generator().manual_seed(30)
        T = 300
        for layer in shape.layer_ids:
            host = split.host_experts(layer)
            assert len(host) == 24 and split.host_experts_at(layer, T) == host
        m.begin_forward()
        for layer in shape.layer_ids:
            x = torch.randn(T, 32, generator=g).to(torch.bfloat16)
            w, ids = route(T, 128, 8, g)
            before = m.stats()
            got = m.forward_copy_path(layer, x, w, ids)
            after = m.stats()
            routed = set(ids.unique().tolist())
            out = set(rig.residency.offloaded(layer))
            host = set(split.host_experts(layer))
            held = set(m.buffer_content(shape.position(layer) % 2).slots)
            assert not held & host and (routed & out) - host <= held
            assert (after.on_demand_loads + after.prefetch_hits - before.on_demand_loads - before.prefetch_hits
                    == len((routed & out) - host))
            want, _ = _layer_reference(rig, split, layer, x, w, ids)
            assert torch.equal(got, want)
        m.end_forward()
        split.check()
        assert split.stats()["requests"] == 2
    finally:
        split.close()
