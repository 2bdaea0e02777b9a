"""PoolBuffer: every typed view aliases the same bytes, at the offsets the geometry says."""

from __future__ import annotations

import pytest
import torch

from sglang_rimuru.pool import PoolBuffer, PoolGeometry, kv_page_bytes_for

# KV: 3 layers, 2 KV heads, head_dim 4, bf16, 2 tokens per page -> token 96 B, page 192 B.
L, HEADS, DIM, PAGE = 3, 2, 4, 2
TOKEN_BYTES = L * 2 * HEADS * DIM * 2
K_BYTES = kv_page_bytes_for(L, HEADS, DIM, 2, PAGE)
# E = 500 B is not a multiple of K: KV ids 2, 5, ... straddle expert pages (holes).
GEO = PoolGeometry(total_bytes=4 * 500 + 7, expert_page_bytes=500, kv_page_bytes=K_BYTES)


def changed_bytes(buf: PoolBuffer, before: torch.Tensor) -> list[int]:
    return torch.nonzero(buf.data != before).flatten().tolist()


def test_buffer_size_and_flat_view() -> None:
    buf = PoolBuffer(GEO, zero=True)
    assert buf.nbytes == GEO.pool_bytes == 2000 and buf.data.dtype == torch.uint8
    flat = buf.expert_pages_flat(torch.bfloat16)
    assert flat.numel() == 1000 and flat.data_ptr() == buf.data.data_ptr()
    assert buf.expert_page_elems(torch.bfloat16) == 250
    with pytest.raises(ValueError, match="expert_page_bytes=500 is not a multiple"):
        buf.expert_page_elems(torch.float64)


def test_expert_page_view_writes_exactly_its_bytes() -> None:
    buf = PoolBuffer(GEO, zero=True)
    before = buf.data.clone()
    m = buf.expert_page_view(2, (10, 20), torch.bfloat16)  # 400 of the page's 500 bytes
    assert m.shape == (10, 20) and m.is_contiguous()
    m.fill_(1.5)  # bf16 1.5 = bytes c0 3f: every written byte changes
    assert changed_bytes(buf, before) == list(range(1000, 1400))
    flat = buf.expert_pages_flat(torch.bfloat16)
    page_elems = buf.expert_page_elems(torch.bfloat16)
    assert torch.equal(flat[2 * page_elems: 2 * page_elems + 200].view(10, 20), m)
    with pytest.raises(ValueError, match="needs 504 B, page has 500 B"):
        buf.expert_page_view(0, (252,), torch.bfloat16)
    with pytest.raises(ValueError, match="expert page 4"):
        buf.expert_page_view(4, (1,), torch.bfloat16)


@pytest.mark.parametrize(("layer", "which", "slot", "head"), [(0, "k", 0, 0), (1, "k", 5, 1),
                                                              (2, "v", 9, 0), (1, "v", 3, 1)])
def test_kv_view_writes_exactly_the_token_bytes(layer: int, which: str, slot: int, head: int) -> None:
    buf = PoolBuffer(GEO, zero=True)
    kv = buf.kv_views(L, HEADS, DIM, torch.bfloat16, PAGE)
    assert kv.token_bytes == TOKEN_BYTES == 96 and kv.page_size == PAGE
    t = (kv.k if which == "k" else kv.v)[layer]
    assert t.shape == (GEO.num_kv_page_ids * PAGE, HEADS, DIM)
    assert t.stride() == (TOKEN_BYTES // 2, DIM, 1)
    before = buf.data.clone()
    # values whose bf16 bytes are all non-zero, so every written byte changes
    t[slot, head] = torch.tensor([1.5, -2.5, 3.25, 0.75], dtype=torch.bfloat16)
    # token slot, then layer (K before V), then head: each a contiguous run of bytes
    start = slot * TOKEN_BYTES + (2 * layer + (which == "v")) * HEADS * DIM * 2 + head * DIM * 2
    assert changed_bytes(buf, before) == list(range(start, start + DIM * 2))
    assert torch.equal(buf.data[start: start + DIM * 2].view(torch.bfloat16), t[slot, head])


def test_kv_pages_alias_expert_pages() -> None:
    buf = PoolBuffer(GEO, zero=True)
    kv = buf.kv_views(L, HEADS, DIM, torch.bfloat16, PAGE)
    k_id = 3  # bytes [576, 768) inside expert page 1 = [500, 1000)
    assert GEO.expert_page_of_kv_page(k_id) == 1
    page = buf.expert_page_view(1, (250,), torch.bfloat16)
    kv.v[2][k_id * PAGE + 1, 1] = 7.0  # last layer's V, second token of the page, head 1
    elem = ((k_id * K_BYTES + TOKEN_BYTES + 5 * HEADS * DIM * 2 + DIM * 2) - 500) // 2
    assert torch.equal(page[elem: elem + DIM], torch.full((DIM,), 7.0, dtype=torch.bfloat16))
    # The last slot of every view lies inside the buffer.
    last = GEO.num_kv_page_ids * PAGE - 1
    kv.v[L - 1][last, HEADS - 1, DIM - 1] = 1.0  # bf16 1.0 = bytes 80 3f
    end = GEO.num_kv_page_ids * K_BYTES
    assert end <= buf.nbytes and buf.data[end - 2: end].tolist() == [0x80, 0x3F]


def test_kv_views_check_the_page_size() -> None:
    buf = PoolBuffer(GEO)
    with pytest.raises(ValueError, match="kv_page_bytes=192"):
        buf.kv_views(L, HEADS, DIM, torch.bfloat16, PAGE + 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        buf.kv_views(L, 0, DIM, torch.bfloat16, PAGE)


def test_ssm_page_view() -> None:
    g = PoolGeometry(total_bytes=96, expert_page_bytes=12, kv_page_bytes=4, ssm_page_bytes=8)
    buf = PoolBuffer(g, zero=True)
    buf.ssm_page_view(4, (2,), torch.float32).fill_(1.0)
    assert changed_bytes(buf, torch.zeros_like(buf.data)) == [34, 35, 38, 39]  # 1.0f = 00 00 80 3f
    with pytest.raises(ValueError, match="without ssm_page_bytes"):
        PoolBuffer(GEO).ssm_page_view(0, (1,), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_views_alias_on_cuda() -> None:
    buf = PoolBuffer(GEO, "cuda", zero=True)
    kv = buf.kv_views(L, HEADS, DIM, torch.bfloat16, PAGE)
    kv.k[1][6, 0] = 3.0
    start = 6 * TOKEN_BYTES + 2 * HEADS * DIM * 2
    assert buf.data.is_cuda and kv.k[1].data_ptr() == buf.data.data_ptr() + 2 * HEADS * DIM * 2
    assert torch.equal(buf.data[start: start + DIM * 2].view(torch.bfloat16).cpu(),
                       torch.full((DIM,), 3.0, dtype=torch.bfloat16))
