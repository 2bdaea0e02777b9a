"""Captured prefill graphs replay in pool modes only where they compute what an eager
pass would (``RimuruRuntime.prefill_graph_may_replay``, seam ``experts.prefill_graphs``).

With prefill graphs off, elastic's decode matched plain SGLang's on the H200 (ITL median
7.18 vs 7.28 ms) while its eager prefills made TPOT 10.6 against 8.1 ms
(bench/RESULTS.md). A replay reads offloaded experts in place once per block of tokens
(or, without host reads, as page -1: zero), so the gate is the residency."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rimuru_patches.unified_pool import _prefill_graph_gate
from rimuru_patches.unified_pool.runtime import RimuruRuntime
from tests.experts.rig import make_rig


def runtime_for(rig, host_reads: bool, max_tokens: int = 128):
    # the method reads the worker's residency, its host-read switch and one flag
    manager = SimpleNamespace(residency=rig.residency, host_reads=host_reads)
    return SimpleNamespace(manager=manager, shape=rig.shape,
                           config=SimpleNamespace(zero_copy_max_tokens=max_tokens))


def may_replay(rt, tokens: int) -> bool:
    return RimuruRuntime.prefill_graph_may_replay(rt, tokens)


def restore_all(rig) -> None:
    for l in rig.shape.layer_ids:
        for e in rig.residency.offloaded(l):
            rig.residency.admit(l, e, rig.pool.alloc_expert_pages(3, [("x", l, e, m) for m in range(3)]))


def test_every_expert_resident_replays_any_prefill():
    rig = make_rig(pages=80)  # 5 of 8 resident per layer
    restore_all(rig)
    assert rig.residency.num_resident() == 16
    for host_reads in (True, False):
        assert may_replay(runtime_for(rig, host_reads), 2048)


def test_with_experts_out_only_passes_read_in_place_anyway_replay():
    rig = make_rig()  # 3 of 8 out per layer
    rt = runtime_for(rig, host_reads=True, max_tokens=128)
    assert may_replay(rt, 1) and may_replay(rt, 128)
    assert not may_replay(rt, 129) and not may_replay(rt, 2048)  # eager: each expert copied once
    # without host reads an offloaded row is -1: a replay would read zeros, never replay
    assert not may_replay(runtime_for(rig, host_reads=False), 1)
    # one expert out is enough to send a large prefill to the copy path
    rig = make_rig(pages=80)
    restore_all(rig)
    rig.residency.evict(1, 7)
    assert not may_replay(runtime_for(rig, host_reads=True), 2048)
    assert may_replay(runtime_for(rig, host_reads=True), 64)


@pytest.mark.parametrize("sglang_says", [True, False])
def test_the_seam_only_ever_narrows_sglangs_answer(monkeypatch, sglang_says):
    import rimuru_patches.unified_pool as up

    rig = make_rig()  # experts out
    rt = runtime_for(rig, host_reads=True, max_tokens=128)
    rt.prefill_graph_may_replay = lambda n: RimuruRuntime.prefill_graph_may_replay(rt, n)
    seen = []

    def orig(self, forward_batch):
        seen.append(len(forward_batch.input_ids))
        return sglang_says

    gate = _prefill_graph_gate(orig, ctx=None)
    small, large = SimpleNamespace(input_ids=[0] * 100), SimpleNamespace(input_ids=[0] * 2000)
    monkeypatch.setattr(up, "_runtime", lambda: None)  # mode off in this process: SGLang decides
    assert gate(None, large) is sglang_says
    monkeypatch.setattr(up, "_runtime", lambda: rt)
    assert gate(None, small) is sglang_says
    assert gate(None, large) is False
    assert seen == [2000, 100, 2000]
