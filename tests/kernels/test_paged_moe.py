"""paged_fused_moe against the torch references, on scattered padded pages."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

from rimuru_kernel_helpers import DEVICE, INTERPRETED, make_problem, rel_err  # noqa: E402
from rimuru_kernels import (  # noqa: E402
    ExpertNotResidentError,
    contiguous_page_table,
    expert_weights_from_pool,
    fused_moe_dense_reference,
    pack_contiguous_weights,
    paged_fused_moe,
    paged_fused_moe_reference,
)


def run(p, **kw):
    """The kernel into a NaN-poisoned output buffer; checks every entry was written."""
    T, H = p.hidden.shape
    out = torch.full((T, H), float("nan"), dtype=p.hidden.dtype, device=p.hidden.device)
    res = paged_fused_moe(
        p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
        inter_size=p.inter_size, page_elems=p.page_elems, out=out, **kw,
    )
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "output not fully written (or read a NaN page)"
    return out


def reference(p):
    return paged_fused_moe_reference(
        p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
        inter_size=p.inter_size, page_elems=p.page_elems,
    )


@pytest.mark.parametrize("routing", ["uniform", "subset", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_fp32_matches_reference(T, routing):
    # I=48: BLOCK_N=32 does not divide I, so one tile spans the W1/W3 boundary;
    # down GEMM K=48 is not a multiple of BLOCK_K. "subset" leaves experts 5-7
    # unrouted and gives them page -1.
    absent = (5, 6, 7) if routing == "subset" else ()
    p = make_problem(T, I=48, routing=routing, absent=absent, seed=T)
    assert rel_err(run(p), reference(p)) < 1e-5


def test_fp32_ragged_inter_size():
    # I=40: 2I=80 ends inside an N tile; K=40 ragged too. Unpadded pages.
    p = make_problem(9, I=40, page_pad=0, seed=3)
    assert rel_err(run(p), reference(p)) < 1e-5


def test_matches_dense_reference_on_scattered_pages():
    p = make_problem(7, seed=4)
    ref = fused_moe_dense_reference(p.hidden, p.w13, p.w2, p.topk_weights, p.topk_ids)
    assert rel_err(run(p), ref) < 1e-5


def test_top_k_one_and_four():
    for k in (1, 4):
        p = make_problem(5, k=k, seed=10 + k)
        assert rel_err(run(p), reference(p)) < 1e-5


@pytest.mark.parametrize("T,upcast", [(7, True), (33, None)])
def test_bf16(T, upcast):
    # upcast=None upcasts under the interpreter (its bf16 dot is wrong), not on GPU.
    p = make_problem(T, dtype=torch.bfloat16, seed=20 + T)
    # Intermediates are stored in bf16, as in SGLang: ~1e-2 from fp32.
    assert rel_err(run(p, upcast=upcast), reference(p)) < 2e-2


def test_fp16():
    p = make_problem(7, dtype=torch.float16, seed=30)
    assert rel_err(run(p), reference(p)) < 5e-3


def test_contiguous_pack_matches_dense_reference():
    g = torch.Generator().manual_seed(5)
    E, H, I, T = 8, 64, 32, 7
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).to(DEVICE)
    w2 = (torch.randn(E, H, I, generator=g) / 8).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    tw, ti = torch.topk(torch.randn(T, E, generator=g).softmax(-1), 2)
    tw, ti = tw.to(DEVICE), ti.to(DEVICE)

    packed = pack_contiguous_weights(w13, w2)
    table, page_elems = contiguous_page_table(E, I, H, device=DEVICE)
    assert torch.equal(packed.page_table, table)
    assert packed.page_elems == page_elems == I * H
    assert packed.page_table[5].tolist() == [15, 16, 17]
    assert packed.pool.numel() == 3 * E * I * H
    w1, w3, w2_5 = expert_weights_from_pool(
        packed.pool, packed.page_table, 5, inter_size=I, hidden_size=H, page_elems=page_elems
    )
    assert torch.equal(w1, w13[5, :I]) and torch.equal(w3, w13[5, I:])
    assert torch.equal(w2_5, w2[5])

    out = paged_fused_moe(x, packed.pool, packed.page_table, tw, ti,
                          inter_size=I, page_elems=packed.page_elems)
    assert rel_err(out, fused_moe_dense_reference(x, w13, w2, tw, ti)) < 1e-5


def test_scattered_and_contiguous_layouts_agree_exactly():
    p = make_problem(11, seed=6)
    packed = pack_contiguous_weights(p.w13, p.w2)
    contiguous = paged_fused_moe(p.hidden, packed.pool, packed.page_table, p.topk_weights,
                                 p.topk_ids, inter_size=p.inter_size,
                                 page_elems=packed.page_elems)
    assert torch.equal(run(p), contiguous)


def test_zero_tokens():
    p = make_problem(0, seed=7)
    out = paged_fused_moe(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                          inter_size=p.inter_size, page_elems=p.page_elems)
    assert out.shape == (0, 64)


def test_routed_expert_without_page_raises():
    p = make_problem(7, routing="skewed", seed=8)  # every token routes to expert 3
    p.page_table[3, 1] = -1
    with pytest.raises(ExpertNotResidentError, match=r"\[3\]"):
        paged_fused_moe(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                        inter_size=p.inter_size, page_elems=p.page_elems, validate=True)


def test_unvalidated_missing_page_contributes_zero():
    p = make_problem(7, routing="skewed", seed=9)
    p.page_table[3] = -1
    out = run(p, validate=False)
    weights = p.topk_weights * (p.topk_ids != 3)
    ref = paged_fused_moe_reference(
        p.hidden, p.pool, p.page_table, weights, torch.where(p.topk_ids == 3, 0, p.topk_ids),
        inter_size=p.inter_size, page_elems=p.page_elems,
    )
    assert rel_err(out, ref) < 1e-5


def _bad_inputs():
    """(argument named in the error, change to a valid problem's inputs)."""
    def f(**change):
        return change

    p = make_problem(3, seed=11)
    T, H = p.hidden.shape
    return p, [
        ("hidden", f(hidden=p.hidden[None])),
        ("hidden", f(hidden=p.hidden.to(torch.int32))),
        ("hidden", f(hidden=p.hidden.t())),
        ("pool", f(pool=p.pool.view(-1, 2))),
        ("pool", f(pool=p.pool.to(torch.float16))),
        ("page_table", f(page_table=p.page_table[:, :2])),
        ("page_table", f(page_table=p.page_table.float())),
        ("topk_ids", f(topk_ids=p.topk_ids[:2])),
        ("topk_ids", f(topk_ids=p.topk_ids.float())),
        ("topk_weights", f(topk_weights=p.topk_weights[:, :1])),
        ("inter_size", f(inter_size=0)),
        ("page_elems", f(page_elems=p.inter_size * H - 1)),
        ("out", f(out=torch.empty(T + 1, H, device=DEVICE))),
        ("out", f(out=torch.empty(T, H, dtype=torch.float16, device=DEVICE))),
        ("topk_ids", f(topk_ids=torch.full_like(p.topk_ids, 8))),
        ("page_table", f(page_table=p.page_table + 1000)),
        ("config", f(config={"BLOCK_SIZE_M": 16})),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs()[1])))
def test_bad_inputs_raise_value_error_naming_the_argument(case):
    p, cases = _bad_inputs()
    arg, change = cases[case]
    kw = dict(hidden=p.hidden, pool=p.pool, page_table=p.page_table,
              topk_weights=p.topk_weights, topk_ids=p.topk_ids,
              inter_size=p.inter_size, page_elems=p.page_elems, validate=True)
    kw.update(change)
    with pytest.raises(ValueError, match=f"paged_fused_moe: {arg}:"):
        paged_fused_moe(**kw)


@pytest.mark.skipif(not INTERPRETED, reason="checks the CPU/interpreter guard")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    import rimuru_kernels.paged_moe as pm

    monkeypatch.setattr(pm, "INTERPRETED", False)
    p = make_problem(1, seed=12)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        paged_fused_moe(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                        inter_size=p.inter_size, page_elems=p.page_elems)


def move_to_host(p, experts, extra=()):
    """Move the matrices of ``experts`` (and ``extra`` (expert, matrix) pairs) out of the
    pool into unpadded host pages; the pool pages are NaN-poisoned, the table rows
    get ``-2 - h``. Returns the host pages tensor (pinned when the pool is on CUDA)."""
    I, H = p.inter_size, p.hidden.shape[1]
    moves = [(e, m) for e in experts for m in range(3)] + list(extra)
    table = p.page_table.cpu().clone()
    host = torch.empty(len(moves) * I * H, dtype=p.pool.dtype, pin_memory=p.pool.is_cuda)
    for h, (e, m) in enumerate(moves):
        page = int(table[e, m])
        host[h * I * H:(h + 1) * I * H].copy_(p.pool[page * p.page_elems: page * p.page_elems + I * H])
        p.pool[page * p.page_elems: (page + 1) * p.page_elems] = float("nan")
        table[e, m] = -2 - h
    p.page_table.copy_(table)
    return host


@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("I, fused", [(48, True), (48, False), (64, True), (64, False)])
def test_host_pages_read_in_place_equal_pool_pages(T, I, fused):
    # I=48: tiles span W1/W3 (per-column lookup); I=64 with BLOCK_N=32: one page per
    # tile (TILE_IN_PAGE). Experts 1 and 6 wholly on the host, expert 3's W3 alone.
    p = make_problem(T, I=I, routing="skewed", seed=40 + T)
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
    kw = {"config": config}
    if not fused:
        kw["act_and_mul"] = lambda x, out: out.copy_(
            (torch.nn.functional.silu(x[:, :I].float()) * x[:, I:].float()).to(out.dtype))
    want = run(p, **kw)
    host = move_to_host(p, (1, 6), extra=[(3, 1)])
    got = run(p, host_pages=host, **kw)
    assert torch.equal(got, want)  # the same loads and dots, from other addresses
    ref = paged_fused_moe_reference(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                                    inter_size=p.inter_size, page_elems=p.page_elems,
                                    host_pages=host.to(p.pool.device))
    assert rel_err(got, ref) < 1e-5


def test_host_page_past_the_host_tensor_is_refused_when_validating():
    p = make_problem(5, seed=50)
    host = move_to_host(p, (0, 1, 2, 3, 4, 5, 6, 7))
    with pytest.raises(ValueError, match=r"reads host pages \[.*\], host_pages holds 6"):
        paged_fused_moe(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids, inter_size=p.inter_size,
                        page_elems=p.page_elems, host_pages=host[: 6 * p.inter_size * 64], validate=True)
