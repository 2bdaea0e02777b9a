"""Constrained decoding (xgrammar) on CPU: the token bitmask in plain CPU memory.

SGLang 0.5.17's xgrammar backend cannot run on a machine without CUDA:

* ``xgrammar_backend._allocate_token_bitmask`` allocates the per-batch token
  bitmask with ``pin_memory=True`` (so its copy to the GPU can be
  non-blocking); pinning needs the CUDA driver, so the first batch with a
  ``regex``/``json_schema``/``ebnf`` request dies with "Found no NVIDIA driver
  on your system" -- in the scheduler, which takes the whole server down;
* past that, ``apply_vocab_mask`` knows only GPU kernels and raises
  "Unsupported device: cpu".

Both live on ``XGrammarGrammar`` (the per-request grammar the sampler asks
for the mask: ``SamplingBatchInfo.update_regex_vocab_mask``) and on
``XGrammarGrammarBackend`` (whose static versions serve the strict-thinking
token filter). The seams below subclass both and override only those two
methods: the mask is xgrammar's own unpinned CPU allocation, filled in place
and "moved" to the model's device (the CPU, so no copy), and applied with
xgrammar's CPU kernel. SGLang creates both classes through module globals
(``_from_context``/``copy``, ``create_grammar_backend``), so replacing the
module attributes is enough. Active only with ``--device cpu``.
"""

from __future__ import annotations

import torch

from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, register

XGRAMMAR_BACKEND = "sglang.srt.constrained.xgrammar_backend"


def allocate_bitmask(vocab_size: int, batch_size: int) -> torch.Tensor:
    """All-allowed int32 bitmask [batch, ceil(vocab/32)] in pageable CPU memory."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """logits[i, j] = -inf where bit j of row i is 0 (xgrammar's CPU kernel)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask)


def _grammar_on_cpu(original, ctx):
    class CpuXGrammarGrammar(original):
        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            # xgrammar fills it on the CPU; the inherited move_vocab_mask then takes it to
            # the model's device, which here is the CPU (no copy)
            return allocate_bitmask(vocab_size, batch_size)

        def apply_vocab_mask(self, logits, vocab_mask):
            apply_bitmask(logits, vocab_mask)

    return CpuXGrammarGrammar


def _backend_on_cpu(original, ctx):
    class CpuXGrammarGrammarBackend(original):
        @staticmethod
        def allocate_vocab_mask(vocab_size, batch_size, device):
            return allocate_bitmask(vocab_size, batch_size)

        @staticmethod
        def apply_vocab_mask(logits, vocab_mask):
            apply_bitmask(logits, vocab_mask)

    return CpuXGrammarGrammarBackend


def _on_cpu(ctx: ProcessContext) -> bool:
    return ctx.on_cpu


register(
    Seam(
        name="cpu.xgrammar_grammar",
        target=f"{XGRAMMAR_BACKEND}:XGrammarGrammar",
        why="the per-request grammar's token bitmask is pinned (needs CUDA) and applied by GPU kernels only",
        build=_grammar_on_cpu,
        applies=_on_cpu,
    )
)
register(
    Seam(
        name="cpu.xgrammar_backend",
        target=f"{XGRAMMAR_BACKEND}:XGrammarGrammarBackend",
        why="the backend's static bitmask allocate/apply (strict-thinking filter) need CUDA the same way",
        build=_backend_on_cpu,
        applies=_on_cpu,
    )
)
