"""``_StepTiming`` (the ``elastic.round`` seam): which round intervals are decode steps.

Under SGLang's overlap scheduler round ``i + 1`` starts once pass ``i - 1`` has
finished, so the interval after a prefill round is mostly that prefill. On the
H200 such intervals (144-218 ms against ~10 ms decode steps) became the cost
model's base step time and every eviction paid. Only decode intervals preceded
by a decode round are recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rimuru_patches import elastic
from sglang_rimuru.adjuster.cost import CostModel, step_record_path
from tests.conftest import zipf_layer


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


def _batch(kind: str, size: int):
    return None if kind == "idle" else SimpleNamespace(forward_mode=_Mode(kind == "decode"), reqs=[None] * size)


@pytest.fixture
def timing(monkeypatch):
    st = elastic._StepTiming
    for name, value in (("clock", None), ("last", None), ("before_last", False), ("reads_key", None),
                        ("reads", 0.0), ("batch_now", None), ("rounds", 0), ("pending", None)):
        monkeypatch.setattr(st, name, value)
    adjuster = SimpleNamespace(cost=CostModel(expert_ms=0.3, base_ms=5.9, per_request_ms=0.17), last_seq=0,
                               in_flight=(), offloaded_token_probabilities=lambda: [],
                               token_probabilities=lambda: [])
    ctl = SimpleNamespace(adjuster=adjuster, trace_path=None)
    scheduler = SimpleNamespace(tp_group=SimpleNamespace(world_size=1))
    now = [0.0]
    monkeypatch.setattr(elastic.time, "monotonic", lambda: now[0])

    def run(rounds, trace_path=None):
        """``rounds``: (kind, batch size, seconds the round's interval lasts)."""
        ctl.trace_path = trace_path
        for kind, size, secs in rounds:
            st.round(scheduler, ctl, _batch(kind, size))
            now[0] += secs
        return st.clock.samples()

    return run


def test_only_decode_intervals_after_a_decode_round_are_steps(timing):
    samples = timing([
        ("prefill", 4, 0.2),   # a 2048-token chunk
        ("decode", 4, 0.15),   # its interval is mostly the prefill still on the GPU: not a step
        ("decode", 4, 0.01),   # decode after decode: a step of 10 ms at batch 4
        ("decode", 5, 0.011),  # 11 ms at batch 5
        ("decode", 5, 0.3),    # followed by a prefill round: not known to be a step
        ("prefill", 1, 0.1),
        ("decode", 6, 0.2),    # after a prefill again: not a step
        ("decode", 6, 0.012),  # 12 ms at batch 6
        ("decode", 6, 0.4),    # followed by an idle round: not known to be a step
        ("idle", 0, 1.0),      # nothing to run: the next decode starts a new run
        ("decode", 2, 0.5),
        ("decode", 2, 0.008),  # 8 ms at batch 2
        ("decode", 2, 0.0),
    ])
    assert [(b, round(ms, 6), r) for b, ms, r in samples] == [(4, 10.0, 0.0), (5, 11.0, 0.0), (6, 12.0, 0.0),
                                                              (2, 8.0, 0.0)]


def test_with_a_trace_every_timed_step_is_written_for_the_cost_check(timing, tmp_path, monkeypatch):
    """The per-step record beside the adjuster trace: the steps the clock timed (and
    only those), one JSON line per REFIT_ROUNDS rounds; what a stopped server had not
    dumped yet is lost, never a partial line."""
    import json

    monkeypatch.setattr(elastic._StepTiming, "REFIT_ROUNDS", 4)
    trace = tmp_path / "elastic_trace.jsonl"
    steps = tmp_path / "elastic_trace.steps.jsonl"
    assert step_record_path(str(trace)) == str(steps)
    steps.write_text("an older run's record\n")  # one record per server run
    timing([
        ("prefill", 4, 0.2),
        ("decode", 4, 0.15),   # after a prefill: not a step
        ("decode", 4, 0.01),   # round 3: 10 ms at batch 4
        ("decode", 5, 0.011),  # round 4 ends the first dump: 11 ms at 5 is timed in round 5
        ("decode", 5, 0.012),
        ("decode", 5, 0.0),
        ("decode", 5, 0.0),
        ("decode", 5, 0.0),    # round 8: the second dump
        ("decode", 5, 0.0),    # timed, not dumped (the server stops before round 12)
    ], trace_path=str(trace))
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    assert [line["steps"] for line in lines] == [
        [[4, 10.0, 0.0]],
        [[5, 11.0, 0.0], [5, 12.0, 0.0], [5, 0.0, 0.0], [5, 0.0, 0.0]],
    ]


def test_without_a_trace_no_step_record_is_kept(timing, tmp_path):
    timing([("decode", 3, 0.01)] * 5)
    assert elastic._StepTiming.pending is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize("gpu_share, want", [(None, 0.75 * 0.3), (0.4, 0.1)])
def test_the_cpu_split_scales_the_floor_on_a_reads_price(monkeypatch, gpu_share, want):
    """Steps at batch 64 with 48 experts out a layer that take the prior's resident line
    plus 0.1 ms an expected read (the host computing most of them beside the GPU): without
    the split the fit stops at its floor, 0.75 of the prior's 0.3 ms; with a split that
    leaves the GPU 0.4 of the offloaded experts the floor is 0.09 and the fit's 0.1 stands."""
    from rimuru_patches.unified_pool import runtime as rt
    from sglang_rimuru.adjuster.cost import touched

    st = elastic._StepTiming
    for name, value in (("clock", None), ("last", None), ("before_last", False), ("reads_key", None),
                        ("reads", 0.0), ("batch_now", None), ("rounds", 0), ("pending", None), ("REFIT_ROUNDS", 64)):
        monkeypatch.setattr(st, name, value)
    split = None if gpu_share is None else SimpleNamespace(gpu_read_share=lambda: gpu_share)
    monkeypatch.setattr(rt, "active", lambda: SimpleNamespace(cpu_split=split))
    ps = [1 / 15] * 48
    adjuster = SimpleNamespace(cost=CostModel(expert_ms=0.3, base_ms=5.9, per_request_ms=0.17), last_seq=0,
                               in_flight=(), offloaded_token_probabilities=lambda: ps,
                               token_probabilities=lambda: [])
    ctl = SimpleNamespace(adjuster=adjuster, trace_path=None)
    scheduler = SimpleNamespace(tp_group=SimpleNamespace(world_size=1))
    now = [0.0]
    monkeypatch.setattr(elastic.time, "monotonic", lambda: now[0])
    step_s = (5.9 + 0.17 * 64 + 0.1 * sum(touched(p, 64) for p in ps)) / 1e3
    for _ in range(64):
        st.round(scheduler, ctl, _batch("decode", 64))
        now[0] += step_s
    assert len(st.clock) == 62  # the first two rounds are not steps
    assert adjuster.cost.expert_ms == pytest.approx(want)


def test_the_fit_is_the_resident_curves_tangent_at_the_batch_now(monkeypatch):
    """Given every expert's routing probabilities the clock fits the resident step as a
    curve in the experts a batch routes to, and the line it hands the adjuster is that
    curve's tangent at the last decode round's batch (cost.py StepClock)."""
    from rimuru_patches.unified_pool import runtime as rt
    from sglang_rimuru.adjuster.cost import RoutedExperts

    st = elastic._StepTiming
    for name, value in (("clock", None), ("last", None), ("before_last", False), ("reads_key", None),
                        ("reads", 0.0), ("batch_now", None), ("rounds", 0), ("pending", None),
                        ("REFIT_ROUNDS", 64)):
        monkeypatch.setattr(st, name, value)
    monkeypatch.setattr(rt, "active", lambda: SimpleNamespace(cpu_split=None))
    probs = zipf_layer() * 24  # 24 layers, top-4 of 60
    routed = RoutedExperts(probs)
    adjuster = SimpleNamespace(cost=CostModel(expert_ms=0.3, base_ms=5.9, per_request_ms=0.17), last_seq=0,
                               in_flight=(), offloaded_token_probabilities=lambda: [],
                               token_probabilities=lambda: probs)
    ctl = SimpleNamespace(adjuster=adjuster, trace_path=None)
    scheduler = SimpleNamespace(tp_group=SimpleNamespace(world_size=1))
    now = [0.0]
    monkeypatch.setattr(elastic.time, "monotonic", lambda: now[0])
    resident_ms = lambda b: 3.0 + 0.01 * routed(b)  # noqa: E731
    for i in range(64):
        b = 1 + i % 40
        st.round(scheduler, ctl, _batch("decode", b))
        now[0] += resident_ms(b) / 1e3
    cost = adjuster.cost
    assert st.batch_now == 24 and st.clock.tangent_at == 24
    assert cost.per_request_ms == pytest.approx(0.01 * routed.slope(24), rel=1e-6)
    assert cost.base_ms + 24 * cost.per_request_ms == pytest.approx(resident_ms(24), rel=1e-6)
    assert cost.expert_ms == 0.3  # nothing read: the prior's price
