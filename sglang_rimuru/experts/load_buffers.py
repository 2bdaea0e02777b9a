"""``LoadBuffers``: the two alternating load buffers of DESIGN §4, as pool pages.

Layer at position ``p`` of ``shape.layer_ids`` uses buffer ``p % 2``, so layer
p+1's experts can be copied into one buffer while layer p computes from the
other.  Each buffer has ``slots`` slots of three expert pages (W1, W3, W2)::

    buffer b, slot s, matrix m  ->  one expert page owned by ("load_buffer", b, s, m)

``slots`` is the offload limit by default: a layer never has more offloaded
experts than that, so every offloaded expert a step needs fits at once (fewer
slots: the rest are read in place, ``ExpertManager._fit_misses``).  The pages are
ordinary pool pages, so the paged MoE kernel reads a loaded expert exactly as
it reads a resident one.

A ``LoadBuffers`` is page ids only (immutable; no pool kept): the pool's owner
(the scheduler side) takes the pages once at start, and the TP worker's
``ExpertManager`` gets its own copy built from the ids (``of_pages``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from sglang_rimuru.pool import UnifiedPagePool

from .shapes import MoEShape, NotEnoughPagesError

__all__ = ["NUM_LOAD_BUFFERS", "LoadBuffers", "load_buffer_page_owner"]

NUM_LOAD_BUFFERS = 2


def load_buffer_page_owner(buffer: int, slot: int, m: int) -> Hashable:
    """Pool owner tag of matrix ``m`` (0 W1, 1 W3, 2 W2) of one load-buffer slot."""
    return ("load_buffer", buffer, slot, m)


class LoadBuffers:
    """``2 * slots * 3`` expert pages, taken from ``page_pool`` at construction.

    Allocation order (one all-or-nothing call, so page ids are predictable):
    buffer 0 slot 0 W1, W3, W2, buffer 0 slot 1 ..., then buffer 1.  The pool
    is not kept: the pages stay owned by the load buffers for the server's life.
    """

    def __init__(self, shape: MoEShape, page_pool: UnifiedPagePool, slots: int) -> None:
        _check_slots(shape, slots)
        if page_pool.geometry.expert_page_bytes < shape.expert_page_bytes:
            raise ValueError(f"the pool's expert page ({page_pool.geometry.expert_page_bytes} B) is "
                             f"smaller than one expert matrix ({shape.expert_page_bytes} B)")
        owners = [load_buffer_page_owner(b, s, m)
                  for b in range(NUM_LOAD_BUFFERS) for s in range(slots) for m in range(3)]
        pages = page_pool.alloc_expert_pages(len(owners), owners)
        if pages is None:
            free = page_pool.free_expert_page_count()
            raise NotEnoughPagesError(
                f"the two expert load buffers ({slots} slots each: --rimuru-load-buffer-slots, by "
                f"default --rimuru-expert-offload-limit) need {len(owners)} expert pages "
                f"({len(owners) * page_pool.geometry.expert_page_bytes} B), the pool has {free} free")
        self._set(shape, slots, pages)

    @classmethod
    def of_pages(cls, shape: MoEShape, slots: int, pages: Sequence[int]) -> "LoadBuffers":
        """The load buffers on ``pages`` (``all_pages()`` of buffers taken elsewhere), no pool."""
        _check_slots(shape, slots)
        if len(pages) != NUM_LOAD_BUFFERS * slots * 3 or len(set(pages)) != len(pages):
            raise ValueError(f"load buffers of {slots} slots need {NUM_LOAD_BUFFERS * slots * 3} "
                             f"distinct pages, got {list(pages)}")
        out = cls.__new__(cls)
        out._set(shape, slots, [int(p) for p in pages])
        return out

    def _set(self, shape: MoEShape, slots: int, pages: Sequence[int]) -> None:
        self.shape = shape
        self.slots = slots
        it = iter(pages)
        self._pages: tuple[tuple[tuple[int, int, int], ...], ...] = tuple(
            tuple((next(it), next(it), next(it)) for _ in range(slots)) for _ in range(NUM_LOAD_BUFFERS)
        )

    @property
    def num_buffers(self) -> int:
        return NUM_LOAD_BUFFERS

    def buffer_of_position(self, position: int) -> int:
        """The buffer of the MoE layer at ``position`` in ``shape.layer_ids``."""
        return position % NUM_LOAD_BUFFERS

    def buffer_of_layer(self, layer_id: int) -> int:
        return self.buffer_of_position(self.shape.position(layer_id))

    def pages(self, buffer: int, slot: int) -> tuple[int, int, int]:
        """``(W1 page, W3 page, W2 page)`` of one slot."""
        if buffer not in range(NUM_LOAD_BUFFERS) or slot not in range(self.slots):
            raise ValueError(f"load buffer ({buffer}, {slot}) out of range "
                             f"({NUM_LOAD_BUFFERS} buffers x {self.slots} slots)")
        return self._pages[buffer][slot]

    def all_pages(self) -> list[int]:
        """Every page, in allocation order."""
        return [p for buf in self._pages for slot in buf for p in slot]

    def __repr__(self) -> str:
        return f"LoadBuffers(buffers={NUM_LOAD_BUFFERS}, slots={self.slots})"


def _check_slots(shape: MoEShape, slots: int) -> None:
    if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= shape.num_experts:
        raise ValueError(f"load buffer slots must be in [0, {shape.num_experts}], got {slots!r}")
