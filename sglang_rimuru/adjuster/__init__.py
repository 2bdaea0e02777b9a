"""The adjuster: moves the expert / KV split of the unified pool every scheduling round.

``policy`` (how many), ``selection`` (which experts), ``orders`` (the versioned
scheduler -> worker message) and ``adjuster`` (the round logic and in-flight
bookkeeping).  See README.md.

``policy``, ``selection`` and ``orders`` use the standard library only, so a
process that only decodes orders never imports torch; ``Adjuster`` (which needs
``sglang_rimuru.pool`` and ``sglang_rimuru.experts``, hence torch) is loaded on
first use.  Never imports sglang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .orders import (
    ORDER_TYPE,
    ORDER_VERSION,
    ExpertMove,
    MigrationOrder,
    OrderError,
    OrderSequencer,
    decode,
    encode,
)
from .policy import FLAGS, REASONS, AdjusterPolicy, Decision
from .selection import pick_offloaded_at_start, pick_restores, pick_victims

if TYPE_CHECKING:
    from .adjuster import Adjuster, AdjusterStats, EvictionPrice, Load, RoundRecord

__all__ = [
    "FLAGS",
    "ORDER_TYPE",
    "ORDER_VERSION",
    "REASONS",
    "Adjuster",
    "AdjusterPolicy",
    "AdjusterStats",
    "Load",
    "Decision",
    "EvictionPrice",
    "ExpertMove",
    "MigrationOrder",
    "OrderError",
    "OrderSequencer",
    "RoundRecord",
    "decode",
    "encode",
    "pick_offloaded_at_start",
    "pick_restores",
    "pick_victims",
]

_LAZY = {"Adjuster", "AdjusterStats", "EvictionPrice", "Load", "RoundRecord"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import adjuster

        return getattr(adjuster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
