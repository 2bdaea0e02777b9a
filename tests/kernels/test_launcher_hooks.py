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
    assert [(n, k) for n, k, _, _ in launches] == [(2 * I, H), (H, I)]
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
    # The default path is the explicit one: the shipped config for both GEMMs,
    # the module's SiLU*up kernel, torch.sum over top-k.
    p = make_problem(33, k=4, seed=46)
    cfg = get_paged_moe_config(p.page_table.shape[0], p.inter_size, 33, p.hidden.device)
    default = call(p)
    explicit = call(p, config=cfg, down_config=dict(cfg), act_and_mul=pm._silu_and_mul,
                    combine=pm._sum_top_k)
    assert torch.equal(default, explicit)
    assert rel_err(default, reference(p)) < 1e-5


def test_hooks_are_not_called_for_zero_tokens():
    p = make_problem(0, seed=47)

    def boom(*_):
        raise AssertionError("called")

    assert call(p, act_and_mul=boom, combine=boom).shape == (0, 64)
