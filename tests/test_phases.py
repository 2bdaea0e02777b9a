"""bench/serving/phases.py: phased traffic's parsing, disjoint dataset slices, and the
aggregate over every request of every phase (bench_serving's own definitions)."""

import json

import pytest

from tests.conftest import bench_module


def load():
    return bench_module("serving/phases.py")


def test_phases_parse_and_refuse_what_is_not_rate_num():
    m = load()
    assert m.parse_phases("1:60,20:300,1.5:7") == [(1.0, 60), (20.0, 300), (1.5, 7)]
    for bad in ("1:60,20", "a:3", "1:0", "-1:5", "1:2:3"):
        with pytest.raises(ValueError, match="--phases"):
            m.parse_phases(bad)


def test_phase_datasets_are_disjoint_contiguous_and_sized_by_count(tmp_path):
    m = load()
    convs = [{"id": i} for i in range(100)]
    plain = tmp_path / "sg.json"
    plain.write_text(json.dumps(convs))
    paths = m.phase_datasets(plain, [10, 60, 30], tmp_path)
    slices = [json.loads(p.read_text()) for p in paths]
    assert [len(s) for s in slices] == [10, 60, 30]
    assert [c["id"] for s in slices for c in s] == list(range(100))  # disjoint, in order, nothing lost
    with pytest.raises(ValueError, match="holds 100 conversations"):
        m.phase_datasets(plain, [80, 30], tmp_path)


def test_percentile_is_numpys_linear_one():
    m = load()
    xs = [4.0, 1.0, 3.0, 2.0]
    assert m.percentile(xs, 0.5) == 2.5 and m.percentile(xs, 0.0) == 1.0 and m.percentile(xs, 1.0) == 4.0
    assert m.percentile(xs, 0.99) == pytest.approx(3.97)
    assert m.percentile([], 0.5) is None


def test_aggregate_counts_every_request_of_every_phase():
    m = load()
    p1 = {"completed": 2, "duration": 10.0, "total_output_tokens": 30, "ttfts": [0.1, 0.3],
          "errors": ["", ""], "itls": [[0.01, 0.03], [0.02] * 4], "output_lens": [3, 5]}
    p2 = {"completed": 1, "duration": 5.0, "total_output_tokens": 15, "ttfts": [0.2, 0.0],
          "errors": ["", "boom"], "itls": [[0.05], []], "output_lens": [2, 0]}
    a = m.aggregate([p1, p2])
    assert a["completed"] == 3 and a["duration"] == 15.0 and a["output_throughput"] == 3.0
    assert a["median_ttft_ms"] == pytest.approx(200.0)  # 100, 200, 300 ms; the failed request left out
    # TPOT per request: 40 ms / 2, 80 ms / 4, 50 ms / 1 -> 20, 20, 50
    assert a["median_tpot_ms"] == pytest.approx(20.0)
    none = m.aggregate([{}])
    assert none["completed"] == 0 and none["median_ttft_ms"] == 0.0 and none["output_throughput"] == 0.0
