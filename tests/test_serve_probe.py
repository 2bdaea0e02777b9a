"""bench/device/serve_probe.py's rounds and probe_summary.py's ratios (issue 11's 3 % check):
a batch measured in several rounds is one entry whose step time is the median round, with
the spread kept; a second plain server (off2) is summarized against the first."""

import json

import pytest

from tests.conftest import bench_module


def test_rounds_combine_to_the_median_round_with_their_spread():
    probe = bench_module("device/serve_probe.py")
    rounds = [{"batch": 8, "requests": 8, "step_ms_median": m, "step_ms_min": m - 0.1} for m in (4.2, 3.8, 4.0)]
    d = probe.combine_rounds(rounds)
    assert d["batch"] == 8 and d["step_ms_median"] == 4.0 and d["step_ms_min"] == pytest.approx(3.7)
    assert d["step_ms_rounds"] == [4.2, 3.8, 4.0]
    assert abs(d["round_spread"] - 0.1) < 1e-12  # (4.2 - 3.8) / 4.0
    two = probe.combine_rounds(rounds[:2])
    assert abs(two["step_ms_median"] - 4.0) < 1e-12  # an even count: the mean of the middle two
    one = probe.combine_rounds(rounds[:1])
    assert one["step_ms_median"] == 4.2 and one["round_spread"] == 0.0


def test_summary_sets_a_second_plain_server_beside_the_first(tmp_path):
    summary = bench_module("device/probe_summary.py")

    def write(name, steps):
        json.dump({"server": {"max_total_num_tokens": 10_000}, "short_ids": [1, 2], "errors": {},
                   "decode": [{"batch": b, "step_ms_median": ms, "step_ms_min": ms, "kv_tokens_needed": 100,
                               "round_spread": 0.02} for b, ms in steps.items()]},
                  open(tmp_path / f"{name}.json", "w"))

    write("off", {1: 4.0, 8: 5.0})
    write("off2", {1: 4.4, 8: 5.0})
    write("static_all", {1: 4.2, 8: 5.5})
    s = summary.summarize(summary.load([str(tmp_path)]))
    assert s["ratios"]["off2/off: a second plain SGLang server, the spread between instances"]["decode"][1]["ratio"] \
        == 1.1
    assert s["ratios"]["static_all/off2"]["decode"][8]["ratio"] == 1.1
    assert s["servers"]["off2"]["decode_round_spread"] == {1: 0.02, 8: 0.02}
    summary.show(s)  # prints without error
