"""probe_in_place: one timed pass over every MoE layer through the manager's own tables;
it counts exactly the offloaded experts the pass routes to (their bytes are the rate's)."""

from __future__ import annotations

import math

from sglang_rimuru.experts.read_probe import describe, probe_in_place

from .rig import make_rig


def test_probe_counts_the_routed_offloaded_experts_of_every_layer() -> None:
    rig = make_rig()  # 5 of 8 resident a layer, 3 offloaded; top-2
    r = probe_in_place(rig.manager, tokens=50, reps=1)
    assert r["layers"] == 2 and r["tokens"] == 50
    assert r["reads"] == 6  # 50 tokens x 2 routes leave none of the 3 out unrouted (seeded)
    assert math.isclose(r["gb"], 6 * rig.shape.expert_bytes / 1e9)
    assert r["ms"] > 0 and r["base_ms"] > 0
    line = describe(r)
    assert line.startswith("sglang-rimuru in-place read probe: 2 MoE layers x 50 tokens read 6 offloaded experts")


def test_probe_without_host_reads_says_why() -> None:
    rig = make_rig()
    rig.manager.host_reads = False
    r = probe_in_place(rig.manager)
    assert r == {"skipped": "offloaded experts are not read in place (no pinned host store)"}
    assert describe(r) == ("sglang-rimuru in-place read probe skipped: "
                           "offloaded experts are not read in place (no pinned host store)")
