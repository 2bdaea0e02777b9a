"""``MoEShape``: the MoE dimensions of one model on one TP rank.

Every other module of this package takes a ``MoEShape`` and never re-derives a
size on its own.  One expert is three matrices of the same element count::

    W1 (gate)  [inter, hidden]   page slot 0
    W3 (up)    [inter, hidden]   page slot 1
    W2 (down)  [hidden, inter]   page slot 2

so one expert page size (``inter * hidden`` elements) fits all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MATRIX_NAMES", "MoEShape", "NotEnoughPagesError"]

#: Page slot m of an expert: 0 = W1 (gate), 1 = W3 (up), 2 = W2 (down).
MATRIX_NAMES: tuple[str, str, str] = ("w1", "w3", "w2")


class NotEnoughPagesError(RuntimeError):
    """The unified pool cannot hold the expert pages asked for."""


@dataclass(frozen=True)
class MoEShape:
    """MoE dimensions of one model, per TP rank.

    ``layer_ids``: the model's MoE layer ids in forward order (e.g. ``(0, 1)``;
    a model with dense layers in between lists only the MoE ones).
    ``inter``: the MoE intermediate size of one TP rank (``moe_intermediate_size / tp``).
    """

    layer_ids: tuple[int, ...]
    num_experts: int
    hidden: int
    inter: int
    top_k: int
    dtype: torch.dtype
    _positions: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not self.layer_ids:
            raise ValueError("MoEShape: layer_ids is empty")
        for lid in self.layer_ids:
            if isinstance(lid, bool) or not isinstance(lid, int) or lid < 0:
                raise ValueError(f"MoEShape: layer ids must be ints >= 0, got {lid!r}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"MoEShape: layer_ids repeat: {self.layer_ids}")
        for name in ("num_experts", "hidden", "inter", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEShape: {name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEShape: top_k={self.top_k} > num_experts={self.num_experts}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"MoEShape: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "_positions", {lid: i for i, lid in enumerate(self.layer_ids)})

    # ---- sizes -------------------------------------------------------------

    @property
    def matrix_elems(self) -> int:
        """Elements of one expert matrix: ``inter * hidden`` (W1, W3 and W2 alike)."""
        return self.inter * self.hidden

    @property
    def expert_page_bytes(self) -> int:
        """Bytes of one expert matrix, i.e. of one expert page."""
        return self.matrix_elems * self.dtype.itemsize

    @property
    def expert_bytes(self) -> int:
        """Bytes of one whole expert (three matrices)."""
        return 3 * self.expert_page_bytes

    def matrix_shape(self, m: int) -> tuple[int, int]:
        """``(inter, hidden)`` for W1/W3 (m = 0, 1), ``(hidden, inter)`` for W2 (m = 2)."""
        if m in (0, 1):
            return (self.inter, self.hidden)
        if m == 2:
            return (self.hidden, self.inter)
        raise ValueError(f"matrix index must be 0 (W1), 1 (W3) or 2 (W2), got {m!r}")

    # ---- layer order -------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def position(self, layer_id: int) -> int:
        """Index of ``layer_id`` in ``layer_ids``; ``ValueError`` if it is not a MoE layer."""
        pos = self._positions.get(layer_id)
        if pos is None:
            raise ValueError(
                f"layer {layer_id!r} is not a MoE layer of this model (MoE layers: {self.layer_ids})"
            )
        return pos

    def next_layer(self, layer_id: int) -> int | None:
        """The MoE layer after ``layer_id`` in forward order; ``None`` for the last."""
        pos = self.position(layer_id)
        return self.layer_ids[pos + 1] if pos + 1 < len(self.layer_ids) else None

    def check_layer(self, layer_id: int) -> None:
        self.position(layer_id)

    def check_expert(self, expert: int) -> None:
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert!r} out of range [0, {self.num_experts})")
