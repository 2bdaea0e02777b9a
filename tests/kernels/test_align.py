"""moe_align_block_size on hand-checked inputs and random invariants."""

import functools

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

from rimuru_kernel_helpers import DEVICE  # noqa: E402
from rimuru_kernels import moe_align_block_size, moe_align_block_size_triton  # noqa: E402

ALIGNS = [
    moe_align_block_size,
    functools.partial(moe_align_block_size_triton, one_program=True),
    functools.partial(moe_align_block_size_triton, one_program=False),
]


@pytest.fixture(params=ALIGNS, ids=["torch", "triton-one-program", "triton-chunked"])
def align_fn(request):
    return request.param


def align(ids, block, E, fn=moe_align_block_size):
    a = fn(torch.tensor(ids, dtype=torch.int32, device=DEVICE), block, E)
    assert a.sorted_token_ids.dtype == a.expert_ids.dtype == torch.int32
    assert a.num_tokens_post_padded.dtype == torch.int32
    return (a.sorted_token_ids.tolist(), a.expert_ids.tolist(),
            a.num_tokens_post_padded.tolist())


def test_two_tokens_top2(align_fn):
    # flat slots: 0->e1, 1->e0, 2->e1, 3->e2; counts [1, 2, 1, 0] padded to 2.
    # Buffer: 4 + min(4, 4) * (2 - 1) = 8 entries, padding value 4.
    assert align([[1, 0], [1, 2]], 2, 4, align_fn) == (
        [1, 4, 0, 2, 3, 4, 4, 4],
        [0, 1, 2, -1],
        [6],
    )


def test_skewed_with_empty_expert(align_fn):
    # flat: e2 e2 e0 e2 e2 e2; counts [1, 0, 5] padded to 4: [4, 0, 8].
    # Buffer: 6 + min(6, 3) * 3 = 15 entries, 4 blocks; padding value 6.
    assert align([[2], [2], [0], [2], [2], [2]], 4, 3, align_fn) == (
        [2, 6, 6, 6, 0, 1, 3, 4, 5, 6, 6, 6, 6, 6, 6],
        [0, 2, 2, -1],
        [12],
    )


def test_block_exactly_full(align_fn):
    assert align([[1, 0], [0, 1]], 2, 2, align_fn) == ([1, 2, 0, 3, 4, 4], [0, 1, -1], [4])


def test_no_tokens(align_fn):
    ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    a = align_fn(ids, 16, 8)
    assert a.sorted_token_ids.numel() == 0 and a.expert_ids.numel() == 0
    assert a.num_tokens_post_padded.tolist() == [0]


@pytest.mark.parametrize("seed", range(5))
def test_random_invariants(seed, align_fn):
    g = torch.Generator().manual_seed(seed)
    T, k, E, block = 37, 3, 8, 16
    logits = torch.randn(T, E, generator=g)
    logits[:, 2] += 3 * seed  # more skew as the seed grows
    ids = torch.topk(logits, k).indices.to(DEVICE)
    a = align_fn(ids, block, E)
    for x, y in zip(a, moe_align_block_size(ids, block, E)):
        assert torch.equal(x, y)  # deterministic, and both versions agree exactly

    flat = ids.reshape(-1).tolist()
    n = len(flat)
    sorted_ids = a.sorted_token_ids.tolist()
    experts = a.expert_ids.tolist()
    used = a.num_tokens_post_padded.item()
    assert len(sorted_ids) == n + min(n, E) * (block - 1)
    assert used % block == 0
    assert all(s == n for s in sorted_ids[used:])
    assert all(e == -1 for e in experts[used // block:])
    seen = []
    for b in range(used // block):
        chunk = [s for s in sorted_ids[b * block:(b + 1) * block] if s != n]
        assert chunk, "a used block holds at least one slot"
        assert all(flat[s] == experts[b] for s in chunk)
        assert chunk == sorted(chunk)
        seen += chunk
    assert sorted(seen) == list(range(n))
    assert experts[: used // block] == sorted(experts[: used // block])


@pytest.mark.parametrize("n_tokens,k,E,block", [(1, 8, 128, 16), (4, 8, 128, 16), (64, 8, 128, 16),
                                                (128, 8, 128, 64), (3, 4, 60, 16), (50, 6, 1000, 32)])
def test_one_program_matches_reference_at_decode_shapes(n_tokens, k, E, block):
    # Decode batches of the real shapes (Qwen3-30B-A3B: E=128 top-8; Qwen1.5: E=60 top-4),
    # up to the one-program limit of 1024 slots, and E near its 1024 limit.
    g = torch.Generator().manual_seed(n_tokens * 1000 + E)
    ids = torch.topk(torch.randn(n_tokens, E, generator=g), k).indices.to(torch.int32).to(DEVICE)
    want = moe_align_block_size(ids, block, E)
    got = moe_align_block_size_triton(ids, block, E, one_program=True)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    # The default picks the one-program kernel up to 1024 slots: same output.
    for x, y in zip(moe_align_block_size_triton(ids, block, E), want):
        assert torch.equal(x, y)


def test_one_program_skips_ids_outside_the_experts():
    # Ids -1 and E are placed nowhere, exactly as the chunked kernels do.
    ids = torch.tensor([[0, 5], [-1, 1], [1, 0]], dtype=torch.int32, device=DEVICE)
    one = moe_align_block_size_triton(ids, 2, 5, one_program=True)
    two = moe_align_block_size_triton(ids, 2, 5, one_program=False)
    for x, y in zip(one, two):
        assert torch.equal(x, y)
    assert one.num_tokens_post_padded.tolist() == [4]
    assert one.sorted_token_ids.tolist()[:4] == [0, 5, 3, 4]


def test_one_program_refuses_more_than_its_limit():
    ids = torch.zeros(1025, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most 1024 slots"):
        moe_align_block_size_triton(ids, 16, 8, one_program=True)


# The interpreter sorts slowly: the large cases (8 and 12 chunks) run on a GPU only.
CHUNKED_CASES = [(129, 8, 128, 64), (400, 3, 1500, 16)] + (
    [(1024, 8, 128, 128), (3000, 4, 60, 64)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("n_tokens,k,E,block", CHUNKED_CASES)
def test_chunked_matches_reference_over_many_chunks(n_tokens, k, E, block):
    # Several 1024-slot chunks, the last one partial; a skewed expert so one
    # expert's slots span every chunk; E above the one-program limit.
    g = torch.Generator().manual_seed(n_tokens + E)
    logits = torch.randn(n_tokens, E, generator=g)
    logits[:, 3] += 2.0
    ids = torch.topk(logits, k).indices.to(torch.int32).to(DEVICE)
    want = moe_align_block_size(ids, block, E)
    for got in (moe_align_block_size_triton(ids, block, E, one_program=False),
                moe_align_block_size_triton(ids, block, E)):
        for x, y in zip(got, want):
            assert torch.equal(x, y)


def test_triton_align_more_slots_than_one_scan_step():
    # 1200 slots > one 1024-slot chunk; experts 20-23 unrouted.
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 20, (400, 3), generator=g, dtype=torch.int32)
    ids[:300, 0] = 17
    ids = ids.to(DEVICE)
    want = moe_align_block_size(ids, 32, 24)
    got = moe_align_block_size_triton(ids, 32, 24)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
