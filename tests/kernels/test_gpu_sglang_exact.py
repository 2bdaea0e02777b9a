"""On CUDA, paged_fused_moe with SGLang's hooks equals SGLang 0.5.17's fused_experts_impl bit for bit.

The hooks are the ones the static mode installs (``rimuru_patches.unified_pool.
sglang_moe``): SGLang's launch configs, its ``silu_and_mul`` and its top-k
combine. SGLang's side runs as ``--rimuru-mode off`` runs it for an unquantized
model without expert parallelism (``inplace=True``, ``filter_expert=False``).
Skipped without CUDA or SGLang; needs a machine where SGLang's MoE runs (sgl_kernel,
nvcc for the JIT ``silu_and_mul``).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sglang_rimuru.models.specs import build_config, get_spec

pytest.importorskip("triton")

from rimuru_kernel_helpers import INTERPRETED  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 runs no compiled kernel"),
]

if importlib.util.find_spec("rimuru_patches") is None:  # not installed: the checkout's copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "patches"))

# (E, H, I, top-k)
SHAPES = {
    "tiny-qwen3-moe": (8, 64, 32, 2),  # sglang_rimuru.models' tiny model
    "qwen3-30b-a3b": (128, 2048, 768, 8),  # TP1
}
TOKENS = [1, 16, 33, 64, 300]



@pytest.fixture(scope="module")
def fused_experts_impl(tmp_path_factory):
    """SGLang's fused MoE, callable alone once a ServerArgs is published (DEVICE_NOTES.md)."""
    pytest.importorskip("sglang")
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    model = tmp_path_factory.mktemp("qwen3-moe-config")
    # a config.json-only model: all ServerArgs needs
    build_config(get_spec("qwen3-30b-a3b")).to_json_file(str(model / "config.json"))
    runtime_context.publish(
        ServerArgs(model_path=str(model), attention_backend="triton", sampling_backend="pytorch",
                   disable_cuda_graph=True, grammar_backend="none"),
        role="test",
    )
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts_impl

    return fused_experts_impl


def problem(T, E, H, I, k, seed):
    """bf16 weights on shuffled, padded pool pages; fp32 renormalized top-k weights, int32 ids."""
    from rimuru_kernels import pack_weights_into_pool

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).bfloat16()
    logits = torch.randn(T, E, generator=g, device="cuda")
    logits[:, 1] += 1.0  # one hot expert: several tokens per expert even at small T
    tw, ti = torch.topk(logits.softmax(-1), k)
    tw = tw / tw.sum(-1, keepdim=True)
    num_pages = 3 * E + 5
    table = torch.randperm(num_pages, generator=g, device="cuda")[: 3 * E].view(E, 3).to(torch.int32)
    page_elems = I * H + 64
    pool = pack_weights_into_pool(w13, w2, table, page_elems, num_pages)
    return x, w13, w2, tw, ti.to(torch.int32), pool, table, page_elems


def check(fused_experts_impl, shape, T, scale=None):
    from rimuru_kernels import paged_fused_moe
    from rimuru_patches.unified_pool.sglang_moe import sglang_kernel_hooks

    E, H, I, k = SHAPES[shape]
    x, w13, w2, tw, ti, pool, table, page_elems = problem(T, E, H, I, k, seed=T + E)
    hooks = sglang_kernel_hooks(num_experts=E, hidden=H, inter=I, top_k=k, dtype=torch.bfloat16,
                                routed_scaling_factor=scale)
    config, down_config = hooks.configs(T)
    ours = paged_fused_moe(x, pool, table, tw, ti, inter_size=I, page_elems=page_elems,
                           config=config, down_config=down_config,
                           act_and_mul=hooks.act_and_mul, combine=hooks.combine)
    theirs = fused_experts_impl(x.clone(), w13, w2, tw, ti, inplace=True, filter_expert=False,
                                routed_scaling_factor=scale)
    torch.cuda.synchronize()
    assert torch.isfinite(ours).all()
    differ = (ours != theirs).sum().item()
    assert differ == 0, (
        f"{shape} T={T} scale={scale}: {differ} of {ours.numel()} outputs differ "
        f"(max |diff| {(ours.float() - theirs.float()).abs().max().item():.3e}); "
        f"config {config}, down_config {down_config}"
    )
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_kernel_with_sglang_hooks_is_bit_identical(fused_experts_impl, shape, T):
    check(fused_experts_impl, shape, T)


@pytest.mark.parametrize("T", [16, 64])  # the torch.compile'd sum (T <= 32) and sgl_kernel's
@pytest.mark.parametrize("shape", list(SHAPES))
def test_routed_scaling_factor_too(fused_experts_impl, shape, T):
    check(fused_experts_impl, shape, T, scale=2.5)
