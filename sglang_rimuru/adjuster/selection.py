"""Which experts to evict or restore, across MoE layers (DESIGN §5, "Which expert").

Each layer nominates one expert at a time; the adjuster takes the best
nomination over all layers, and that layer then nominates its next one:

    evict    nomination: the layer's lowest-ranked resident expert; none
             once the layer would exceed its offload limit.  Take the LEAST
             probable.
    restore  nomination: the layer's highest-ranked offloaded expert.  Take
             the MOST probable.
    ties     (equal probability across layers): spread over layers. A victim
             comes from the layer with the FEWEST experts offloaded (counting
             in-flight evictions and the picks so far), a restore goes to the
             layer with the MOST; then the lowest layer id. With the default
             ranking (every expert 1/E) evictions therefore rotate over the
             layers instead of all landing on the first one: the double load
             buffers hide one layer's loads behind the previous layer's
             compute, which piling every load on one layer would defeat.
             Experts of different probability still go strictly by rank.

Nothing is mutated: the picks are a simulation of ``n`` rounds of nominations
on the residency as it is.  ``in_flight`` names experts of orders not yet
complete (see ``adjuster.py``): they are never nominated, and an in-flight
eviction (an expert still resident in ``residency``) already uses one unit of
its layer's offload budget.  In-flight restores do not give budget back until
they are complete.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain duck typing at run time; no torch import from here
    from sglang_rimuru.experts import ExpertRanking, ExpertResidency

__all__ = ["pick_offloaded_at_start", "pick_restores", "pick_victims"]

Move = tuple[int, int]  # (layer, expert)


def pick_victims(residency: ExpertResidency, ranking: ExpertRanking, n: int,
                 in_flight: Collection[Move] = ()) -> list[Move]:
    """Up to ``n`` experts to evict, least probable first; fewer when no layer can give one."""
    frozen = set(in_flight)
    busy = Counter(l for l, e in frozen if residency.is_resident(l, e))
    out = {l: residency.num_offloaded(l) + busy[l] for l in residency.shape.layer_ids}

    def nominations(layer: int) -> Iterator[tuple[int, int]]:
        budget = residency.offload_limit - out[layer]
        for e in reversed(ranking.order(layer)):
            if budget <= 0:
                return
            if residency.is_resident(layer, e) and (layer, e) not in frozen:
                budget -= 1
                yield e, out[layer]
                out[layer] += 1

    return _merge(residency.shape.layer_ids, ranking, n, nominations, sign=1.0)


def pick_restores(residency: ExpertResidency, ranking: ExpertRanking, n: int,
                  in_flight: Collection[Move] = ()) -> list[Move]:
    """Up to ``n`` offloaded experts to restore, most probable first; fewer when all are resident."""
    frozen = set(in_flight)
    coming = Counter(l for l, e in frozen if not residency.is_resident(l, e))
    out = {l: residency.num_offloaded(l) - coming[l] for l in residency.shape.layer_ids}

    def nominations(layer: int) -> Iterator[tuple[int, int]]:
        for e in ranking.order(layer):
            if not residency.is_resident(layer, e) and (layer, e) not in frozen:
                yield e, -out[layer]  # the layer with the most offloaded first
                out[layer] -= 1

    return _merge(residency.shape.layer_ids, ranking, n, nominations, sign=-1.0)


def pick_offloaded_at_start(layer_ids: Sequence[int], ranking: ExpertRanking, offload_limit: int,
                            n: int) -> list[Move]:
    """The ``n`` experts an elastic pool starts without: the victims ``pick_victims``
    would choose if every expert were resident (least probable first, ties
    spread over layers, at most ``offload_limit`` per layer)."""
    out = dict.fromkeys(layer_ids, 0)

    def nominations(layer: int) -> Iterator[tuple[int, int]]:
        for e in reversed(ranking.order(layer)[-offload_limit:] if offload_limit else []):
            yield e, out[layer]
            out[layer] += 1

    return _merge(layer_ids, ranking, n, nominations, sign=1.0)


def _merge(layer_ids: Sequence[int], ranking: ExpertRanking, n: int, nominations,
           sign: float) -> list[Move]:
    """k-way merge of the layers' nomination streams on ``(sign * probability, spread, layer)``.

    Each stream yields ``(expert, spread)``; ``spread`` is the tie-break between
    layers (see the module docstring), computed when the nomination is made, so
    the other layers' heap entries stay valid when one layer's count moves.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    out: list[Move] = []
    if n == 0:
        return out
    heap: list[tuple[float, int, int, int, Iterator[tuple[int, int]]]] = []

    def push(layer: int, it: Iterator[tuple[int, int]]) -> None:
        nomination = next(it, None)
        if nomination is not None:
            e, spread = nomination
            # one entry per layer at a time: ties end at the layer id, never at ``it``
            heapq.heappush(heap, (sign * ranking.probability(layer, e), spread, layer, e, it))

    for layer in layer_ids:
        push(layer, nominations(layer))
    while heap and len(out) < n:
        _, _, layer, e, it = heapq.heappop(heap)
        out.append((layer, e))
        push(layer, it)
    return out

