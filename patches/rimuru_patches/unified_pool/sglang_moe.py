"""SGLang's own fused-MoE pieces, handed to the paged kernel (CUDA, unquantized bf16/fp16).

With them the static mode's MoE does the arithmetic of SGLang 0.5.17's
``fused_experts_impl`` (``sglang/srt/layers/moe/moe_runner/triton_utils/fused_moe.py``)
step for step, so its outputs are bit-identical to ``--rimuru-mode off``::

    SGLang (no EP, no LoRA, unquantized)              paged kernel + these hooks
    try_get_optimal_moe_config(.., return_down_config) configs(T): the same call
    moe_align_block_size(BLOCK_SIZE_M of config)       its own align (same blocks)
    fused_moe_kernel(gate/up, config)                  same tiles, same fp32 accumulation
    silu_and_mul (JIT CUDA, fast math on SM90)         act_and_mul = that function
    fused_moe_kernel(down, down_config or config, xw)  same tiles, x routing weight in fp32
    combine: k=1 direct / k=2 torch.add /              combine = the same dispatch on
      T<=32 moe_sum_reduce_torch_compile /               SGLang's own functions
      else sgl_kernel moe_sum_reduce (x scaling)

Every function is looked up where ``fused_experts_impl`` looks it up: in the
namespace of its module (``TARGETS``). ``silu_and_mul`` and ``moe_sum_reduce``
exist there only in a CUDA process, so this module is used only on CUDA; a
missing target stops the start with ``SeamTargetMissing`` naming it (ledger:
``patches/README.md``, row ``experts.kernel_hooks``).

Not reproduced (a warning says so at start): SGLang's TMA down GEMM (a tuned
``_down`` config with ``USE_TMA`` on a GPU that supports it),
``--enable-fused-moe-sum-all-reduce`` (an atomic-add combine, not deterministic
in SGLang either), and ``fused_experts_impl``'s k=1 with a scaling factor != 1
(SGLang reduces an unwritten buffer there; this reduces the real one).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from rimuru_patches.seams import SeamTargetMissing
from sglang_rimuru.experts import KernelHooks

logger = logging.getLogger(__name__)

#: where fused_experts_impl lives and looks its helpers up
FUSED_MOE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"

#: the names fused_experts_impl calls, in FUSED_MOE's namespace
TARGETS = (
    "try_get_optimal_moe_config",  # launch configs: up, and down (tuned "_down" file or the up table)
    "get_config_dtype_str",  # the dtype part of the config file name (None for bf16/fp16)
    "silu_and_mul",  # CUDA only: sglang.kernels.ops.activation.activation.silu_and_mul
    "_use_moe_sum_reduce_torch_compile",  # T <= 32 and not batch-invariant mode
    "moe_sum_reduce_torch_compile",  # torch.compile'd sum * scale
    "moe_sum_reduce",  # CUDA only: sgl_kernel.moe_sum_reduce
)

NAME = "experts.kernel_hooks"


def resolve_targets() -> dict[str, Any]:
    """``{name: SGLang's object}`` for every target, or ``SeamTargetMissing`` naming the missing ones."""
    try:
        module = importlib.import_module(FUSED_MOE)
    except ImportError as exc:
        raise SeamTargetMissing(f"seam {NAME!r}: cannot import {FUSED_MOE} ({exc})") from exc
    missing = [name for name in TARGETS if not hasattr(module, name)]
    if missing:
        raise SeamTargetMissing(
            f"seam {NAME!r}: {FUSED_MOE} has no {missing} in this process (SGLang 0.5.17 defines "
            "them on CUDA; the static mode's CUDA MoE calls them to match SGLang's arithmetic)"
        )
    return {name: getattr(module, name) for name in TARGETS}


def sglang_kernel_hooks(
    *,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    routed_scaling_factor: float | None = None,
) -> KernelHooks:
    """Hooks that make ``paged_fused_moe`` compute what ``fused_experts_impl`` computes
    for ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` (one TP shard, ``inter`` = I per shard)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"SGLang's fused MoE arithmetic is reproduced for bf16/fp16 weights, not {dtype}")
    fn = resolve_targets()
    w1_shape = (num_experts, 2 * inter, hidden)
    w2_shape = (num_experts, hidden, inter)
    config_dtype = fn["get_config_dtype_str"](dtype=dtype)
    get_config = fn["try_get_optimal_moe_config"]
    warned_tma = False

    def configs(num_tokens: int) -> tuple[dict, dict | None]:
        nonlocal warned_tma
        config, (down_config, _) = get_config(
            w1_shape, w2_shape, top_k, config_dtype, num_tokens, return_down_config=True
        )
        config = dict(config)  # SGLang's table entry: never mutate it
        if down_config is not None:
            down_config = dict(down_config)
            if down_config.pop("USE_TMA", False) and not warned_tma:
                warned_tma = True
                logger.warning(
                    "sglang-rimuru: SGLang's down-projection config for E=%d N=%d asks for TMA; the "
                    "paged kernel runs that GEMM without TMA (same tiles), outputs may differ from "
                    "--rimuru-mode off in the last bit", num_experts, inter,
                )
        return config, down_config

    scale = 1.0 if routed_scaling_factor is None else routed_scaling_factor
    use_compile = fn["_use_moe_sum_reduce_torch_compile"]
    sum_compiled = fn["moe_sum_reduce_torch_compile"]
    sum_reduce = fn["moe_sum_reduce"]

    def combine(intermediate: torch.Tensor, out: torch.Tensor) -> None:
        """fused_experts_impl's CUDA combine, branch for branch."""
        num_tokens, k = intermediate.shape[0], intermediate.shape[1]
        if k == 1 and scale == 1.0:
            out.copy_(intermediate[:, 0])  # SGLang's down GEMM writes the output directly
        elif k == 2 and scale == 1.0:
            torch.add(intermediate[:, 0], intermediate[:, 1], out=out)
        elif use_compile(num_tokens):
            sum_compiled(intermediate, out, scale)
        else:
            sum_reduce(intermediate, out, scale)

    return KernelHooks(configs=configs, act_and_mul=fn["silu_and_mul"], combine=combine)


#: where ``try_get_optimal_moe_config`` looks SGLang's tuned tables up
CONFIG_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"


def sglang_has_tuned_table(num_experts: int, inter: int, dtype: torch.dtype) -> bool:
    """Whether SGLang's own lookup (``get_moe_configs``, as ``try_get_optimal_moe_config``
    calls it: E, N = the per-shard intermediate size) finds a tuned table for this shape on
    this GPU, for this Triton version or an older one. Where it does, the exact kernel runs
    tuned tiles (Qwen3-30B-A3B on an H100: SGLang's H100 table, in-place reads at 50-52 GB/s,
    bench/RESULTS.md); where it does not, SGLang's default config (``config.choose_moe_kernel``)."""
    try:
        module = importlib.import_module(CONFIG_MODULE)
    except ImportError as exc:
        raise SeamTargetMissing(f"seam {NAME!r}: cannot import {CONFIG_MODULE} ({exc})") from exc
    missing = [name for name in ("get_moe_configs", "get_config_dtype_str") if not hasattr(module, name)]
    if missing:
        raise SeamTargetMissing(f"seam {NAME!r}: {CONFIG_MODULE} has no {missing} (SGLang 0.5.17 defines them; "
                                "--rimuru-moe-kernel auto asks them whether SGLang has a tuned table)")
    return module.get_moe_configs(num_experts, inter, module.get_config_dtype_str(dtype)) is not None
