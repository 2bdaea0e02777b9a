"""paged_fused_moe's optional down_config, act_and_mul and combine (CPU: the Triton interpreter)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

import rimuru_kernels.paged_moe as pm  # noqa: E402
from rimuru_kernel_helpers import make_problem, rel_err  # noqa: E402
from rimuru_kernels import get_paged_moe_config, paged_fused_moe  # noqa: E402

UP = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1,
      "num_warps": 4, "num_stages": 1}
DOWN = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2,
        "num_warps": 2, "num_stages": 1}


def call(p, **kw):
    return paged_fused_moe(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                           inter_size=p.inter_size, page_elems=p.page_elems, **kw)


def reference(p):
    from rimuru_kernels import paged_fused_moe_reference

    return paged_fused_moe_reference(p.hidden, p.pool, p.page_table, p.topk_weights, p.topk_ids,
                                     inter_size=p.inter_size, page_elems=p.page_elems)


@pytest.fixture
def launches(monkeypatch):
    """Every GEMM launch as (N, K, config, launch options)."""
    seen = []
    launch = pm._launch_gemm

    def spy(*args, **kw):
        seen.append((kw["N"], kw["K"], dict(kw["config"]), dict(kw["options"])))
        return launch(*args, **kw)

    monkeypatch.setattr(pm, "_launch_gemm", spy)
    return seen


def test_down_config_reaches_the_down_gemm_only(launches):
    p = make_problem(9, I=48, seed=40)
    out = call(p, config=UP, down_config=DOWN)
    H, I = p.hidden.shape[1], p.inter_size
    # Without act_and_mul the gate/up GEMM is fused with SiLU*up: N = I.
    assert [(n, k) for n, k, _, _ in launches] == [(I, H), (H, I)]
    (_, _, up_cfg, up_opts), (_, _, down_cfg, down_opts) = launches
    assert up_cfg == UP and down_cfg == DOWN
    assert up_opts == {"num_warps": 4, "num_stages": 1}
    assert down_opts == {"num_warps": 2, "num_stages": 1}
    assert rel_err(out, reference(p)) < 1e-5


def test_without_down_config_both_gemms_use_config(launches):
    p = make_problem(5, seed=41)
    call(p, config=UP)
    assert [c for _, _, c, _ in launches] == [UP, UP]


def test_launch_options_are_only_what_the_config_has(launches):
    # SGLang passes **config to the launch: a config without num_warps/num_stages
    # gets Triton's defaults, not values the launcher makes up.
    p = make_problem(3, seed=42)
    bare = {k: UP[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")}
    call(p, config=bare, down_config=dict(bare, USE_TMA=False))
    assert [o for _, _, _, o in launches] == [{}, {}]


def test_down_config_with_another_block_size_m_is_refused():
    p = make_problem(3, seed=43)
    with pytest.raises(ValueError, match=r"paged_fused_moe: down_config: BLOCK_SIZE_M 32 differs "
                                         r"from config's 16"):
        call(p, config=UP, down_config=dict(DOWN, BLOCK_SIZE_M=32))


@pytest.mark.parametrize("arg", ["config", "down_config"])
def test_tma_and_missing_keys_are_refused(arg):
    p = make_problem(3, seed=44)
    kw = {"config": UP, arg: dict(UP if arg == "config" else DOWN, USE_TMA=True)}
    with pytest.raises(ValueError, match=f"paged_fused_moe: {arg}: USE_TMA"):
        call(p, **kw)
    kw[arg] = {"BLOCK_SIZE_M": 16}
    with pytest.raises(ValueError, match=f"paged_fused_moe: {arg}: missing keys"):
        call(p, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hooks_get_the_intermediates_and_their_writes_are_the_output(dtype):
    T, k, H, I = 7, 3, 64, 40
    p = make_problem(T, k=k, H=H, I=I, dtype=dtype, seed=45)
    calls = []

    def act_and_mul(x, out):
        calls.append(("act", tuple(x.shape), tuple(out.shape), x.dtype, out.dtype))
        out.copy_(F.silu(x[:, :I].float()) * x[:, I:].float())

    def combine(intermediate, out):
        calls.append(("combine", tuple(intermediate.shape), tuple(out.shape), intermediate.dtype, out.dtype))
        torch.sum(intermediate, dim=1, out=out)
        out.mul_(2.0)

    out = call(p, act_and_mul=act_and_mul, combine=combine)
    assert calls == [("act", (T * k, 2 * I), (T * k, I), dtype, dtype),
                     ("combine", (T, k, H), (T, H), dtype, dtype)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out, 2.0 * reference(p)) < tol


def test_hooks_equal_to_the_defaults_change_nothing():
    # The default path computes what the explicit one does: the shipped config
    # for both GEMMs, the module's SiLU*up kernel (fused into the gate/up GEMM
    # by default, unfused with the hook), its top-k sum.
    p = make_problem(33, k=4, seed=46)
    cfg = get_paged_moe_config(p.page_table.shape[0], p.inter_size, 33, p.hidden.device)
    default = call(p)
    explicit = call(p, config=cfg, down_config=dict(cfg), act_and_mul=pm._silu_and_mul,
                    combine=pm._sum_top_k)
    # Fused, the gate/up GEMM tiles I columns instead of 2I: the same products,
    # summed by differently shaped dots, so equal up to fp32 rounding.
    assert rel_err(default, explicit) < 1e-6
    assert rel_err(default, reference(p)) < 1e-5


def test_hooks_are_not_called_for_zero_tokens():
    p = make_problem(0, seed=47)

    def boom(*_):
        raise AssertionError("called")

    assert call(p, act_and_mul=boom, combine=boom).shape == (0, 64)


@pytest.mark.parametrize("T,I,dtype", [(1, 48, torch.float32), (9, 48, torch.float32),
                                       (4, 40, torch.bfloat16)])
def test_fused_silu_is_the_unfused_result(T, I, dtype):
    # I=48 / 40 with BLOCK_SIZE_N 32: a partial last N tile in both GEMMs. The
    # fused GEMM's dots have another N shape, so fp32 sums may round apart;
    # bf16 rounds gate and up as the unfused path stores them.
    p = make_problem(T, I=I, k=3, dtype=dtype, seed=50 + T)
    fused = call(p, config=UP)
    unfused = call(p, config=UP, act_and_mul=pm._silu_and_mul)
    assert rel_err(fused, unfused) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(fused, reference(p)) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_silu_zeroes_an_absent_up_page():
    # Expert 2's up page alone is -1: its SiLU(gate) * up is 0, as unfused.
    p = make_problem(6, k=2, seed=53)
    p.page_table[2, 1] = -1
    p.topk_ids[:, 0] = 2
    fused = call(p, config=UP, validate=False)
    unfused = call(p, config=UP, validate=False, act_and_mul=pm._silu_and_mul)
    assert torch.isfinite(fused).all()  # the -1 page's NaN-free stand-in was zeroed
    assert rel_err(fused, unfused) < 1e-6
    p.page_table[2, 1] = p.page_table[2, 0]  # a real page would change the output
    assert rel_err(call(p, config=UP, validate=False), fused) > 1e-3


def _gemm_up(p, aligned, out):
    H, I = p.hidden.shape[1], p.inter_size
    pm._launch_gemm(p.hidden, out, p.pool, p.page_table, p.topk_weights.reshape(-1), aligned,
                    N=2 * I, K=H, rows_per_page=I, slot_base=0, top_k=p.topk_ids.shape[1],
                    mul_routed_weight=False, page_elems=p.page_elems, config=UP,
                    options={"num_warps": 4, "num_stages": 1}, upcast=False)


def test_one_token_slot_blocks_equal_the_aligned_gemm():
    # T == 1 runs one M-block per slot with no alignment; each row's dots are
    # the aligned GEMM's.
    from rimuru_kernels import moe_align_block_size_triton

    p = make_problem(1, k=4, seed=54)
    rows, I = 4, p.inter_size
    slot = torch.full((rows, 2 * I), float("nan"), device=p.hidden.device)
    aligned = torch.full((rows, 2 * I), float("nan"), device=p.hidden.device)
    _gemm_up(p, p.topk_ids.reshape(-1).contiguous(), slot)
    _gemm_up(p, moe_align_block_size_triton(p.topk_ids, UP["BLOCK_SIZE_M"], p.page_table.shape[0]), aligned)
    assert torch.isfinite(slot).all()
    assert torch.equal(slot, aligned)
    assert rel_err(call(p), reference(p)) < 1e-5


def test_one_token_expert_id_outside_the_table_reads_nothing():
    # Slot mode reads the expert id straight from topk_ids: an id >= E must not
    # index past the page table. It contributes zero, as an absent expert does.
    E = 8
    p = make_problem(1, E=E, k=2, absent=(5,), seed=55)
    p.topk_ids[0, 1] = 5
    absent = call(p, validate=False)
    p.topk_ids[0, 1] = E
    outside = call(p, validate=False)
    assert torch.equal(absent, outside)


def test_default_top_k_sum_matches_torch():
    x = torch.randn(5, 3, 70, generator=torch.Generator().manual_seed(56))
    out = torch.empty(5, 70)
    pm._sum_top_k(x, out)
    assert torch.allclose(out, x.sum(dim=1), rtol=1e-6, atol=1e-6)


def test_fused_gemm_fits_an_unfused_config_into_shared_memory():
    # SGLang's E=128,N=768 H200 config at 4096 tokens (M128 N256 K64, 4 stages)
    # needs 4 * (128 + 2*256) * 64 * 2 B = 320 KB with B doubled: stages drop to
    # 2 (160 KB) and the tiles stay.
    big = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16,
           "num_warps": 8, "num_stages": 4}
    assert pm.fit_fused_config(big, 2) == dict(big, num_stages=2)
    # Too big even at 2 stages: BLOCK_SIZE_N halves.
    huge = dict(big, BLOCK_SIZE_K=128, BLOCK_SIZE_N=256)
    assert pm.fit_fused_config(huge, 2) == dict(huge, num_stages=2, BLOCK_SIZE_N=128)
    # What fits passes unchanged (the tuned tables'), also without num_stages.
    small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
    assert pm.fit_fused_config(small, 2) == small
    assert pm.fit_fused_config(dict(small, num_stages=5), 2) == dict(small, num_stages=5)


def test_tuned_h200_tables_fit_the_fused_gemm():
    # The tables tune_paged_moe.py wrote (the fused GEMM timed on the H200) pass
    # unchanged; the older hand-made ones (E=128,N=384, E=256,N=512) are fitted at launch.
    import json

    from rimuru_kernels import moe_config

    for name in ("E=128,N=768,device_name=NVIDIA_H200.json", "E=60,N=1408,device_name=NVIDIA_H200.json"):
        path = moe_config.CONFIG_DIR / name
        for tokens, cfg in json.loads(path.read_text()).items():
            assert pm.fit_fused_config(cfg, 2) == cfg, (path.name, tokens)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("missing", [0, 1, 2])  # W1 (gate), W3 (up), W2 (down)
def test_tile_in_page_missing_page_contributes_exactly_zero(fused, missing):
    # BLOCK_SIZE_N 32 divides I=64 and H=64: every tile lies in one page
    # (TILE_IN_PAGE), so a -1 page runs no K steps. Its slots must add exactly
    # what a zero routing weight adds (SiLU(0)*up = SiLU(gate)*0 = 0).
    p = make_problem(7, I=64, H=64, k=3, seed=60 + missing)
    e = int(p.topk_ids[0, 0])
    hooks = {} if fused else {"act_and_mul": pm._silu_and_mul}
    zero_weight = p.topk_weights.clone()
    zero_weight[p.topk_ids == e] = 0.0
    want = paged_fused_moe(p.hidden, p.pool, p.page_table, zero_weight, p.topk_ids, inter_size=64,
                           page_elems=p.page_elems, config=UP, **hooks)
    p.page_table[e, missing] = -1
    got = call(p, config=UP, validate=False, **hooks)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
