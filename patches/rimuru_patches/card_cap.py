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
card less what the device holds outside torch's allocator less ``MARGIN_MIB``.
What lies outside torch is not fixed: the CUDA context at first, then the host
store's page-locking, CUDA graphs' executables and the Triton kernels loaded as new
shapes come. With a cap measured once at start the capped Qwen3-30B-A3B elastic
server still went to 33,040 MiB on the 32,768 MiB card: torch stayed under its
31,784 MiB but outside it grew from 728 to ~1,300 MiB (bench/RESULTS.md, twelfth
session). So the cap follows it: it is measured again when the host store is pinned
(``follow(force=True)``) and before a forward pass at most every ``FOLLOW_S``
seconds (``ModelRunner.forward``; never during a graph capture), and set anew to
the card less what lies outside now. Over the cap torch frees its cache and
retries, as on the card, and raises ``OutOfMemoryError`` only when live tensors
need more: what the card would do. SGLang sizes its KV pool from the device's
free memory, not from this cap, so the sizing rule is unchanged. "Outside torch"
is the device's used memory less this process's reserved, so other processes on
the same GPU count against the card: conservative.

A benchmark knob, not a serving feature: on a real card leave it unset.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from rimuru_patches.seams import Seam, register

logger = logging.getLogger(__name__)

ENV_VAR = "SGLANG_RIMURU_CARD_MIB"
MIB = 1 << 20
#: what else may come to live outside torch's allocator later (cuBLAS handles, Triton's
#: loaded kernels, NCCL with TP=1: none)
MARGIN_MIB = 256

__all__ = ["ENV_VAR", "FOLLOW_S", "MARGIN_MIB", "card_mib", "cap_bytes", "follow", "outside_bytes"]

#: how often, at most, a capped process measures again what lies outside torch (seconds)
FOLLOW_S = 1.0
#: a change of the cap worth a log line (bytes)
LOG_STEP = 64 * MIB


@dataclasses.dataclass
class _Cap:
    """This process's emulated card: its device, size and the cap now set."""

    device: int
    card: int
    cap: int
    logged: int  # the cap last logged
    checked: float  # time.monotonic() of the last measurement


_CAP: _Cap | None = None


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


def outside_bytes(total: int, free: int, reserved: int) -> int:
    """Device memory in use outside this process's torch allocator."""
    return max(0, total - free - reserved)


def cap_bytes(card: int, total: int, free: int, reserved: int) -> int:
    """Torch's share of ``card`` bytes: the card less the device memory in use outside
    torch's allocator now (``total - free - reserved``) less ``MARGIN_MIB``. Refuses a
    card larger than the device or one that nothing would be left of."""
    if card > total:
        raise ValueError(f"{ENV_VAR}: an emulated card of {card // MIB} MiB is larger than the device's "
                         f"{total // MIB} MiB")
    outside = outside_bytes(total, free, reserved)
    cap = card - outside - MARGIN_MIB * MIB
    if cap <= 0:
        raise ValueError(f"{ENV_VAR}: an emulated card of {card // MIB} MiB leaves nothing for torch: "
                         f"{outside // MIB} MiB are in use outside its allocator already")
    return cap


def _cuda():
    import torch

    return torch.cuda


def _set(cuda, device: int, cap: int) -> None:
    # a cap of 0 is legal: every allocation then fails, as on a card that is full
    cuda.set_per_process_memory_fraction(max(0, cap) / cuda.get_device_properties(device).total_memory, device)


def follow(cuda=None, now: float | None = None, force: bool = False) -> int | None:
    """Measure again what lies outside torch and set the cap to the card less it, at most
    every ``FOLLOW_S`` seconds unless ``force``. Returns the cap now set; None without a cap.
    Past the card (outside torch alone over it) the cap goes to 0: the next allocation fails
    as it would on the card, instead of the start's refusal."""
    state = _CAP
    if state is None:
        return None
    now = time.monotonic() if now is None else now
    if not force and now - state.checked < FOLLOW_S:
        return state.cap
    cuda = cuda or _cuda()
    free, total = cuda.mem_get_info(state.device)
    outside = outside_bytes(total, free, cuda.memory_reserved(state.device))
    cap = state.card - outside - MARGIN_MIB * MIB
    state.checked = now
    if cap != state.cap:
        _set(cuda, state.device, cap)
        state.cap = cap
    if abs(cap - state.logged) >= LOG_STEP:
        logger.info("sglang-rimuru card emulation: %.1f MiB now in use outside torch's allocator; its cap "
                    "follows to %.1f MiB", outside / MIB, cap / MIB)
        state.logged = cap
    return cap


def _capped(orig, ctx):
    def init_torch_distributed(self, *args, **kwargs):
        global _CAP
        result = orig(self, *args, **kwargs)
        card = card_mib()
        if card is not None and str(self.device).startswith("cuda"):
            cuda = _cuda()
            device = cuda.current_device()
            free, total = cuda.mem_get_info(device)
            cap = cap_bytes(card * MIB, total, free, cuda.memory_reserved(device))
            _set(cuda, device, cap)
            _CAP = _Cap(device=device, card=card * MIB, cap=cap, logged=cap, checked=time.monotonic())
            logger.info("sglang-rimuru card emulation (%s): torch's allocator capped at %.1f MiB of the %d MiB "
                        "card (%.1f MiB in use outside it, %d MiB margin); the cap follows what lies outside "
                        "torch, measured again at most every %.0f s", ENV_VAR, cap / MIB, card,
                        card - cap / MIB - MARGIN_MIB, MARGIN_MIB, FOLLOW_S)
        return result

    return init_torch_distributed


def _following(orig, ctx):
    def forward(self, *args, **kwargs):
        if _CAP is not None and not _cuda().is_current_stream_capturing():
            follow()
        return orig(self, *args, **kwargs)

    return forward


def _on(ctx) -> bool:
    return not ctx.on_cpu and card_mib() is not None


register(Seam(
    name="bench.card_cap",
    target="sglang.srt.model_executor.model_runner:ModelRunner.init_torch_distributed",
    why="an emulated card's limit: torch's allocator gives its cache back at the card's size, as on the card",
    build=_capped, applies=_on))
register(Seam(
    name="bench.card_cap_follow",
    target="sglang.srt.model_executor.model_runner:ModelRunner.forward",
    why="an emulated card's limit follows what comes to live outside torch (graphs, loaded kernels)",
    build=_following, applies=_on))
