"""``AdjusterPolicy``: how many experts to evict or restore this round (DESIGN §5).

Pure arithmetic on two page counts, in expert-page units:

    short (R_b)  expert pages the schedule is short of
    free  (F_b)  whole free expert pages

    R_b > 0                  evict   ceil((R_b + 1) / 3)              reason "kv_short"
    R_b == 0 and F_b < 2     evict   1                                reason "low_water"
    F_b > 9                  restore min(5, floor((F_b - 9) / 3))     reason "high_water"
    otherwise (2 <= F_b <= 9, or a restore count of 0)  nothing       reason "hold"

(2, 9, 5 and 3 are the defaults of the fields below.)  The band between the low
and the high water is hysteresis: a restore leaves F_b >= high water, and one
pre-emptive eviction leaves F_b < low water + 3 < high water, so the two rules
never undo each other round after round.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

__all__ = ["FLAGS", "REASONS", "AdjusterPolicy", "Decision"]

#: The command-line flag behind each tunable field (for ``config.py`` and error messages).
FLAGS: dict[str, str] = {
    "evict_low_water": "--rimuru-adjuster-evict-low-water",
    "restore_high_water": "--rimuru-adjuster-restore-high-water",
    "max_restores_per_round": "--rimuru-adjuster-max-restores",
}

#: ``Decision.reason`` values.
#: ("priced_out": the adjuster dropped an eviction that would not pay for its PCIe
#: time, see ``cost.py``; "restore_pays": while requests wait, it brought experts
#: back into free pages because their PCIe time costs more than the requests those
#: pages would hold; "restore_priced_out": the high water asked for restores while
#: requests ran and waited, and none paid; the policy itself returns none of these)
REASONS: tuple[str, ...] = ("kv_short", "low_water", "high_water", "hold", "priced_out", "restore_pays",
                            "restore_priced_out")


class Decision(NamedTuple):
    """Experts to evict and to restore this round (at most one of them is non-zero)."""

    evict: int
    restore: int
    reason: str


@dataclasses.dataclass(frozen=True)
class AdjusterPolicy:
    """The paper's thresholds, in expert pages; ``decide`` is the whole rule.

    Contract: ``restore_high_water > evict_low_water + pages_per_expert`` (one
    pre-emptive eviction lands strictly inside the hysteresis band), all fields
    ints (not bool), ``pages_per_expert >= 1``, the others ``>= 0``.
    ``max_restores_per_round = 0`` turns restoring off.
    """

    #: R_b == 0 and F_b below this: evict one expert pre-emptively
    evict_low_water: int = 2
    #: F_b above this: restore experts, keeping F_b >= this
    restore_high_water: int = 9
    #: most restores in one round (keeps the prefetch channel free)
    max_restores_per_round: int = 5
    #: expert pages per expert: W1, W3, W2 (a property of the pool layout, not a flag)
    pages_per_expert: int = 3

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            flag = FLAGS.get(f.name, f"AdjusterPolicy.{f.name}")
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{flag} must be an int, got {v!r}")
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        if self.pages_per_expert < 1:
            raise ValueError(f"AdjusterPolicy.pages_per_expert must be >= 1, got {self.pages_per_expert}")
        lo, hi, ppe = self.evict_low_water, self.restore_high_water, self.pages_per_expert
        if hi <= lo + ppe:
            raise ValueError(
                f"{FLAGS['restore_high_water']}={hi} must exceed "
                f"{FLAGS['evict_low_water']}={lo} + {ppe} (pages per expert) = {lo + ppe}, "
                f"or a pre-emptive eviction could leave the pool above the restore threshold "
                f"(evict/restore ping-pong)")

    def decide(self, short_pages: int, free_pages: int) -> Decision:
        """The rule of the module docstring for R_b = ``short_pages``, F_b = ``free_pages``."""
        for name, v in (("short_pages", short_pages), ("free_pages", free_pages)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        ppe = self.pages_per_expert
        if short_pages > 0:
            return Decision(-(-(short_pages + 1) // ppe), 0, "kv_short")
        if free_pages < self.evict_low_water:
            return Decision(1, 0, "low_water")
        if free_pages > self.restore_high_water:
            n = min(self.max_restores_per_round, (free_pages - self.restore_high_water) // ppe)
            if n > 0:
                return Decision(0, n, "high_water")
        return Decision(0, 0, "hold")
