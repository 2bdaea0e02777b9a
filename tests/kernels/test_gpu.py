"""The compiled kernel on CUDA in bf16 (skipped without CUDA, or under the interpreter)."""

import pytest
import torch

pytest.importorskip("triton")

from rimuru_kernel_helpers import INTERPRETED, rel_err  # noqa: E402
from rimuru_kernels import (  # noqa: E402
    pack_contiguous_weights,
    pack_weights_into_pool,
    paged_fused_moe,
    paged_fused_moe_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 runs no compiled kernel"),
]


def problem(T, E, H, I, k, *, page_pad=64, first_page=0, spare_pages=7, seed=0):
    """bf16 weights on shuffled pages numbered from first_page; skewed routing."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    hidden = torch.randn(T, H, generator=g, device=dev).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=dev) / I**0.5).bfloat16()
    logits = torch.randn(T, E, generator=g, device=dev)
    logits[:, 1] += 2.0
    tw, ti = torch.topk(logits.softmax(-1), k)
    n = 3 * E + spare_pages
    perm = torch.randperm(n, generator=g, device=dev)[: 3 * E]
    table = (first_page + perm).view(E, 3).to(torch.int32)
    page_elems = I * H + page_pad
    pool = pack_weights_into_pool(w13, w2, table, page_elems, first_page + n)
    return hidden, w13, w2, tw, ti.to(torch.int32), pool, table, page_elems


def check(T, E, H, I, k, **kw):
    x, w13, w2, tw, ti, pool, table, pe = problem(T, E, H, I, k, **kw)
    out = torch.full_like(x, float("nan"))
    paged_fused_moe(x, pool, table, tw, ti, inter_size=I, page_elems=pe, out=out,
                    validate=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref = paged_fused_moe_reference(x, pool, table, tw, ti, inter_size=I, page_elems=pe)
    assert rel_err(out, ref) < 2e-2

    # The same weights packed contiguously: the same kernel, bit for bit.
    packed = pack_contiguous_weights(w13, w2)
    contiguous = paged_fused_moe(x, packed.pool, packed.page_table, tw, ti,
                                 inter_size=I, page_elems=packed.page_elems)
    assert torch.equal(out, contiguous)
    del pool, packed


@pytest.mark.parametrize("T", [1, 64, 300])
def test_bf16_small_shape(T):
    check(T, E=16, H=512, I=320, k=4)


@pytest.mark.parametrize("T", [1, 33, 256, 2048])
def test_bf16_qwen3_30b_a3b_shape(T):
    check(T, E=128, H=2048, I=768, k=8, seed=T)


def test_page_offsets_past_int32():
    # Pages numbered from 1400: offsets ~1400 * 1.57M elements > 2**31.
    H, I = 2048, 768
    first = 1400
    assert first * (I * H + 64) > 2**31
    check(16, E=4, H=H, I=I, k=2, first_page=first, spare_pages=0)


def test_bf16_default_upcast_is_off_on_gpu_and_upcast_agrees():
    x, w13, w2, tw, ti, pool, table, pe = problem(64, 8, 256, 160, 2, seed=3)
    a = paged_fused_moe(x, pool, table, tw, ti, inter_size=160, page_elems=pe)
    b = paged_fused_moe(x, pool, table, tw, ti, inter_size=160, page_elems=pe, upcast=True)
    assert rel_err(a, b) < 1e-2


def test_cuda_graph_capture_and_replay():
    # The launcher (validate off) is capturable: no host syncs, no CPU tensors.
    x, w13, w2, tw, ti, pool, table, pe = problem(48, 16, 512, 320, 4, seed=4)
    out = torch.empty_like(x)

    def call():
        paged_fused_moe(x, pool, table, tw, ti, inter_size=320, page_elems=pe, out=out,
                        validate=False)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    ti.copy_(ti.flip(0))  # new routing, same buffers
    tw.copy_(tw.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    want = paged_fused_moe(x, pool, table, tw, ti, inter_size=320, page_elems=pe)
    assert torch.equal(out, want)
    assert not torch.equal(out, eager)
