"""Owner tags of pool pages.

The pool treats owners as opaque hashables; only ``ExpertKey`` is recognised,
so that accounting can tell resident expert matrices from other middle-page
owners (load buffers, pinned scratch).  KV owners are whatever the caller
passes (SGLang: a request tag, or ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EXPERT_MATRICES", "ExpertKey", "load_buffer_owner"]

#: The three matrices of one expert, one expert page each: W1 (gate), W3 (up), W2 (down).
EXPERT_MATRICES: tuple[str, str, str] = ("w1", "w3", "w2")


@dataclass(frozen=True, order=True)
class ExpertKey:
    """One expert matrix of one layer (one TP shard): the owner of one expert page."""

    layer: int
    expert: int
    matrix: Literal["w1", "w3", "w2"]

    def __post_init__(self) -> None:
        if self.matrix not in EXPERT_MATRICES:
            raise ValueError(f"matrix must be one of {EXPERT_MATRICES}, got {self.matrix!r}")
        if self.layer < 0 or self.expert < 0:
            raise ValueError(f"layer and expert must be >= 0, got {self.layer}, {self.expert}")


def load_buffer_owner(slot: int) -> tuple[str, int]:
    """The owner tag of one load-buffer page (counted as 'other' in ``PoolStats``)."""
    return ("load_buffer", slot)
