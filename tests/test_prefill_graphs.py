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
from sglang_rimuru.experts import ExpertRanking
from tests.experts.rig import make_rig, tiny_shape


def runtime_for(rig, host_reads: bool, max_tokens: int = 128):
    # the method reads the worker's manager (residency, host-read switch, the offloaded
    # experts' probabilities) and one flag
    manager = rig.manager if host_reads else SimpleNamespace(
        residency=rig.residency, host_reads=False, shape=rig.shape, offloaded_max_p=rig.manager.offloaded_max_p)
    assert manager.host_reads is host_reads
    rt = SimpleNamespace(manager=manager, shape=rig.shape, config=SimpleNamespace(zero_copy_max_tokens=max_tokens))
    rt._reads_in_place = lambda n, layer_id=None: RimuruRuntime._reads_in_place(rt, n, layer_id)
    return rt


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
    # The rig's ranking: a token picks the expert of rank r with probability 2 (8 - r) / 36
    # (top-2 of 8). In place while T * p_max <= N * top_k / E = 128 * 2 / 8 = 32 tokens.
    rig = make_rig()  # 3 of 8 out per layer: ranks 5-7, the hottest of them p = 6/36
    rt = runtime_for(rig, host_reads=True, max_tokens=128)
    assert rig.manager.offloaded_max_p() == pytest.approx(1 / 6)
    assert may_replay(rt, 1) and may_replay(rt, 192)  # 192 / 6 = 32 tokens for the hottest out
    assert not may_replay(rt, 193) and not may_replay(rt, 2048)  # eager: each expert copied once
    # without host reads an offloaded row is -1: a replay would read zeros, never replay
    assert not may_replay(runtime_for(rig, host_reads=False), 1)
    # one hot expert out (layer 1's rank 0, p = 16/36) is enough to send a large prefill to the
    # copy path: 72 tokens give it the 32
    rig = make_rig(pages=80)
    restore_all(rig)
    rig.residency.evict(1, 7)
    rt = runtime_for(rig, host_reads=True)
    assert rig.manager.offloaded_max_p() == pytest.approx(16 / 36) and rig.manager.offloaded_max_p(0) == 0.0
    assert may_replay(rt, 64) and may_replay(rt, 72)
    assert not may_replay(rt, 73) and not may_replay(rt, 2048)


def test_uniform_routing_replays_exactly_up_to_the_flag():
    """The default ranking (uniform): the rule is the token count, as before skew counted."""
    shape = tiny_shape()
    rig = make_rig(shape, ranking=ExpertRanking.default(shape))
    for n in (1, 100, 128, 129):
        rt = runtime_for(rig, host_reads=True, max_tokens=n)
        assert may_replay(rt, n) and not may_replay(rt, n + 1)


def test_cold_experts_out_keep_long_prefills_replaying():
    """Skewed routing: experts a token picks with a tenth of the uniform probability
    leave passes of ten times the flag replaying; one never routed never forces a copy;
    evicting a hot one brings the limit back down (recomputed from the residency)."""
    shape = tiny_shape()  # E = 8, top-2: uniform p = 1/4
    orders = {l: list(range(8)) for l in shape.layer_ids}
    # ranks 5-7 cold: p = 0.025, 0.025, 0 (a token's two picks sum to 2)
    probs = {l: [0.65, 0.5, 0.4, 0.2, 0.2, 0.025, 0.025, 0.0] for l in shape.layer_ids}
    rig = make_rig(shape, ranking=ExpertRanking(8, orders, probs))
    assert [rig.residency.offloaded(l) for l in shape.layer_ids] == [[5, 6, 7], [5, 6, 7]]
    rt = runtime_for(rig, host_reads=True, max_tokens=128)
    assert rig.manager.offloaded_max_p() == pytest.approx(0.025)
    assert may_replay(rt, 1280) and not may_replay(rt, 1281)
    # only the never-routed expert out: every pass replays
    rig = make_rig(shape, ranking=ExpertRanking(8, orders, probs), pages=80)
    restore_all(rig)
    rig.residency.evict(0, 7)
    rt = runtime_for(rig, host_reads=True)
    assert may_replay(rt, 8192)
    rig.residency.evict(1, 0)  # a hot one (p = 0.65): 32 / 0.65 = 49.2 tokens
    assert may_replay(rt, 49) and not may_replay(rt, 50)
    assert rig.manager.offloaded_max_p(0) == 0.0 and rig.manager.offloaded_max_p(1) == pytest.approx(0.65)


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


def test_the_longest_replayed_prefill_pass_from_sglangs_args():
    """The cost model's ``replay_max_p`` is the rule at the longest captured prefill pass:
    SGLang's prefill-graph size, at most the chunked prefill size. The attribute is checked
    against the installed SGLang, so a rename fails here, not at a GPU start."""
    import dataclasses

    from sglang.srt.model_executor.cuda_graph_config import PhaseConfig
    from sglang.srt.server_args import ServerArgs

    from rimuru_patches.unified_pool.runtime import _largest_replayed_prefill

    assert "cuda_graph_config" in {f.name for f in dataclasses.fields(ServerArgs)}
    assert "max_bs" in {f.name for f in dataclasses.fields(PhaseConfig)}

    def args(max_bs, chunk, max_prefill=16384):
        return SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(max_bs=max_bs)),
                               chunked_prefill_size=chunk, max_prefill_tokens=max_prefill)

    assert _largest_replayed_prefill(args(2048, 2048)) == 2048
    assert _largest_replayed_prefill(args(2048, 1024)) == 1024
    assert _largest_replayed_prefill(args(2048, -1)) == 2048
    assert _largest_replayed_prefill(args(None, None)) == 16384
    with pytest.raises(RuntimeError, match="cuda_graph_config.prefill.max_bs"):
        _largest_replayed_prefill(SimpleNamespace(chunked_prefill_size=2048, max_prefill_tokens=16384))
