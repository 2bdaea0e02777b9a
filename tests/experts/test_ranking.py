"""MoEShape sizes and checks; the ranking file: round trip, default, every corrupt-file error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_rimuru.experts import (
    FORMAT,
    ExpertRanking,
    MoEShape,
    RankingError,
    load_ranking,
    save_ranking,
)

from .rig import ORDERS, ranking_of, tiny_shape


def test_shape_sizes_and_layer_order() -> None:
    s = MoEShape(layer_ids=(1, 3, 5), num_experts=8, hidden=8, inter=4, top_k=2, dtype=torch.bfloat16)
    assert (s.matrix_elems, s.expert_page_bytes, s.expert_bytes) == (32, 64, 192)
    assert [s.matrix_shape(m) for m in range(3)] == [(4, 8), (4, 8), (8, 4)]
    assert [s.position(l) for l in (1, 3, 5)] == [0, 1, 2]
    assert [s.next_layer(l) for l in (1, 3, 5)] == [3, 5, None]
    with pytest.raises(ValueError, match="layer 2 is not a MoE layer"):
        s.position(2)
    f32 = MoEShape((0,), 4, hidden=16, inter=8, top_k=1, dtype=torch.float32)
    assert (f32.expert_page_bytes, f32.expert_bytes) == (512, 1536)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layer_ids=()), "layer_ids is empty"),
    (dict(layer_ids=(0, 0)), "repeat"),
    (dict(layer_ids=(-1,)), "layer ids"),
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=9), "top_k=9 > num_experts=8"),
    (dict(inter=2.5), "inter"),
    (dict(dtype="bf16"), "dtype"),
])
def test_shape_rejects(kwargs, match) -> None:
    base = dict(layer_ids=(0, 1), num_experts=8, hidden=8, inter=4, top_k=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        MoEShape(**{**base, **kwargs})


def test_default_ranking_is_index_order_uniform() -> None:
    r = ExpertRanking.default(tiny_shape())
    assert r.order(0) == r.order(1) == list(range(8))
    assert [r.probability(1, e) for e in range(8)] == [0.125] * 8
    assert [r.rank(0, e) for e in range(8)] == list(range(8))


def test_round_trip_is_exact_and_atomic(tmp_path: Path) -> None:
    shape = tiny_shape()
    r = ranking_of(shape, ORDERS)
    path = tmp_path / "ranking.json"
    save_ranking(path, r, model="tiny-qwen3-moe")
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["model"], data["num_experts"]) == (
        FORMAT, 1, "tiny-qwen3-moe", 8)
    assert data["layers"]["0"]["order"] == ORDERS[0]
    assert data["layers"]["1"]["probability"] == [(8 - i) / 36 for i in range(8)]
    back = load_ranking(path, shape)
    assert back == r
    assert back.order(0) == ORDERS[0] and back.rank(0, 3) == 0 and back.rank(0, 6) == 7
    assert back.probability(0, 3) == 8 / 36 and back.probability(0, 6) == 1 / 36
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ranking.json"]  # no temp file left
    save_ranking(path, ExpertRanking.default(shape))  # overwrite in place
    assert load_ranking(path, shape) == ExpertRanking.default(shape)


def _good() -> dict:
    return ranking_of(tiny_shape(), ORDERS).to_json("m")


def _set(path: list, value):
    def edit(d: dict) -> dict:
        node = d
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return d
    return edit


_DELETE = object()

CORRUPT = [
    ("not-json", lambda d: "{'format': 1", "not JSON"),
    ("list", lambda d: [1, 2], "expected a JSON object"),
    ("format", _set(["format"], "other"), "format is 'other'"),
    ("version", _set(["version"], 2), "version is 2"),
    ("num-experts", _set(["num_experts"], 16), "num_experts is 16, the model has 8"),
    ("layers-type", _set(["layers"], [1]), "'layers' must be an object"),
    ("missing-layer", _set(["layers", "1"], _DELETE), r"missing MoE layer\(s\) \[1\]"),
    ("extra-layer", _set(["layers", "7"], {"order": list(range(8)), "probability": [0.1] * 8}),
     r"layer\(s\) \[7\] are not MoE layers"),
    ("bad-key", _set(["layers", "x"], {}), "layer key 'x' is not an integer"),
    ("not-permutation", _set(["layers", "0", "order"], [3, 3, 4, 0, 5, 2, 7, 6]),
     r"layer 0: 'order' is not a permutation of 0..7 \(repeated: \[3\], out of range: \[\]\)"),
    ("out-of-range", _set(["layers", "0", "order"], [3, 1, 4, 0, 5, 2, 7, 8]), r"out of range: \[8\]"),
    ("order-length", _set(["layers", "1", "order"], list(range(7))),
     "layer 1: 'order' lists 7 experts, the model has 8"),
    ("order-type", _set(["layers", "1", "order"], ["0"] * 8), "'order' must be a list of expert ids"),
    ("prob-length", _set(["layers", "1", "probability"], [0.1] * 9), "'probability' has 9 entries"),
    ("negative", _set(["layers", "0", "probability"], [0.5] + [-0.1] * 7),
     r"probability\[1\] = -0.1 \(expert 1\) is not a finite number >= 0"),
    ("nan", _set(["layers", "0", "probability"], [float("nan")] * 8), "probability\\[0\\] = nan"),
    ("infinite", _set(["layers", "0", "probability"], [float("inf")] * 8), "probability\\[0\\] = inf"),
    ("increasing", _set(["layers", "0", "probability"], [0.1, 0.2] + [0.0] * 6), "non-increasing"),
    ("prob-type", _set(["layers", "0", "probability"], ["1"] * 8), "is not a number"),
    ("entry", _set(["layers", "0"], {"order": list(range(8))}), "expected an object with 'order'"),
]


@pytest.mark.parametrize("edit, match", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupt_file_names_file_and_problem(tmp_path: Path, edit, match) -> None:
    path = tmp_path / "bad.json"
    data = edit(_good())
    path.write_text(data if isinstance(data, str) else json.dumps(data))  # NaN/Infinity literals
    with pytest.raises(RankingError, match=match) as info:
        load_ranking(path, tiny_shape())
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file_and_wrong_model(tmp_path: Path) -> None:
    with pytest.raises(RankingError, match="cannot read it"):
        load_ranking(tmp_path / "nope.json", tiny_shape())
    path = tmp_path / "r.json"
    save_ranking(path, ranking_of(tiny_shape(), ORDERS))
    with pytest.raises(RankingError, match=r"layer\(s\) \[0\] are not MoE layers"):
        load_ranking(path, tiny_shape(layer_ids=(1,)))


def test_ranking_object_checks() -> None:
    with pytest.raises(RankingError, match="layer 0: 'order' is not a permutation"):
        ExpertRanking(4, {0: [0, 1, 2, 2]}, {0: [0.25] * 4})
    r = ExpertRanking.default(tiny_shape())
    with pytest.raises(RankingError, match="num_experts=8, the model has 16"):
        r.check_fits(tiny_shape(E=16))
    with pytest.raises(KeyError, match="no layer 5"):
        r.order(5)
