"""The expert-traffic log line (``RimuruRuntime.log_stats_every``): every N forward passes,
and also once a minute of passes, since passes that read offloaded experts can take a
second each (500 of them outlast a benchmark run); and the CPU split's /metrics gauges."""

import logging
from types import SimpleNamespace

import pytest

from rimuru_patches.unified_pool import runtime as rt
from sglang_rimuru.experts.manager import ExpertStats


def test_the_stats_line_comes_every_n_passes_or_once_a_minute(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(rt.time, "monotonic", lambda: now[0])
    stats = [ExpertStats()]
    fake = SimpleNamespace(manager=SimpleNamespace(stats=lambda: stats[0]), _stats_logged=100.0, cpu_split=None)
    lines = []
    for forwards, t in [(1, 101.0), (2, 150.0), (3, 161.0), (4, 170.0), (10, 175.0), (11, 230.0), (12, 240.0)]:
        stats[0], now[0] = ExpertStats(forwards=forwards), t
        with caplog.at_level(logging.INFO, logger=rt.logger.name):
            caplog.clear()
            rt.RimuruRuntime.log_stats_every(fake, 5)
            lines += [forwards for r in caplog.records if "experts after" in r.getMessage()]
    # 3: a minute after the start; 10: a multiple of 5 (and it restarts the minute); 12: a minute after 10
    assert lines == [3, 10, 12]


def test_the_split_line_says_what_the_host_takes_and_which_layers_split(monkeypatch, caplog):
    monkeypatch.setattr(rt.time, "monotonic", lambda: 200.0)
    never = 1 << 30
    state = {"host_ms": None, "line": None}
    split = SimpleNamespace(
        stats=lambda: dict(requests=96, host_ms_per_request=9.5, host_experts_per_request=8.25,
                           host_ms=state["host_ms"], line=state["line"], design_tokens=96,
                           passes_shorter=40, passes_within=12, passes_longer=300),
        host_counts=lambda: [7, 8, 0], gates=lambda: [24, 31, never], open_gates=lambda: [24, 31],
        min_tokens=16, max_tokens=128)
    fake = SimpleNamespace(manager=SimpleNamespace(stats=lambda: ExpertStats(forwards=5)), _stats_logged=100.0,
                           cpu_split=split)
    messages = []
    for host_ms, line in ((None, None), (9.25, (4.5, 0.3333))):
        state["host_ms"], state["line"] = host_ms, line
        fake._stats_logged = 100.0
        with caplog.at_level(logging.INFO, logger=rt.logger.name):
            caplog.clear()
            rt.RimuruRuntime.log_stats_every(fake, 5)
            messages += [r.getMessage() for r in caplog.records if "CPU split" in r.getMessage()]
    assert messages == [
        "sglang-rimuru CPU split: 96 layer requests served, 9.50 ms and 8.2 routed experts a request on the "
        "host (recent median not yet measured; line -); host experts a layer now 0-8; 2 of 3 layers split, "
        "from 24-31 tokens; forward passes so far: 12 within its 16-128 tokens, 300 longer, 40 shorter",
        "sglang-rimuru CPU split: 96 layer requests served, 9.50 ms and 8.2 routed experts a request on the "
        "host (recent median 9.25 ms; line 4.50 ms + 0.333 an expert, balanced at 96 tokens); host experts a "
        "layer now 0-8; 2 of 3 layers split, from 24-31 tokens; forward passes so far: 12 within its 16-128 "
        "tokens, 300 longer, 40 shorter",
    ]


def test_the_split_gauges_say_what_the_host_takes() -> None:
    """``sglang_rimuru:cpu_split_*`` on /metrics (``elastic._Metrics``): zeros without the
    split; with it the host's experts over all layers, the layers whose gate opens within
    the split's batches, the host's median and its requests."""
    pytest.importorskip("triton")
    from rimuru_patches.elastic import _Metrics
    from sglang_rimuru.experts.cpu_split import CpuSplit

    from .experts.rig import make_rig

    assert _Metrics.split_values(None) == dict(cpu_split_host_experts=0, cpu_split_layers_split=0,
                                               cpu_split_host_ms=0.0, cpu_split_requests=0,
                                               cpu_split_passes_within=0, cpu_split_passes_longer=0)
    rig = make_rig(limit=4)
    split = CpuSplit(rig.shape, rig.host, "cpu", share=0.67, min_tokens=2, max_tokens=64, threads=2,
                     expert_ms=0.5)  # two of three a layer
    rig.manager.attach_cpu_split(split)
    assert _Metrics.split_values(split) == dict(cpu_split_host_experts=4, cpu_split_layers_split=2,
                                                cpu_split_host_ms=0.0, cpu_split_requests=0,
                                                cpu_split_passes_within=0, cpu_split_passes_longer=0)
    for tokens in (1, 2, 64, 65, 2048):  # the range is 2..64
        split.note_pass(tokens)
    assert {k: v for k, v in _Metrics.split_values(split).items() if "passes" in k} == dict(
        cpu_split_passes_within=2, cpu_split_passes_longer=2)
    split.host_ms = 50.0  # a host no batch outlasts: every gate closed
    split.regate()
    assert _Metrics.split_values(split)["cpu_split_layers_split"] == 0
    assert _Metrics.split_values(split)["cpu_split_host_ms"] == 50.0
    assert set(_Metrics.split_values(split)) <= set(_Metrics.DOCS)  # each value has its gauge
