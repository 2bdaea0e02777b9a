"""Running SGLang 0.5.17 on a CPU without the CPU build of sgl-kernel.

Active only when the server runs with ``--device cpu``; nothing here is
installed on a CUDA machine. Three kinds of change:

* environment, before the first ``import sglang`` in every process
  (:func:`prepare_process`): the CPU-engine switch, OpenMP threads per TP
  rank, and the ``sgl_kernel`` stand-in;
* seams (registered below): torch versions of the few Triton calls SGLang
  makes on this path, and no PyNccl communicator on CPU;
* launch defaults (:func:`default_cli_args`): a KV pool cap, since SGLang
  otherwise sizes the pool from free RAM and fills the machine; and
  ``--sleep-on-idle``, since an idle scheduler otherwise spins on a core.
"""

from __future__ import annotations

import os

import torch

from rimuru_patches.context import ProcessContext
from rimuru_patches.cpu_platform import sgl_kernel_standin
from rimuru_patches.seams import Seam, register

#: default ``--max-total-tokens`` on CPU when the user gives none
DEFAULT_MAX_TOTAL_TOKENS = 16384


def prepare_process(ctx: ProcessContext) -> None:
    """Environment every SGLang process on CPU needs before importing sglang."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    cores = os.cpu_count() or 1
    if ctx.tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        # One disjoint core range per TP rank; without it SGLang asserts that
        # tp_size <= NUMA nodes, and ranks oversubscribe the cores.
        per_rank = max(1, cores // ctx.tp_size)
        ranges = []
        for rank in range(ctx.tp_size):
            first = (rank * per_rank) % cores
            last = min(first + per_rank, cores) - 1
            ranges.append(str(first) if first == last else f"{first}-{last}")
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(ranges)
    # N ranks x all cores each crawls (~5 tok/s at TP=2 on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, ctx.tp_size))))
    sgl_kernel_standin.install()


def default_cli_args(argv: list[str]) -> list[str]:
    """SGLang flags the CPU platform adds when the user did not give them."""
    extra: list[str] = []
    if not any(a == "--max-total-tokens" or a.startswith("--max-total-tokens=") for a in argv):
        extra += ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)]
    if "--sleep-on-idle" not in argv:
        # An idle scheduler otherwise polls its sockets in a loop and holds a whole core,
        # which on a CPU server is a core its own forward passes (and the tokenizer) lack.
        # SGLang's IdleSleeper waits on the same sockets instead, woken by the next request.
        extra += ["--sleep-on-idle"]
    return extra


def _on_cpu(ctx: ProcessContext) -> bool:
    return ctx.on_cpu


def _no_pynccl(original, ctx):
    def init_model_parallel_group(*args, **kwargs):
        # PyNccl needs CUDA; on CPU the gloo group does all communication.
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    return init_model_parallel_group


def _gate_sigmoid_mul_add(original, ctx):
    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        # final += sigmoid(hidden @ gate) * shared, the Triton kernel's contract.
        gate = torch.sigmoid((hidden_states.float() @ gate_weight.float()).unsqueeze(-1))
        final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))

    return fused_gate_sigmoid_mul_add


register(
    Seam(
        name="cpu.no_pynccl",
        target="sglang.srt.distributed.parallel_state:init_model_parallel_group",
        why="GroupCoordinator builds a PyNccl communicator for every group, which fails on CPU (TP>1)",
        build=_no_pynccl,
        applies=_on_cpu,
    )
)
register(
    Seam(
        name="cpu.qwen2_moe_shared_expert_gate",
        target="sglang.srt.models.qwen2_moe:fused_gate_sigmoid_mul_add",
        why="Qwen2-MoE's shared-expert gate calls a Triton kernel, which has no CPU driver",
        build=_gate_sigmoid_mul_add,
        applies=_on_cpu,
    )
)
