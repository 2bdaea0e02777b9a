"""bench/device/cpu_split_step.py's handshake, on CPU under the Triton interpreter: the GPU
posts a request number to a host flag, a host thread computes and answers, the GPU's
await passes when the answer reaches the request (and flags a timeout, never hangs); the
split page table."""

from __future__ import annotations

import torch

from tests.conftest import bench_module


def load():
    return bench_module("device/cpu_split_step.py")


def offsets(anchor: torch.Tensor, flags: torch.Tensor) -> tuple[int, int]:
    delta = flags.data_ptr() - anchor.data_ptr()
    assert delta % 8 == 0
    return delta // 8, delta // 8 + 1


def test_post_counts_requests_into_the_host_flag_and_await_passes_on_the_answer() -> None:
    m = load()
    anchor, counter, err = (torch.zeros(1, dtype=torch.int64) for _ in range(3))
    flags = torch.zeros(2, dtype=torch.int64)
    req, done = offsets(anchor, flags)
    m._post[(1,)](counter, anchor, req)
    m._post[(1,)](counter, anchor, req)
    assert counter.item() == 2 and flags.tolist() == [2, 0]
    flags[1] = 2  # the host's answer
    m._await[(1,)](counter, anchor, done, err, 100)
    assert err.item() == 0


def test_await_without_an_answer_gives_up_and_says_which_request() -> None:
    m = load()
    anchor, err = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    counter = torch.tensor([5], dtype=torch.int64)
    flags = torch.tensor([5, 4], dtype=torch.int64)
    _, done = offsets(anchor, flags)
    m._await[(1,)](counter, anchor, done, err, 50)
    assert err.item() == 5


def test_host_side_answers_each_request_with_its_layer() -> None:
    m = load()
    flags = torch.zeros(2, dtype=torch.int64)
    seen = []
    host = m.HostSide(flags, seen.append, layers=3)
    assert not host.poll_once()
    for n in range(1, 5):
        flags[0] = n
        assert host.poll_once() and flags[1].item() == n
        assert not host.poll_once()
    assert seen == [0, 1, 2, 0] and len(host.ms) == 4


def test_host_thread_serves_posts_and_reports_its_error() -> None:
    m = load()
    anchor, counter, err = (torch.zeros(1, dtype=torch.int64) for _ in range(3))
    flags = torch.zeros(2, dtype=torch.int64)
    req, done = offsets(anchor, flags)
    layers = []
    host = m.HostSide(flags, layers.append, layers=2).start()
    try:
        for _ in range(3):
            m._post[(1,)](counter, anchor, req)
            m._await[(1,)](counter, anchor, done, err, 10_000_000)
            assert err.item() == 0
    finally:
        host.stop()
    assert layers == [0, 1, 0] and flags.tolist() == [3, 3]

    def boom(layer):
        raise ValueError("expert math failed")

    bad = m.HostSide(flags, boom, layers=2).start()
    m._post[(1,)](counter, anchor, req)
    m._await[(1,)](counter, anchor, done, err, 2_000)
    bad.stop()
    assert err.item() == 4 and isinstance(bad.error, ValueError)


def test_split_table_rows() -> None:
    m = load()
    E = m.E
    table0 = torch.arange(3 * E, dtype=torch.int32).view(E, 3)
    t = m.split_table(table0, n_out=4, n_cpu=1)
    assert t[: E - 4].equal(table0[: E - 4])
    for e in range(E - 4, E - 1):  # read in place: host pages 3e, 3e+1, 3e+2
        assert t[e].tolist() == [-2 - 3 * e, -3 - 3 * e, -4 - 3 * e]
    assert t[E - 1].tolist() == [-1, -1, -1]
    assert table0[E - 1].tolist() == [3 * E - 3, 3 * E - 2, 3 * E - 1]  # the original untouched


def test_host_block_views_share_one_buffer_aligned() -> None:
    m = load()
    x, ids, flags = m.host_block([((3, 5), torch.bfloat16), ((3, 2), torch.int32), ((2,), torch.int64)], pin=False)
    assert (x.shape, x.dtype, ids.shape, ids.dtype, flags.shape, flags.dtype) == (
        (3, 5), torch.bfloat16, (3, 2), torch.int32, (2,), torch.int64)
    base = x.untyped_storage().data_ptr()
    assert ids.untyped_storage().data_ptr() == base == flags.untyped_storage().data_ptr()
    assert [t.data_ptr() - base for t in (x, ids, flags)] == [0, 256, 512]
    ids.zero_()
    flags.fill_(7)
    x.fill_(1.0)  # writes stay in their own views
    assert ids.sum().item() == 0 and flags.tolist() == [7, 7] and x.float().sum().item() == 15.0
