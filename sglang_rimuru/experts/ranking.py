"""The offline hot-expert ranking (DESIGN §5): per MoE layer, experts most probable first.

File format (JSON, one file per model; the same file serves every TP rank)::

    {
      "format": "sglang-rimuru-expert-ranking",
      "version": 1,
      "model": "<informational, e.g. the model path>",
      "num_experts": E,
      "layers": {
        "<layer id>": {"order": [expert ids, most probable first; a permutation of 0..E-1],
                       "probability": [p of order[0], p of order[1], ...]}
      }
    }

Every MoE layer of the model must be present, and no other layer.  Each
probability is a finite float >= 0, and the list is non-increasing (it is
listed in ``order``, most probable first).  Probabilities need not sum to 1
(a layer routes ``top_k`` experts per token; the file may hold raw frequencies).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .shapes import MoEShape

__all__ = ["FORMAT", "VERSION", "ExpertRanking", "RankingError", "load_ranking", "save_ranking"]

FORMAT = "sglang-rimuru-expert-ranking"
VERSION = 1


class RankingError(ValueError):
    """A ranking file (or ranking data) is malformed or does not fit the model."""


class ExpertRanking:
    """Per-layer expert order (most probable first) and each expert's probability.

    Immutable after construction.  ``rank(layer, expert)`` is the expert's
    position in its layer's order (0 = hottest).
    """

    def __init__(
        self,
        num_experts: int,
        orders: Mapping[int, Sequence[int]],
        probabilities: Mapping[int, Sequence[float]],
    ) -> None:
        self.num_experts = num_experts
        self._order: dict[int, tuple[int, ...]] = {}
        self._rank: dict[int, tuple[int, ...]] = {}
        self._prob: dict[int, tuple[float, ...]] = {}  # indexed by expert id
        if set(orders) != set(probabilities):
            raise RankingError("orders and probabilities cover different layers")
        for layer in sorted(orders):
            problem = _layer_problem(num_experts, orders[layer], probabilities[layer])
            if problem:
                raise RankingError(f"layer {layer}: {problem}")
            order = tuple(int(e) for e in orders[layer])
            rank = [0] * num_experts
            prob = [0.0] * num_experts
            for r, (e, p) in enumerate(zip(order, probabilities[layer])):
                rank[e] = r
                prob[e] = float(p)
            self._order[layer] = order
            self._rank[layer] = tuple(rank)
            self._prob[layer] = tuple(prob)

    @classmethod
    def default(cls, shape: MoEShape) -> "ExpertRanking":
        """Expert index order, uniform probability ``1/E`` (used when no file is given)."""
        e = shape.num_experts
        return cls(e, {lid: range(e) for lid in shape.layer_ids},
                   {lid: [1.0 / e] * e for lid in shape.layer_ids})

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self._order)

    def order(self, layer: int) -> list[int]:
        """Expert ids of ``layer``, most probable first."""
        return list(self._layer(self._order, layer))

    def rank(self, layer: int, expert: int) -> int:
        """Position of ``expert`` in ``order(layer)`` (0 = most probable)."""
        return self._layer(self._rank, layer)[expert]

    def probability(self, layer: int, expert: int) -> float:
        return self._layer(self._prob, layer)[expert]

    def token_probabilities(self, layer: int, top_k: int) -> list[float]:
        """Per expert id, the probability that a token picks it: the layer's
        probabilities scaled to sum to ``top_k`` (a token picks ``top_k`` experts;
        a ranking file may hold any non-negative weights), uniform where they sum to 0."""
        probs = self._layer(self._prob, layer)
        total = sum(probs)
        if total <= 0:
            return [top_k / len(probs)] * len(probs)
        return [p * top_k / total for p in probs]

    def check_fits(self, shape: MoEShape, source: str = "ranking") -> None:
        """``RankingError`` unless this ranking covers exactly ``shape``'s MoE layers and E."""
        if self.num_experts != shape.num_experts:
            raise RankingError(
                f"{source}: num_experts={self.num_experts}, the model has {shape.num_experts}")
        missing = [lid for lid in shape.layer_ids if lid not in self._order]
        if missing:
            raise RankingError(f"{source}: missing MoE layer(s) {missing}")
        extra = sorted(set(self._order) - set(shape.layer_ids))
        if extra:
            raise RankingError(
                f"{source}: layer(s) {extra} are not MoE layers of the model "
                f"(MoE layers: {list(shape.layer_ids)})")

    def to_json(self, model: str = "") -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": model,
            "num_experts": self.num_experts,
            "layers": {
                str(layer): {
                    "order": list(order),
                    "probability": [self._prob[layer][e] for e in order],
                }
                for layer, order in self._order.items()
            },
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertRanking):
            return NotImplemented
        return (self.num_experts, self._order, self._prob) == (
            other.num_experts, other._order, other._prob)

    def __repr__(self) -> str:
        return f"ExpertRanking(num_experts={self.num_experts}, layers={list(self._order)})"

    @staticmethod
    def _layer(table: dict, layer: int):
        try:
            return table[layer]
        except KeyError:
            raise KeyError(f"the ranking has no layer {layer!r}") from None


def load_ranking(path: str | os.PathLike, shape: MoEShape) -> ExpertRanking:
    """Read and validate a ranking file for ``shape``; ``RankingError`` names file and problem."""
    path = Path(path)

    def fail(problem: str) -> RankingError:
        return RankingError(f"expert ranking file {str(path)!r}: {problem}")

    try:
        text = path.read_text()
    except OSError as e:
        raise fail(f"cannot read it ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(f"not JSON ({e})") from e
    if not isinstance(data, dict):
        raise fail(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise fail(f"format is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise fail(f"version is {data.get('version')!r}, this build reads version {VERSION}")
    e = data.get("num_experts")
    if not _is_int(e) or e != shape.num_experts:
        raise fail(f"num_experts is {e!r}, the model has {shape.num_experts} experts per layer")
    layers = data.get("layers")
    if not isinstance(layers, dict):
        raise fail("'layers' must be an object mapping layer ids to {order, probability}")
    parsed: dict[int, dict] = {}
    for key, entry in layers.items():
        try:
            lid = int(key)
        except ValueError:
            raise fail(f"layer key {key!r} is not an integer") from None
        if str(lid) != key or lid in parsed:
            raise fail(f"layer key {key!r} is not a canonical integer or repeats")
        parsed[lid] = entry
    extra = sorted(set(parsed) - set(shape.layer_ids))
    if extra:
        raise fail(f"layer(s) {extra} are not MoE layers of the model "
                   f"(MoE layers: {list(shape.layer_ids)})")
    missing = [lid for lid in shape.layer_ids if lid not in parsed]
    if missing:
        raise fail(f"missing MoE layer(s) {missing}")
    orders, probs = {}, {}
    for lid in shape.layer_ids:
        entry = parsed[lid]
        if not isinstance(entry, dict) or "order" not in entry or "probability" not in entry:
            raise fail(f"layer {lid}: expected an object with 'order' and 'probability'")
        problem = _layer_problem(shape.num_experts, entry["order"], entry["probability"])
        if problem:
            raise fail(f"layer {lid}: {problem}")
        orders[lid], probs[lid] = entry["order"], entry["probability"]
    return ExpertRanking(shape.num_experts, orders, probs)


def save_ranking(path: str | os.PathLike, ranking: ExpertRanking, model: str = "") -> None:
    """Write ``ranking`` to ``path`` atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    text = json.dumps(ranking.to_json(model), indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_problem(num_experts: int, order: object, prob: object) -> str | None:
    """What is wrong with one layer's ``order``/``probability``, or ``None``."""
    if not isinstance(order, (list, tuple, range)) or not all(_is_int(x) for x in order):
        return "'order' must be a list of expert ids (ints)"
    if len(order) != num_experts:
        return f"'order' lists {len(order)} experts, the model has {num_experts}"
    if sorted(order) != list(range(num_experts)):
        dup = sorted({x for x in order if list(order).count(x) > 1})
        out = sorted(x for x in order if not 0 <= x < num_experts)
        return (f"'order' is not a permutation of 0..{num_experts - 1}"
                f" (repeated: {dup[:8]}, out of range: {out[:8]})")
    if not isinstance(prob, (list, tuple)):
        return "'probability' must be a list of numbers"
    if len(prob) != num_experts:
        return f"'probability' has {len(prob)} entries, the model has {num_experts} experts"
    for r, p in enumerate(prob):
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            return f"probability[{r}] = {p!r} is not a number"
        if math.isnan(p) or math.isinf(p) or p < 0:
            return f"probability[{r}] = {p!r} (expert {order[r]}) is not a finite number >= 0"
    for r in range(1, num_experts):
        if prob[r] > prob[r - 1]:
            return (f"'probability' must be non-increasing (most probable first): "
                    f"probability[{r}] = {prob[r]!r} > probability[{r - 1}] = {prob[r - 1]!r}")
    return None
