"""CostModel: the PCIe price of offloaded experts against the requests they admit (exact numbers)."""

from __future__ import annotations

import math

import pytest

from sglang_rimuru.adjuster.cost import CostModel, touched
from tests.conftest import zipf_layer

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


# Qwen1.5-MoE-A2.7B's KV: 24 layers x K and V x 16 heads x 128 x bf16 = 196,608 B a token,
# so one expert's 17,301,504 B hold 88 tokens of KV; ShareGPT requests hold ~500
KV_PER_EXPERT, KV_PER_REQUEST = 17_301_504 / 196_608, 500


def test_the_marginal_test_alone_ratchets_and_the_restored_reference_stops_it():
    # 240 uniform experts out (10 a layer): a step is mostly PCIe, so three more short
    # requests look worth six more experts out, step after step (what the H200 run did)
    out = [UNIFORM] * 240
    assert QWEN15.eviction_pays(60, 3, out, [UNIFORM] * 6)
    # bringing all 240 back into the KV of 43 requests runs 17 at 4 tokens/ms, not 0.7
    assert not QWEN15.eviction_pays(60, 3, out, [UNIFORM] * 6, KV_PER_REQUEST, KV_PER_EXPERT)
    # a decode shortfall: keeping 40 with one more out beats retracting one, marginally...
    assert QWEN15.keep_beats_retract(40, [UNIFORM] * 200, [UNIFORM])
    # ...not against retracting and bringing experts back
    assert not QWEN15.keep_beats_retract(40, [UNIFORM] * 200, [UNIFORM], KV_PER_REQUEST, KV_PER_EXPERT)


def test_cold_experts_still_go_with_the_reference():
    cold = [0.0005] * 6
    assert QWEN15.eviction_pays(30, 1, [], cold, KV_PER_REQUEST, KV_PER_EXPERT)
    # cold ones already out: bringing them back saves nothing and costs requests
    assert QWEN15.eviction_pays(30, 1, cold * 5, cold, KV_PER_REQUEST, KV_PER_EXPERT)
    assert QWEN15.keep_beats_retract(30, cold * 5, cold, KV_PER_REQUEST, KV_PER_EXPERT)


def test_restored_throughput_by_hand():
    t = touched
    # batch 3, two uniform experts out, one expert's KV = one request's: with one back
    # 2 requests run, with both back 1
    two_run = 2 / (QWEN15.step_ms(2) + t(UNIFORM, 2) * QWEN15.expert_ms)
    one_runs = 1 / QWEN15.step_ms(1)
    assert QWEN15.restored_throughput(3, [UNIFORM, UNIFORM], 100, 100) == pytest.approx(max(two_run, one_runs))
    # the most touched comes back first
    got = QWEN15.restored_throughput(3, [0.01, 0.5], 100, 100)
    assert got == pytest.approx(max(2 / (QWEN15.step_ms(2) + t(0.01, 2) * QWEN15.expert_ms), one_runs))
    # an expert needs the KV of two requests: batch 3 gets to 1 with one back
    assert QWEN15.restored_throughput(3, [0.5, 0.5], 50, 100) == pytest.approx(
        1 / (QWEN15.step_ms(1) + t(0.5, 1) * QWEN15.expert_ms))
    # nothing out, no KV sizes, or no request left to give up: no such state
    assert QWEN15.restored_throughput(3, [], 100, 100) == 0.0
    assert QWEN15.restored_throughput(3, [UNIFORM], 0, 0) == 0.0
    assert QWEN15.restored_throughput(1, [UNIFORM], 100, 100) == 0.0
    assert QWEN15.restored_throughput(2, [UNIFORM], 10, 100) == 0.0  # one request's KV holds no expert


def test_step_clock_fits_a_line_and_keeps_the_prior_until_it_can():
    from sglang_rimuru.adjuster.cost import StepClock

    clock = StepClock(prior=(3.7, 0.025, 0.3), min_samples=4)
    assert clock.fit() == (3.7, 0.025, 0.3)
    clock.record(8, 5.0)
    assert clock.fit() == pytest.approx((5.0 - 0.025 * 8, 0.025, 0.3))  # one batch size: the prior's slope
    for b, ms in ((1, 3.0), (16, 4.5), (32, 6.1)):
        clock.record(b, ms)
    base, per, exp = clock.fit()
    xs, ys = [8, 1, 16, 32], [5.0, 3.0, 4.5, 6.1]
    mx, my = sum(xs) / 4, sum(ys) / 4
    want = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert per == pytest.approx(want) and base == pytest.approx(my - want * mx) and exp == 0.3
    clock.record(0, 1.0)  # ignored: no batch
    clock.record(4, float("nan"))  # ignored
    clock.record(4, 2.0, -1.0)  # ignored: negative reads
    assert len(clock) == 4
    small = StepClock(prior=(1.0, 0.0, 0.0), window=3)
    for b in (1, 2, 3, 4):
        small.record(b, float(b))
    assert len(small) == 3  # the window keeps the latest
    with pytest.raises(ValueError, match="expert_ms"):
        StepClock(prior=(1.0, 0.0))


def test_step_clock_keeps_offloaded_reads_out_of_the_per_request_slope():
    from sglang_rimuru.adjuster.cost import StepClock

    # steps of 4 ms + 0.02 ms a request, + 0.3 ms per expected read once experts are out
    line = lambda b: 4.0 + 0.02 * b  # noqa: E731
    clock = StepClock(prior=(3.0, 0.1, 0.34), min_samples=8)
    for b in range(1, 41):
        clock.record(b, line(b))
    assert clock.fit() == pytest.approx((4.0, 0.02, 0.34))  # nothing read yet: the prior's expert_ms
    # reads that follow the batch exactly (every expert out is read by every step once
    # the batch is large): a joint fit cannot tell them from requests; the resident line can
    for b in range(1, 41):
        clock.record(b, line(b) + 0.3 * (0.5 * b), 0.5 * b)
    assert clock.fit() == pytest.approx((4.0, 0.02, 0.3))
    # reads that only saturate with the batch (one set out throughout)
    curved = StepClock(prior=(3.0, 0.1, 0.34), min_samples=8)
    for b in range(1, 41):
        curved.record(b, line(b))
        r = 10 * touched(UNIFORM, b)
        curved.record(b, line(b) + 0.3 * r, r)
    assert curved.fit() == pytest.approx((4.0, 0.02, 0.3))
    # below min_samples reading steps the prior's expert_ms stands
    few = StepClock(prior=(3.0, 0.1, 0.34), min_samples=8)
    for b in range(1, 8):
        few.record(b, line(b) + 2.5, 10.0)
    assert few.fit() == (3.0, 0.1, 0.34)


def test_step_clock_puts_a_pcie_bound_step_into_its_reads():
    from sglang_rimuru.adjuster.cost import CostModel, StepClock

    # The H200's elastic32 of 2026-12-01: 480 uniform experts out, steps of ~350 ms at
    # batch 77-111, no step without reads (experts went out in the first burst). The old
    # joint fit kept expert_ms = 0.336 and made base ~190 ms: one more request looked
    # free and every eviction paid. Against the prior's resident line the steps' excess
    # is their reads.
    prior = (5.9, 0.17, 0.336)
    clock = StepClock(prior=prior, min_samples=8)
    for i in range(40):
        b = 77 + i % 35
        r = 480 * touched(UNIFORM, b)
        clock.record(b, 5.9 + 0.17 * b + 0.7 * r, r)
    base, per, exp = clock.fit()
    assert (base, per) == (5.9, 0.17) and exp == pytest.approx(0.7)
    # the first eviction of that run (34 experts out, the KV's batch from 22 to 52 requests)
    # pays with the joint fit's numbers and not with these
    joint = CostModel(expert_ms=0.336, base_ms=190.0, per_request_ms=0.17)
    assert joint.eviction_pays(22, 30, [], [UNIFORM] * 34)
    assert not CostModel(expert_ms=exp, base_ms=base, per_request_ms=per).eviction_pays(22, 30, [], [UNIFORM] * 34)


def test_step_clock_never_fits_a_step_of_no_time():
    from sglang_rimuru.adjuster.cost import CostModel, StepClock

    # resident steps that get faster with the batch (noise): the slope clamps to 0
    clock = StepClock(prior=(3.7, 0.023, 0.34), min_samples=8)
    for b in range(1, 41):
        clock.record(b, 6.0 - 0.01 * b)
    base, per, exp = clock.fit()
    assert per == 0.0 and base == pytest.approx(6.0 - 0.01 * 20.5) and exp == 0.34
    CostModel(expert_ms=exp, base_ms=base, per_request_ms=per)  # valid
    # a line that clamps to (0, 0) is never returned: the prior's is
    zero = StepClock(prior=(3.7, 0.023, 0.34), min_samples=8)
    for b in range(1, 41):
        zero.record(b, 1e-6 * (41 - b))
    assert zero.fit() == (3.7, 0.023, 0.34)
    # reads that took less than the line: expert_ms is the floor, never <= 0
    fast = StepClock(prior=(3.7, 0.023, 0.34), min_samples=8)
    for b in range(1, 41):
        fast.record(b, 1.0, 5.0)
    assert fast.fit() == pytest.approx((3.7, 0.023, 0.75 * 0.34))


def test_step_clock_keeps_its_resident_line_through_a_long_burst():
    """Steps that read nothing are kept apart from the reading ones: a burst with experts
    out for longer than the window must not turn the fitted line back into the prior
    (the H200 run of 3a91dd2 did, and priced reads against a line 25 % off)."""
    from sglang_rimuru.adjuster.cost import StepClock

    clock = StepClock(prior=(5.9, 0.17, 0.336), window=64, min_samples=8)
    for b in range(1, 41):
        clock.record(b, 3.3 + 0.29 * b)
    for i in range(500):  # far more than the window, every one reading
        b = 10 + i % 30
        r = 5 * touched(UNIFORM, b)
        clock.record(b, 3.3 + 0.29 * b + 0.34 * r, r)
    assert clock.fit() == pytest.approx((3.3, 0.29, 0.34))
    assert len(clock) == 40 + 64


def test_step_clock_takes_no_slope_from_a_narrow_span():
    """A burst's first resident steps (batch 1-6, intervals that carry prefill noise)
    fitted a flat line on the H200, so one more request looked free: below MIN_SPAN
    batch sizes apart the prior's slope goes through their mean."""
    from sglang_rimuru.adjuster.cost import StepClock

    clock = StepClock(prior=(5.9, 0.17, 0.336), min_samples=8)
    for i in range(40):
        b = 1 + i % 6
        clock.record(b, 6.67 + (0.3 if i % 2 else -0.3) - 0.01 * b)
    base, per, _ = clock.fit()
    mb = sum(1 + i % 6 for i in range(40)) / 40
    mt = sum(6.67 + (0.3 if i % 2 else -0.3) - 0.01 * (1 + i % 6) for i in range(40)) / 40
    assert per == 0.17 and base == pytest.approx(mt - 0.17 * mb)
    for b in range(8, 20):  # a wider span: the data's own slope
        clock.record(b, 6.67 - 0.01 * b)
    assert clock.fit()[1] == 0.0


def raw_fit(clock) -> float:
    """A clock's reads fitted through the origin against the prior's line, unfloored."""
    base, per, _ = clock.prior
    pts = clock.samples()
    return sum((t - base - per * b) * r for b, t, r in pts) / sum(r * r for _, _, r in pts)


def test_step_clock_never_prices_a_read_below_what_pcie_allows():
    """Five experts out, a resident line that is really 3.3 + 0.29 B priced against the
    prior's 5.9 + 0.17 B: the reads' excess is mostly the line's error. The H200 run
    of 3a91dd2 fitted 0.092 ms a read that way (PCIe: 0.336) and evicted 133 experts
    into a 42 ms step; the floor keeps at least (1 - MAX_HIDDEN) of the PCIe time."""
    from sglang_rimuru.adjuster.cost import CostModel, StepClock

    clock = StepClock(prior=(5.9, 0.17, 0.336), min_samples=8)
    for i in range(200):
        b = 5 + i % 20
        r = 5 * touched(UNIFORM, b)
        clock.record(b, 3.3 + 0.29 * b + 0.336 * r, r)
    base, per, exp = clock.fit()
    assert (base, per) == (5.9, 0.17) and exp == pytest.approx(0.75 * 0.336)
    # with a CPU split leaving the GPU half the offloaded reads, the floor is half (0.126,
    # above the raw fit's 0.123); a third's floor (0.084) lets the raw fit stand
    assert clock.fit(floor_scale=0.5)[2] == pytest.approx(0.375 * 0.336)
    assert clock.fit(floor_scale=1 / 3)[2] == pytest.approx(raw_fit(clock))
    with pytest.raises(ValueError, match="floor_scale 0"):
        clock.fit(floor_scale=0)
    assert raw_fit(clock) < 0.15  # what it was
    # the run's eviction of 32 more (15 running, 464 KV tokens a request, 88 an expert):
    # it paid at 0.092 ms a read and does not at the floor
    args = (15, 6, [UNIFORM] * 5, [UNIFORM] * 32, 464, 88)
    assert CostModel(expert_ms=0.092, base_ms=5.9, per_request_ms=0.17).eviction_pays(*args)
    assert not CostModel(expert_ms=exp, base_ms=base, per_request_ms=per).eviction_pays(*args)


# The H200 elastic32 run at 312737e: prior step line 5.33 ms + 0.17 ms a request, a read
# 0.337 ms; 4 long requests running (a request's KV ~1,000 pages), 51 waiting
H200 = CostModel(expert_ms=0.33717956794525983, base_ms=5.32908166210942, per_request_ms=0.17)
EAGER = CostModel(expert_ms=H200.expert_ms, base_ms=H200.base_ms, per_request_ms=H200.per_request_ms,
                  eager_prefill_share=0.2)


def test_any_expert_out_costs_the_eager_prefill_share():
    assert EAGER.throughput(8, []) == H200.throughput(8, [])
    assert EAGER.throughput(8, [UNIFORM]) == pytest.approx(0.8 * H200.throughput(8, [UNIFORM]))
    assert EAGER.throughput(8, iter([UNIFORM])) == EAGER.throughput(8, [UNIFORM])
    with pytest.raises(ValueError):
        CostModel(expert_ms=1, base_ms=1, per_request_ms=0, eager_prefill_share=1.0)


def test_the_first_eviction_must_win_back_the_prefill_graphs():
    # what the H200 run did: 22 uniform experts out (one a layer) to run 6 instead of 4,
    # priced +1.7 %; they stayed out 10 s and the prefills ran eagerly meanwhile
    victims = [UNIFORM] * 22
    assert H200.eviction_pays(4, 2, [], victims, 1000, KV_PER_EXPERT)
    assert H200.throughput(6, victims) / H200.throughput(4, []) == pytest.approx(1.017, abs=0.001)
    assert not EAGER.eviction_pays(4, 2, [], victims, 1000, KV_PER_EXPERT)
    # once experts are out, the next eviction is priced on decode alone (both states eager)
    out = [UNIFORM] * 22
    assert EAGER.eviction_pays(30, 1, out, [0.0005]) == H200.eviction_pays(30, 1, out, [0.0005])
    # cold experts that admit many still go
    assert EAGER.eviction_pays(10, 10, [], [0.0005] * 30)


def test_bringing_the_last_experts_back_earns_the_share():
    # batch 10, two uniform experts out, one expert's KV = one request's: all back runs 8
    # requests with graphed prefills, which beats 9 with one still out
    t = touched
    one_back = 9 / (EAGER.step_ms(9) + t(UNIFORM, 9) * EAGER.expert_ms) * 0.8
    all_back = 8 / EAGER.step_ms(8)
    assert all_back > one_back
    assert EAGER.restored_throughput(10, [UNIFORM, UNIFORM], 100, 100) == pytest.approx(all_back)
    assert H200.restored_throughput(10, [UNIFORM, UNIFORM], 100, 100) == pytest.approx(one_back / 0.8)


def test_cold_experts_under_replay_max_p_cost_no_eager_share():
    """Skewed routing: an offloaded expert a token picks with at most ``replay_max_p``
    leaves the largest prefill pass replaying, so a state with only such experts out
    pays no eager-prefill share (the runtime's rule, sglang_rimuru/experts/in_place.py)."""
    import dataclasses

    m = CostModel(expert_ms=0.1, base_ms=1.0, per_request_ms=0.05, eager_prefill_share=0.2, replay_max_p=0.01)
    assert not m.eager([]) and not m.eager([0.01, 0.0]) and m.eager([0.01, 0.0101])
    assert not dataclasses.replace(m, eager_prefill_share=0.0).eager([0.5])
    assert dataclasses.replace(m, replay_max_p=0.0).eager([1e-6])  # the default: any routed expert
    cold, warm = [0.01, 0.005], [0.02]
    assert m.throughput(4, cold) == pytest.approx(4 / (1.2 + m.offload_ms(cold, 4)))
    assert m.throughput(4, warm) == pytest.approx(0.8 * 4 / (1.2 + m.offload_ms(warm, 4)))
    # restoring the warm one of [0.3, 0.005] (j = 1, batch 6 -> 5) leaves a cold rest: no share
    r = m.restored_throughput(6, [0.3, 0.005], kv_per_request=10, kv_per_expert=10)
    assert r == pytest.approx(5 / (1.25 + touched(0.005, 5) * 0.1))
    r0 = dataclasses.replace(m, replay_max_p=0.0).restored_throughput(6, [0.3, 0.005], 10, 10)
    assert r0 == pytest.approx(4 / 1.2)  # there the j = 1 state keeps the share: all back (j = 2) wins


#: Qwen3-30B-A3B at 32 GB on one H100 (bench/RESULTS.md, twenty-ninth session): the step line
#: the server fitted, an expert's 9 MiB = 96 tokens of KV (98,304 B a token), ~474 tokens a
#: running request, 4,771 of 6,144 experts out, a token routed to 8 of 128
QWEN3_H100 = CostModel(expert_ms=0.171, base_ms=5.90, per_request_ms=0.170)
UNIFORM_Q3 = 8 / 128


def test_at_a_large_batch_a_step_that_pays_gains_less_than_the_margin():
    out = [UNIFORM_Q3] * 4771
    # a 32-page shortfall's 11 victims free the KV of 2 more requests at batch 267: +0.49 %
    gain = QWEN3_H100.throughput(269, out + [UNIFORM_Q3] * 11) / QWEN3_H100.throughput(267, out)
    assert gain == pytest.approx(1.0049, abs=1e-4)
    assert not QWEN3_H100.eviction_pays(267, 2, out, [UNIFORM_Q3] * 11, 474, 96)
    assert QWEN3_H100.eviction_pays(267, 2, out, [UNIFORM_Q3] * 11, 474, 96, margin=0.0)
    # twice the victims for 5 more: +1.3 %, past the margin
    assert QWEN3_H100.eviction_pays(267, 5, out, [UNIFORM_Q3] * 22, 474, 96)
    # Qwen1.5 at 32 GB: uniform experts lose at any size, with or without the margin
    assert not QWEN15.eviction_pays(30, 1, [], [UNIFORM] * 6, margin=0.0)
    assert not QWEN15.eviction_pays(30, 8, [], [UNIFORM] * 40, KV_PER_REQUEST, KV_PER_EXPERT, margin=0.0)


def test_routed_experts_counts_and_slope():
    from sglang_rimuru.adjuster.cost import RoutedExperts

    routed = RoutedExperts([0.5, 0.5, 1.0, 0.0])
    assert routed(1) == pytest.approx(2.0)  # 0.5 + 0.5 + 1 + 0
    assert routed(2) == pytest.approx(2.5)  # 0.75 + 0.75 + 1
    assert routed.slope(2) == pytest.approx(-2 * 0.25 * math.log(0.5))  # the sure and the never add nothing
    assert routed(0) == 0.0


def test_step_clock_fits_the_resident_step_as_a_curve_in_routed_experts():
    from sglang_rimuru.adjuster.cost import RoutedExperts, StepClock

    # The forty-fourth session's case (bench/RESULTS.md): resident steps only on the ramp
    # (batch 1-20), which grow with the distinct experts routed to (0.01 ms an expert),
    # then a burst at batch 30-64 with experts out at 0.5 ms a read.
    routed = RoutedExperts(zipf_layer() * 24)
    resident = lambda b: 3.0 + 0.01 * routed(b)  # noqa: E731
    curve, line = (StepClock(prior=(5.9, 0.17, 0.34), min_samples=8, routed=routed),
                   StepClock(prior=(5.9, 0.17, 0.34), min_samples=8))
    for clock in (curve, line):
        for b in range(1, 21):
            clock.record(b, resident(b))
        for b in range(30, 65):
            clock.record(b, resident(b) + 0.5 * 0.2 * b, 0.2 * b)
    base, per, exp = curve.fit(at_batch=60)
    assert curve.tangent_at == 60
    assert exp == pytest.approx(0.5)  # the reads priced against the curve, not a line through the ramp
    assert per == pytest.approx(0.01 * routed.slope(60))
    assert base + per * 60 == pytest.approx(resident(60))  # the tangent touches the curve at 60
    # the line through the ramp overshoots the resident step at 60 and pushes the reads to the floor
    lb, lp, le = line.fit()
    assert lb + lp * 60 > 1.2 * resident(60) and le == pytest.approx(0.75 * 0.34)
    # without a batch to be the tangent at, the line in B as before; without routed, too
    assert curve.fit() == line.fit() and curve.tangent_at is None
    assert line.fit(at_batch=60) == line.fit() and line.tangent_at is None


def test_step_clock_curve_from_the_prior_without_resident_steps():
    from sglang_rimuru.adjuster.cost import RoutedExperts, StepClock

    # all at once: experts go out before the batch spans MIN_SPAN sizes; the prior's line
    # becomes the curve that takes its time at batch 1 and PRIOR_SPAN
    routed = RoutedExperts(zipf_layer() * 24)
    clock = StepClock(prior=(5.9, 0.17, 0.34), min_samples=8, routed=routed)
    base, h = clock._resident_curve()
    assert base + h * routed(1) == pytest.approx(5.9 + 0.17)
    assert base + h * routed(StepClock.PRIOR_SPAN) == pytest.approx(5.9 + 0.17 * StepClock.PRIOR_SPAN)
    b0, p0, e0 = clock.fit(at_batch=StepClock.PRIOR_SPAN)
    assert (b0 + p0 * StepClock.PRIOR_SPAN, e0) == pytest.approx((5.9 + 0.17 * StepClock.PRIOR_SPAN, 0.34))
    assert p0 < 0.17  # past the hot experts a request adds fewer new ones than the line says
    # a few resident steps at one batch size: the prior's curve through their mean
    for _ in range(4):
        clock.record(3, 7.0)
    base, h2 = clock._resident_curve()
    assert h2 == pytest.approx(h) and base + h * routed(3) == pytest.approx(7.0)
    # a routing in which no batch adds an expert gives no curve: the line decides
    flat = StepClock(prior=(5.9, 0.17, 0.34), routed=RoutedExperts([1.0] * 4))
    assert flat.fit(at_batch=10) == StepClock(prior=(5.9, 0.17, 0.34)).fit() and flat.tangent_at is None
