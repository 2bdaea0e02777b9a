"""Emulating a smaller card on a large GPU: torch's allocator held to the card.

The benchmarks emulate a consumer card on the H200 by SGLang's own sizing rule
(``--mem-fraction-static`` = 0.886 x card / total) and check each process's peak
GPU memory against the card. What that rule does not emulate is the card's
limit: on a 32 GB card torch's caching allocator frees the blocks it keeps for
reuse when an allocation would not fit, while on a 141 GB GPU it never has to
and keeps them all. So the peak nvidia-smi reports on the H200 can hold cache a
real card would have given back. The elastic Qwen3-30B-A3B server at 32 GB went
from 31.2 to 36.0 GB while its eager passes grew (bench/RESULTS.md, eleventh
session), and nvidia-smi cannot tell live tensors from cache.

With ``SGLANG_RIMURU_CARD_MIB`` set (``bench/serving/run_one.py --card-cap``),
every process that sets up a CUDA device for SGLang's model
(``ModelRunner.init_torch_distributed``, any ``--rimuru-mode``, plain SGLang too)
caps torch's allocator with ``torch.cuda.set_per_process_memory_fraction``: the
card less what the process already holds outside torch's allocator (the CUDA
context; measured on the device right after SGLang set it up) less
``MARGIN_MIB``. The pool modes lower it again by the GPU memory that page-locking
the host store takes (``lower_by``). Over the cap torch frees its cache and
retries, as on the card, and raises ``OutOfMemoryError`` only when live
tensors need more: what the card would do. SGLang sizes its KV pool from the
device's free memory, not from this cap, so the sizing rule is unchanged.

A benchmark knob, not a serving feature: on a real card leave it unset.
"""

from __future__ import annotations

import logging
import os

from rimuru_patches.seams import Seam, register

logger = logging.getLogger(__name__)

ENV_VAR = "SGLANG_RIMURU_CARD_MIB"
MIB = 1 << 20
#: what else may come to live outside torch's allocator later (cuBLAS handles, Triton's
#: loaded kernels, NCCL with TP=1: none)
MARGIN_MIB = 256

__all__ = ["ENV_VAR", "MARGIN_MIB", "card_mib", "cap_bytes", "lower_by"]

#: (device index, the cap in bytes) once set in this process
_CAP: tuple[int, int] | None = None


def card_mib() -> int | None:
    """The card's MiB from ``SGLANG_RIMURU_CARD_MIB``, None when unset; a clear error when malformed."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={text!r}: expected the emulated card's size in MiB, an integer") from None
    if value <= 0:
        raise ValueError(f"{ENV_VAR}={value}: the emulated card's size in MiB must be positive")
    return value


def cap_bytes(card: int, total: int, free: int, reserved: int) -> int:
    """Torch's share of ``card`` bytes: the card less the device memory in use outside
    torch's allocator now (``total - free - reserved``) less ``MARGIN_MIB``. Refuses a
    card larger than the device or one that nothing would be left of."""
    if card > total:
        raise ValueError(f"{ENV_VAR}: an emulated card of {card // MIB} MiB is larger than the device's "
                         f"{total // MIB} MiB")
    outside = max(0, total - free - reserved)
    cap = card - outside - MARGIN_MIB * MIB
    if cap <= 0:
        raise ValueError(f"{ENV_VAR}: an emulated card of {card // MIB} MiB leaves nothing for torch: "
                         f"{outside // MIB} MiB are in use outside its allocator already")
    return cap


def _apply(cuda, device: int, cap: int) -> None:
    global _CAP
    cuda.set_per_process_memory_fraction(cap / cuda.get_device_properties(device).total_memory, device)
    _CAP = (device, cap)


def lower_by(nbytes: int, cuda=None) -> None:
    """Lower the cap by ``nbytes`` that came to live outside torch's allocator (the
    host store's page-locking); no-op without a cap."""
    if _CAP is None or nbytes <= 0:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda
    device, cap = _CAP
    _apply(cuda, device, cap - nbytes)
    logger.info("sglang-rimuru card emulation: torch's allocator lowered by %.1f MiB to %.1f MiB",
                nbytes / MIB, (cap - nbytes) / MIB)


def _capped(orig, ctx):
    def init_torch_distributed(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        card = card_mib()
        if card is not None and str(self.device).startswith("cuda"):
            import torch

            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            cap = cap_bytes(card * MIB, total, free, torch.cuda.memory_reserved(device))
            _apply(torch.cuda, device, cap)
            logger.info("sglang-rimuru card emulation (%s): torch's allocator capped at %.1f MiB of the %d MiB "
                        "card (%.1f MiB in use outside it, %d MiB margin)", ENV_VAR, cap / MIB, card,
                        card - cap / MIB - MARGIN_MIB, MARGIN_MIB)
        return result

    return init_torch_distributed


def _on(ctx) -> bool:
    return not ctx.on_cpu and card_mib() is not None


register(Seam(
    name="bench.card_cap",
    target="sglang.srt.model_executor.model_runner:ModelRunner.init_torch_distributed",
    why="an emulated card's limit: torch's allocator gives its cache back at the card's size, as on the card",
    build=_capped, applies=_on))
