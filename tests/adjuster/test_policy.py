"""AdjusterPolicy.decide: the paper's rule, exactly, and the field checks."""

from __future__ import annotations

import pytest

from sglang_rimuru.adjuster import AdjusterPolicy, Decision

# (R_b, F_b) -> (evict, restore, reason)
TABLE = [
    # R_b > 0: ceil((R_b + 1) / 3), whatever F_b is
    (1, 0, (1, 0, "kv_short")),
    (2, 0, (1, 0, "kv_short")),
    (3, 0, (2, 0, "kv_short")),
    (5, 0, (2, 0, "kv_short")),
    (6, 0, (3, 0, "kv_short")),
    (8, 0, (3, 0, "kv_short")),  # DESIGN: short 8 -> evict 3 -> 9 pages
    (9, 0, (4, 0, "kv_short")),
    (100, 0, (34, 0, "kv_short")),
    (1, 50, (1, 0, "kv_short")),
    # R_b == 0, F_b below the low water 2: one pre-emptive eviction
    (0, 0, (1, 0, "low_water")),
    (0, 1, (1, 0, "low_water")),
    # the hysteresis band 2..9: nothing
    *[(0, f, (0, 0, "hold")) for f in range(2, 10)],
    # F_b > 9: min(5, floor((F_b - 9) / 3)); 10 and 11 round down to nothing
    (0, 10, (0, 0, "hold")),
    (0, 11, (0, 0, "hold")),
    (0, 12, (0, 1, "high_water")),
    (0, 14, (0, 1, "high_water")),
    (0, 15, (0, 2, "high_water")),
    (0, 20, (0, 3, "high_water")),  # DESIGN: 20 free -> restore 3
    (0, 23, (0, 4, "high_water")),
    (0, 24, (0, 5, "high_water")),
    (0, 25, (0, 5, "high_water")),
    (0, 1000, (0, 5, "high_water")),  # at most 5 per round
]


@pytest.mark.parametrize("short,free,want", TABLE)
def test_decide_table(short, free, want) -> None:
    assert AdjusterPolicy().decide(short, free) == Decision(*want)


def test_design_examples() -> None:
    p = AdjusterPolicy()
    d = p.decide(8, 0)
    assert d.evict == 3 and d.evict * p.pages_per_expert == 9
    assert p.decide(0, 20).restore == 3


def test_defaults_are_the_papers() -> None:
    p = AdjusterPolicy()
    assert (p.evict_low_water, p.restore_high_water, p.max_restores_per_round,
            p.pages_per_expert) == (2, 9, 5, 3)


def test_no_ping_pong_over_the_band() -> None:
    """A restore never drops F_b below the high water; a pre-emptive eviction never lifts
    it above (so the next round holds), for every F_b up to a large pool."""
    p = AdjusterPolicy()
    for f in range(0, 300):
        d = p.decide(0, f)
        after = f - 3 * d.restore + 3 * d.evict
        if d.restore:
            assert after >= p.restore_high_water
        if d.evict:
            assert after <= p.restore_high_water
        if d.restore:  # never an eviction right after a restore ...
            assert p.decide(0, after).evict == 0
        if d.evict:  # ... nor a restore right after an eviction
            assert p.decide(0, after).restore == 0


def test_other_thresholds() -> None:
    p = AdjusterPolicy(evict_low_water=4, restore_high_water=20, max_restores_per_round=2)
    assert p.decide(0, 3) == Decision(1, 0, "low_water")
    assert p.decide(0, 4) == Decision(0, 0, "hold")
    assert p.decide(0, 29) == Decision(0, 2, "high_water")
    assert AdjusterPolicy(max_restores_per_round=0).decide(0, 100) == Decision(0, 0, "hold")


@pytest.mark.parametrize("kwargs,flag", [
    (dict(restore_high_water=5), "--rimuru-adjuster-restore-high-water=5"),
    (dict(evict_low_water=7), "--rimuru-adjuster-evict-low-water=7"),
    (dict(evict_low_water=-1), "--rimuru-adjuster-evict-low-water"),
    (dict(max_restores_per_round=-2), "--rimuru-adjuster-max-restores"),
    (dict(max_restores_per_round=True), "--rimuru-adjuster-max-restores"),
    (dict(restore_high_water=9.5), "--rimuru-adjuster-restore-high-water"),
    (dict(pages_per_expert=0), "pages_per_expert"),
])
def test_field_checks_name_the_flag(kwargs, flag) -> None:
    with pytest.raises(ValueError, match=flag.replace("-", r"\-").replace(".", r"\.")):
        AdjusterPolicy(**kwargs)


def test_band_boundary() -> None:
    AdjusterPolicy(evict_low_water=2, restore_high_water=6)  # 6 > 2 + 3
    with pytest.raises(ValueError, match="must exceed"):
        AdjusterPolicy(evict_low_water=2, restore_high_water=5)


@pytest.mark.parametrize("args", [(-1, 0), (0, -1), (True, 0), (0, 1.0)])
def test_decide_rejects_bad_counts(args) -> None:
    with pytest.raises(ValueError):
        AdjusterPolicy().decide(*args)
