"""CostModel: the PCIe price of offloaded experts against the requests they admit (exact numbers)."""

from __future__ import annotations

import math

import pytest

from sglang_rimuru.adjuster.cost import CostModel, touched

#: Qwen1.5-MoE-A2.7B on the H200: 3 x 2048 x 1408 bf16 per expert, read in place at
#: 51.2 GB/s (bench/RESULTS.md); decode 3.75 ms at batch 1, 4.47 ms at 32 (graphs)
QWEN15 = CostModel.for_expert(3 * 2048 * 1408 * 2, 51.2, base_ms=3.73, per_request_ms=0.023)
UNIFORM = 4 / 60  # top-4 of 60, every expert alike


def test_touched_probability():
    assert touched(0.5, 1) == 0.5 and touched(0.5, 2) == 0.75
    assert touched(UNIFORM, 30) == pytest.approx(1 - (56 / 60) ** 30)
    assert touched(0.0, 100) == 0.0 and touched(0.3, 0) == 0.0 and touched(2.0, 3) == 1.0


def test_expert_price():
    assert QWEN15.expert_ms == pytest.approx(17_301_504 / 51.2e6)  # 0.338 ms
    assert QWEN15.step_ms(32) == pytest.approx(3.73 + 0.736)
    # ten uniform experts offloaded at batch 30: each touched 87 % of steps
    assert QWEN15.offload_ms([UNIFORM] * 10, 30) == pytest.approx(10 * touched(UNIFORM, 30) * QWEN15.expert_ms)


def test_uniform_routing_never_pays_at_load():
    # 6 experts (one ~500-token request's KV) for one more of 30 running: a step would
    # grow by 6 x 0.87 x 0.34 ms = 1.8 ms for +3 % of tokens per step
    assert not QWEN15.eviction_pays(30, 1, [], [UNIFORM] * 6)
    # not even for eight more requests
    assert not QWEN15.eviction_pays(30, 8, [], [UNIFORM] * 40)


def test_cold_experts_pay_when_they_admit_enough():
    cold = [0.0005] * 6  # almost never routed: touched 1.5 % of steps at batch 31
    assert QWEN15.eviction_pays(30, 1, [], cold)
    assert QWEN15.eviction_pays(30, 10, [], cold * 10)
    # the experts already offloaded count at the new batch size, but the new victims'
    # price decides: cheap ones still pay, a hot one does not
    assert QWEN15.eviction_pays(30, 1, [UNIFORM] * 30, cold)
    assert not QWEN15.eviction_pays(30, 1, [UNIFORM] * 30, [UNIFORM])


def test_nobody_running_admits_anything():
    assert QWEN15.eviction_pays(0, 1, [], [UNIFORM] * 20)
    assert not QWEN15.eviction_pays(10, 0, [], [0.0])


def test_keep_or_retract():
    assert QWEN15.keep_beats_retract(30, [], [0.0005])  # a cold expert beats losing a request
    # at batch 4 a uniform expert is touched in 24 % of steps: three cost 0.24 ms a step,
    # less than losing a quarter of the batch; forty cost 3.3 ms, more
    assert QWEN15.keep_beats_retract(4, [], [UNIFORM] * 3)
    assert not QWEN15.keep_beats_retract(4, [], [UNIFORM] * 40)
    assert QWEN15.keep_beats_retract(1, [], [UNIFORM] * 50)  # never retract the last request


@pytest.mark.parametrize("bad", [dict(expert_ms=-1, base_ms=1, per_request_ms=0),
                                 dict(expert_ms=1, base_ms=0, per_request_ms=0),
                                 dict(expert_ms=1, base_ms=1, per_request_ms=True)])
def test_bad_numbers(bad):
    with pytest.raises(ValueError):
        CostModel(**bad)
    assert math.isfinite(QWEN15.throughput(5, [UNIFORM]))


def test_step_clock_fits_a_line_and_keeps_the_prior_until_it_can():
    from sglang_rimuru.adjuster.cost import StepClock

    clock = StepClock(prior=(3.7, 0.025), min_samples=4)
    assert clock.fit() == (3.7, 0.025)
    clock.record(8, 5.0)
    assert clock.fit() == pytest.approx((5.0 - 0.025 * 8, 0.025))  # one batch size: the prior's slope
    for b, ms in ((1, 3.0), (16, 4.5), (32, 6.1)):
        clock.record(b, ms)
    base, per = clock.fit()
    xs, ys = [8, 1, 16, 32], [5.0, 3.0, 4.5, 6.1]
    mx, my = sum(xs) / 4, sum(ys) / 4
    want = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert per == pytest.approx(want) and base == pytest.approx(my - want * mx)
    clock.record(0, 1.0)  # ignored: no batch
    clock.record(4, float("nan"))  # ignored
    assert len(clock) == 4
    small = StepClock(prior=(1.0, 0.0), window=3)
    for b in (1, 2, 3, 4):
        small.record(b, float(b))
    assert len(small) == 3  # the window keeps the latest
