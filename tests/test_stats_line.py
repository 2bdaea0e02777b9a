"""The expert-traffic log line (``RimuruRuntime.log_stats_every``): every N forward passes,
and also once a minute of passes, since passes that read offloaded experts can take a
second each (500 of them outlast a benchmark run)."""

import logging
from types import SimpleNamespace

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
                           host_ms=state["host_ms"], line=state["line"], design_tokens=96),
        host_counts=lambda: [7, 8, 0], gates=lambda: [24, 31, never], max_tokens=128)
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
        "from 24-31 tokens",
        "sglang-rimuru CPU split: 96 layer requests served, 9.50 ms and 8.2 routed experts a request on the "
        "host (recent median 9.25 ms; line 4.50 ms + 0.333 an expert, balanced at 96 tokens); host experts a "
        "layer now 0-8; 2 of 3 layers split, from 24-31 tokens",
    ]
