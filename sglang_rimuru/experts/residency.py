"""``ExpertResidency``: which experts of each MoE layer sit on which three expert pages.

Bookkeeping only (no tensors).  State map, per MoE layer ``l``::

    _pages[l]   {expert: (p_w1, p_w3, p_w2)}   the resident experts; every page is
                owned in the pool by ExpertKey(l, expert, "w1" / "w3" / "w2")
    offloaded   every other expert of l;  len(offloaded) <= offload_limit, always
    _version[l] bumped on every change of l (the manager refreshes its table then)

The static mode keeps a prefix of each layer's ranking resident
(``place_initial``). The elastic mode starts with whatever set fits
(``place_all_but``: the adjuster's selection picks who is left out) and moves
experts in and out with ``evict`` / ``admit``; nothing here assumes the
resident set is a prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

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
        ``place_initial`` has run (``evict`` refuses to go past it);
      * ``resident``/``offloaded`` list experts in ranking order (hottest first);
      * pages are allocated by ``place_initial`` and, for ``admit``, by the
        caller; this class never frees a page: ``evict`` hands the pages back
        to the caller, who frees them once no forward pass can read them.
    """

    def __init__(self, shape: MoEShape, page_pool: UnifiedPagePool, ranking: ExpertRanking,
                 offload_limit: int) -> None:
        if isinstance(offload_limit, bool) or not isinstance(offload_limit, int) or not (
                0 <= offload_limit <= shape.num_experts):
            raise ValueError(f"--rimuru-expert-offload-limit must be in [0, {shape.num_experts}] "
                             f"(experts per layer), got {offload_limit!r}")
        page_bytes = page_pool.geometry.expert_page_bytes
        if page_bytes < shape.expert_page_bytes:
            raise ValueError(f"the pool's expert page ({page_bytes} B) is smaller than one expert "
                             f"matrix ({shape.expert_page_bytes} B)")
        ranking.check_fits(shape)
        self.shape = shape
        self.page_pool = page_pool
        self.ranking = ranking
        self.offload_limit = offload_limit
        self._pages: dict[int, dict[int, tuple[int, int, int]]] = {l: {} for l in shape.layer_ids}
        self._version: dict[int, int] = {l: 0 for l in shape.layer_ids}
        self._placed = False

    # ================================================================ placement

    def place_initial(self, resident_per_layer: int) -> None:
        """Allocate pages for the ``resident_per_layer`` hottest experts of every layer."""
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
        self.place_all_but([(l, x) for l in self.shape.layer_ids
                            for x in self.ranking.order(l)[resident_per_layer:]])

    def place_all_but(self, offloaded: Collection[tuple[int, int]]) -> None:
        """Allocate pages for every expert except ``offloaded`` (``(layer, expert)`` pairs).

        Layers in forward order, experts in ranking order, each expert's three
        pages in one all-or-nothing allocation. No layer may leave out more than
        ``offload_limit``. The whole need is checked against the pool first, so
        on ``NotEnoughPagesError`` nothing is allocated.
        """
        if self._placed:
            raise RuntimeError("place_initial already ran")
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
        free = self.page_pool.free_expert_page_count()
        if need > free:
            raise NotEnoughPagesError(
                f"keeping {need // 3} experts resident over {self.shape.num_layers} MoE layers needs "
                f"{need} expert pages ({need * self.page_pool.geometry.expert_page_bytes} B), the pool has "
                f"{free} free; lower --rimuru-resident-experts or give the pool more memory")
        for layer in self.shape.layer_ids:
            for expert in self.ranking.order(layer):
                if (layer, expert) in out:
                    continue
                pages = self.page_pool.alloc_expert_pages(3, expert_owners(layer, expert))
                if pages is None:  # cannot happen after the check above
                    raise NotEnoughPagesError(f"pool ran out placing layer {layer} expert {expert}")
                self._pages[layer][expert] = (pages[0], pages[1], pages[2])
            self._version[layer] += 1
        self._placed = True

    # ================================================================ queries

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

    def num_offloaded(self, layer: int) -> int:
        return self.shape.num_experts - len(self._layer(layer))

    def version(self, layer: int) -> int:
        """Bumped on every change of ``layer``'s resident set."""
        self._layer(layer)
        return self._version[layer]

    def resident_pages(self, layer: int) -> dict[int, tuple[int, int, int]]:
        """A copy of ``{expert: pages}`` for ``layer``."""
        return dict(self._layer(layer))

    # ================================================================ mutations

    def evict(self, layer: int, expert: int) -> tuple[int, int, int]:
        """Mark ``expert`` offloaded and return its pages, NOT freed.

        The caller frees them (``page_pool.free_expert_pages``) only after the
        forward pass that may still read them has finished.
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
        self._version[layer] += 1
        return pages

    def admit(self, layer: int, expert: int, pages: tuple[int, int, int]) -> None:
        """Mark ``expert`` resident on ``pages`` (W1, W3, W2), already allocated by the caller
        with owners ``expert_owners(layer, expert)`` and already holding its weights."""
        self.shape.check_expert(expert)
        res = self._layer(layer)
        if expert in res:
            raise ValueError(f"admit: layer {layer} expert {expert} is already resident "
                             f"on pages {res[expert]}")
        pages = tuple(int(p) for p in pages)
        if len(pages) != 3:
            raise ValueError(f"admit: need 3 pages (W1, W3, W2), got {pages}")
        owners = self.page_pool.expert_page_owners()
        for p, want in zip(pages, expert_owners(layer, expert)):
            if owners.get(p) != want:
                raise ValueError(f"admit: page {p} is owned by {owners.get(p)!r} in the pool, "
                                 f"expected {want!r}")
        res[expert] = pages  # type: ignore[assignment]
        self._version[layer] += 1

    # ================================================================ internals

    def _layer(self, layer: int) -> dict[int, tuple[int, int, int]]:
        try:
            return self._pages[layer]
        except (KeyError, TypeError):
            raise ValueError(f"layer {layer!r} is not a MoE layer of this model "
                             f"(MoE layers: {self.shape.layer_ids})") from None

    def __repr__(self) -> str:
        per = {l: len(p) for l, p in self._pages.items()}
        return f"ExpertResidency(resident per layer={per}, offload_limit={self.offload_limit})"
