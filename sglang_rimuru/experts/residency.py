"""``ExpertResidency``: which experts of each MoE layer sit on which three expert pages.

Bookkeeping only (no tensors, no pool).  State map, per MoE layer ``l``::

    _pages[l]   {expert: (p_w1, p_w3, p_w2)}   the resident experts
    _holder     {page: (l, expert)}            the same, by page: no page holds two experts
    offloaded   every other expert of l;  len(offloaded) <= offload_limit, always
    _version[l] bumped on every change of l (the manager refreshes its table then)

It holds no reference to the page pool, so each side of the migration-order
protocol keeps its own (``sglang_rimuru/adjuster/README.md``, "Who owns
what"): the scheduler's adjuster its view, changed when the worker
acknowledges an order; the TP worker's ``ExpertManager`` the residency as
applied, which its page tables follow.  The two are built from the same
placement (``placement()``: plain data) and never share an object.

Placement takes pages from the pool it is given (scheduler side, at start):
the static mode keeps a prefix of each layer's ranking resident
(``place_initial``); the elastic mode starts with whatever set fits
(``place_all_but``: the adjuster's selection picks who is left out). Experts
move in and out with ``evict`` / ``admit``; nothing here assumes the resident
set is a prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from sglang_rimuru.pool import EXPERT_MATRICES, ExpertKey, UnifiedPagePool

from .ranking import ExpertRanking
from .shapes import MoEShape, NotEnoughPagesError

__all__ = ["ExpertResidency", "expert_owners"]


def expert_owners(layer: int, expert: int) -> list[ExpertKey]:
    """The pool owners of one expert's three pages, in page-slot order (W1, W3, W2)."""
    return [ExpertKey(layer, expert, m) for m in EXPERT_MATRICES]


class ExpertResidency:
    """Resident experts per layer and their pages (W1, W3, W2).

    Contract:
      * a layer never has more than ``offload_limit`` experts offloaded once
        placed (``place_initial`` / ``place_all_but``, or built from a
        ``placement``); ``evict`` refuses to go past it;
      * no page holds two resident experts (``admit`` refuses);
      * ``resident``/``offloaded`` list experts in ranking order (hottest first);
      * pages are allocated by ``place_*`` (from the pool given to it) and, for
        ``admit``, by the pool's owner; this class never frees a page and keeps
        no pool: ``evict`` hands the pages back to the caller.
    """

    def __init__(self, shape: MoEShape, ranking: ExpertRanking, offload_limit: int,
                 resident: Mapping[int, Mapping[int, Sequence[int]]] | None = None) -> None:
        """``resident``: a placement (``placement()`` of another residency, plain
        data) to start from; without it nothing is resident until ``place_*``."""
        if isinstance(offload_limit, bool) or not isinstance(offload_limit, int) or not (
                0 <= offload_limit <= shape.num_experts):
            raise ValueError(f"--rimuru-expert-offload-limit must be in [0, {shape.num_experts}] "
                             f"(experts per layer), got {offload_limit!r}")
        ranking.check_fits(shape)
        self.shape = shape
        self.ranking = ranking
        self.offload_limit = offload_limit
        self._pages: dict[int, dict[int, tuple[int, int, int]]] = {l: {} for l in shape.layer_ids}
        self._holder: dict[int, tuple[int, int]] = {}
        self._version: dict[int, int] = {l: 0 for l in shape.layer_ids}
        self._changes = 0  # every layer's changes: one number that says "something moved"
        self._placed = False
        if resident is not None:
            self._start_from(resident)

    def _start_from(self, resident: Mapping[int, Mapping[int, Sequence[int]]]) -> None:
        if set(resident) != set(self.shape.layer_ids):
            raise ValueError(f"placement covers layers {sorted(resident)}, the model's MoE layers "
                             f"are {list(self.shape.layer_ids)}")
        for layer in self.shape.layer_ids:
            experts = resident[layer]
            if self.shape.num_experts - len(experts) > self.offload_limit:
                raise ValueError(f"placement of layer {layer} offloads "
                                 f"{self.shape.num_experts - len(experts)} experts, more than "
                                 f"--rimuru-expert-offload-limit={self.offload_limit}")
            for expert, pages in experts.items():
                self._put(layer, expert, pages, "placement")
            self._version[layer] += 1
            self._changes += 1
        self._placed = True

    def placement(self) -> dict[int, dict[int, tuple[int, int, int]]]:
        """``{layer: {expert: (W1, W3, W2) pages}}`` of every resident expert: plain,
        freshly built data (what the other side of the order protocol starts from)."""
        return {l: dict(p) for l, p in self._pages.items()}

    # ================================================================ placement

    def place_initial(self, page_pool: UnifiedPagePool, resident_per_layer: int,
                      sglang_layout: bool = False) -> None:
        """Allocate pages for the ``resident_per_layer`` hottest experts of every layer
        (``sglang_layout``: as ``place_all_but``)."""
        e, limit = self.shape.num_experts, self.offload_limit
        if isinstance(resident_per_layer, bool) or not isinstance(resident_per_layer, int):
            raise ValueError(f"--rimuru-resident-experts must be an int, got {resident_per_layer!r}")
        if resident_per_layer > e:
            raise ValueError(f"--rimuru-resident-experts={resident_per_layer} is more than the "
                             f"{e} experts per layer")
        if resident_per_layer < e - limit:
            raise ValueError(
                f"--rimuru-resident-experts={resident_per_layer} would offload "
                f"{e - resident_per_layer} experts per layer, more than "
                f"--rimuru-expert-offload-limit={limit}; keep at least {e - limit} resident "
                f"or raise the limit")
        self.place_all_but(page_pool, [(l, x) for l in self.shape.layer_ids
                                       for x in self.ranking.order(l)[resident_per_layer:]],
                           sglang_layout=sglang_layout)

    def place_all_but(self, page_pool: UnifiedPagePool, offloaded: Collection[tuple[int, int]],
                      sglang_layout: bool = False) -> None:
        """Allocate pages from ``page_pool`` for every expert except ``offloaded``
        (``(layer, expert)`` pairs), owned by ``expert_owners``.

        Layers in forward order, experts in ranking order, each expert's three
        pages in one all-or-nothing allocation. No layer may leave out more than
        ``offload_limit``. The whole need is checked against the pool first, so
        on ``NotEnoughPagesError`` nothing is allocated.

        ``sglang_layout``: a layer that keeps every expert takes its 3E pages in one
        allocation, W1 and W3 of expert e on its pages 2e and 2e + 1 and W2 on page
        2E + e: from a pool whose free pages run in order that is SGLang's own
        ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I], contiguous
        (``sglang_layout_base``), so SGLang's MoE can read the layer where it lies.
        For static mode, whose residency never changes.
        """
        if self._placed:
            raise RuntimeError("place_initial already ran")
        page_bytes = page_pool.geometry.expert_page_bytes
        if page_bytes < self.shape.expert_page_bytes:
            raise ValueError(f"the pool's expert page ({page_bytes} B) is smaller than one expert "
                             f"matrix ({self.shape.expert_page_bytes} B)")
        out = set(offloaded)
        for l, x in out:
            self._layer(l)
            self.shape.check_expert(x)
        per_layer = Counter(l for l, _ in out)
        over = {l: n for l, n in per_layer.items() if n > self.offload_limit}
        if over:
            raise ValueError(f"offloading {over} experts per layer is more than "
                             f"--rimuru-expert-offload-limit={self.offload_limit}")
        need = 3 * (self.shape.num_experts * self.shape.num_layers - len(out))
        free = page_pool.free_expert_page_count()
        if need > free:
            raise NotEnoughPagesError(
                f"keeping {need // 3} experts resident over {self.shape.num_layers} MoE layers needs "
                f"{need} expert pages ({need * page_bytes} B), the pool has "
                f"{free} free; lower --rimuru-resident-experts or give the pool more memory")
        for layer in self.shape.layer_ids:
            if sglang_layout and not per_layer[layer]:
                self._place_sglang_layout(page_pool, layer)
            else:
                for expert in self.ranking.order(layer):
                    if (layer, expert) in out:
                        continue
                    pages = page_pool.alloc_expert_pages(3, expert_owners(layer, expert))
                    if pages is None:  # cannot happen after the check above
                        raise NotEnoughPagesError(f"pool ran out placing layer {layer} expert {expert}")
                    self._put(layer, expert, pages, "place")
            self._version[layer] += 1
            self._changes += 1
        self._placed = True

    def _place_sglang_layout(self, page_pool: UnifiedPagePool, layer: int) -> None:
        """Every expert of ``layer`` in one allocation of 3E pages: W1, W3 of expert e on
        its pages 2e, 2e + 1, W2 on 2E + e (``place_all_but``'s ``sglang_layout``)."""
        e_count = self.shape.num_experts
        owners = [expert_owners(layer, e) for e in range(e_count)]  # (W1, W3, W2) keys each
        ids = page_pool.alloc_expert_pages(3 * e_count, [k for o in owners for k in o[:2]] + [o[2] for o in owners])
        if ids is None:  # cannot happen after place_all_but's check
            raise NotEnoughPagesError(f"pool ran out placing layer {layer}")
        for e in range(e_count):
            self._put(layer, e, (ids[2 * e], ids[2 * e + 1], ids[2 * e_count + e]), "place")

    # ================================================================ queries

    def sglang_layout_base(self, layer: int) -> int | None:
        """Page b when ``layer`` holds every expert in SGLang's layout (``place_all_but``'s
        ``sglang_layout``): W1, W3 of expert e on pages b + 2e, b + 2e + 1 and W2 on
        b + 2E + e. Else None (an expert out, or pages elsewhere)."""
        pages = self._layer(layer)
        e_count = self.shape.num_experts
        if len(pages) != e_count:
            return None
        b = pages[0][0]
        if all(pages[e] == (b + 2 * e, b + 2 * e + 1, b + 2 * e_count + e) for e in range(e_count)):
            return b
        return None

    def pages(self, layer: int, expert: int) -> tuple[int, int, int] | None:
        """``(W1 page, W3 page, W2 page)`` of a resident expert, else ``None``."""
        self.shape.check_expert(expert)
        return self._layer(layer).get(expert)

    def is_resident(self, layer: int, expert: int) -> bool:
        return expert in self._layer(layer)

    def resident(self, layer: int) -> list[int]:
        """Resident experts of ``layer``, ranking order."""
        res = self._layer(layer)
        return [e for e in self.ranking.order(layer) if e in res]

    def offloaded(self, layer: int) -> list[int]:
        """Experts of ``layer`` not resident, ranking order."""
        res = self._layer(layer)
        return [e for e in self.ranking.order(layer) if e not in res]

    def num_resident(self, layer: int | None = None) -> int:
        """Resident experts of ``layer``, or of all layers when ``layer`` is None."""
        if layer is not None:
            return len(self._layer(layer))
        return sum(len(p) for p in self._pages.values())

    def all_resident(self) -> bool:
        """Every expert of every MoE layer is in the pool."""
        return self.num_resident() == self.shape.num_layers * self.shape.num_experts

    def num_offloaded(self, layer: int) -> int:
        return self.shape.num_experts - len(self._layer(layer))

    @property
    def changes(self) -> int:
        """Changes to any layer's resident set so far (grows with every one)."""
        return self._changes

    def version(self, layer: int) -> int:
        """Bumped on every change of ``layer``'s resident set."""
        self._layer(layer)
        return self._version[layer]

    def resident_pages(self, layer: int) -> dict[int, tuple[int, int, int]]:
        """A copy of ``{expert: pages}`` for ``layer``."""
        return dict(self._layer(layer))

    def holder(self, page: int) -> tuple[int, int] | None:
        """``(layer, expert)`` of the resident expert on expert page ``page``, else ``None``."""
        return self._holder.get(page)

    # ================================================================ mutations

    def evict(self, layer: int, expert: int) -> tuple[int, int, int]:
        """Mark ``expert`` offloaded and return its pages, NOT freed.

        The pool's owner frees them (``page_pool.free_expert_pages``) only after
        the forward pass that may still read them is over: in elastic mode when
        the worker acknowledged the order (``Adjuster.complete``).
        """
        self.shape.check_expert(expert)
        res = self._layer(layer)
        if expert not in res:
            raise ValueError(f"evict: layer {layer} expert {expert} is not resident")
        if self.num_offloaded(layer) >= self.offload_limit:
            raise ValueError(
                f"evict: layer {layer} already has {self.num_offloaded(layer)} experts offloaded "
                f"(--rimuru-expert-offload-limit={self.offload_limit})")
        pages = res.pop(expert)
        for p in pages:
            del self._holder[p]
        self._version[layer] += 1
        self._changes += 1
        return pages

    def admit(self, layer: int, expert: int, pages: Sequence[int]) -> None:
        """Mark ``expert`` resident on ``pages`` (W1, W3, W2): pages its pool owner
        allocated for it (``expert_owners(layer, expert)``) and that already hold
        its weights.  Refused (``ValueError``, nothing changed) when the expert is
        resident or a page holds another resident expert."""
        self.shape.check_expert(expert)
        res = self._layer(layer)
        if expert in res:
            raise ValueError(f"admit: layer {layer} expert {expert} is already resident "
                             f"on pages {res[expert]}")
        self._put(layer, expert, pages, "admit")
        self._version[layer] += 1
        self._changes += 1

    # ================================================================ internals

    def _put(self, layer: int, expert: int, pages: Sequence[int], what: str) -> None:
        """Record ``expert`` of ``layer`` on ``pages``, checked first (nothing changes on an error)."""
        self._layer(layer)
        self.shape.check_expert(expert)
        pages = tuple(int(p) for p in pages)
        if len(pages) != 3 or len(set(pages)) != 3 or min(pages) < 0:
            raise ValueError(f"{what}: layer {layer} expert {expert} needs 3 distinct expert pages "
                             f"(W1, W3, W2), got {pages}")
        if expert in self._pages[layer]:
            raise ValueError(f"{what}: layer {layer} expert {expert} is placed twice")
        for p in pages:
            if p in self._holder:
                l2, e2 = self._holder[p]
                raise ValueError(f"{what}: page {p} of layer {layer} expert {expert} holds layer "
                                 f"{l2} expert {e2}")
        self._pages[layer][expert] = pages  # type: ignore[assignment]
        for p in pages:
            self._holder[p] = (layer, expert)

    def _layer(self, layer: int) -> dict[int, tuple[int, int, int]]:
        try:
            return self._pages[layer]
        except (KeyError, TypeError):
            raise ValueError(f"layer {layer!r} is not a MoE layer of this model "
                             f"(MoE layers: {self.shape.layer_ids})") from None

    def __repr__(self) -> str:
        per = {l: len(p) for l, p in self._pages.items()}
        return f"ExpertResidency(resident per layer={per}, offload_limit={self.offload_limit})"
