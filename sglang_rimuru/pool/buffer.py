"""``PoolBuffer``: the one contiguous byte buffer of the pool and its typed views.

Every view aliases the same ``torch.uint8`` storage (``Tensor.view(dtype)`` /
``torch.as_strided``); nothing here copies.  Which bytes a page covers comes
from ``PoolGeometry``; who owns them comes from ``UnifiedPagePool``.

Byte layout of the KV view (token-major; slot ``t`` of KV page ``k`` is token
``k * page_size + t``)::

    token T at bytes [T*token_bytes, (T+1)*token_bytes):
        K[layer 0] V[layer 0] K[layer 1] V[layer 1] ... K[L-1] V[L-1]
        each [num_kv_heads, head_dim] contiguous

    token_bytes   = num_layers * 2 * num_kv_heads * head_dim * elem
    kv_page_bytes = page_size * token_bytes          (must equal the geometry's)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .geometry import PoolGeometry

__all__ = ["KVViews", "PoolBuffer"]


class KVViews(NamedTuple):
    """Per-layer K and V tensors, each ``[num_kv_page_ids * page_size, heads, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    token_bytes: int


class PoolBuffer:
    """One ``uint8`` tensor of ``geometry.pool_bytes`` bytes on ``device``.

    Contract: every view returned shares storage with ``self.data``; a write
    through any view is visible through every other view of the same bytes.
    Views check bounds and alignment (the byte offset of a view must be a
    multiple of the element size) and raise ``ValueError`` otherwise.
    """

    def __init__(
        self, geometry: PoolGeometry, device: torch.device | str = "cpu", *, zero: bool = False
    ) -> None:
        self.geometry = geometry
        alloc = torch.zeros if zero else torch.empty
        self.data: torch.Tensor = alloc(geometry.pool_bytes, dtype=torch.uint8, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    # ---- expert pages ---------------------------------------------------------

    def expert_page_elems(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per expert page (the kernel's ``page_id * page_elems``)."""
        return self._elems("expert_page_bytes", self.geometry.expert_page_bytes, dtype)

    def expert_page_view(
        self, page_id: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A contiguous ``shape`` tensor at byte ``page_id * expert_page_bytes``.

        ``shape`` may be smaller than the page (the rest of the page is unused).
        """
        self.geometry._check_index("expert page", page_id, self.geometry.num_expert_pages)
        return self._page_view(page_id * self.geometry.expert_page_bytes,
                               self.geometry.expert_page_bytes, shape, dtype)

    def expert_pages_flat(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a 1-D ``dtype`` tensor; expert page j starts at
        element ``j * expert_page_elems(dtype)``."""
        self.expert_page_elems(dtype)  # alignment check
        return self.data.view(dtype)

    # ---- KV pages -------------------------------------------------------------

    def kv_views(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page_size_tokens: int,
    ) -> KVViews:
        """Per-layer K and V views indexed by global token slot (``kv_id * page_size + t``).

        Each tensor is ``[num_kv_page_ids * page_size, num_kv_heads, head_dim]``
        with strides ``(token_elems, head_dim, 1)``: heads and dims are
        contiguous within one token, tokens are ``token_bytes`` apart.  Slots of
        hole KV ids exist in the view but belong to expert pages' bytes; never
        write them.
        """
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size_tokens", page_size_tokens)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        elem = _itemsize(dtype)
        slot_elems = num_kv_heads * head_dim
        token_elems = num_layers * 2 * slot_elems
        token_bytes = token_elems * elem
        if page_size_tokens * token_bytes != self.geometry.kv_page_bytes:
            raise ValueError(
                f"page_size_tokens*token_bytes = {page_size_tokens}*{token_bytes} != "
                f"geometry kv_page_bytes={self.geometry.kv_page_bytes}"
            )
        g = self.geometry
        flat = self.data[: g.num_kv_page_ids * g.kv_page_bytes].view(dtype)  # starts at byte 0
        num_tokens = g.num_kv_page_ids * page_size_tokens
        size, stride = (num_tokens, num_kv_heads, head_dim), (token_elems, head_dim, 1)
        ks = [torch.as_strided(flat, size, stride, (2 * layer) * slot_elems)
              for layer in range(num_layers)]
        vs = [torch.as_strided(flat, size, stride, (2 * layer + 1) * slot_elems)
              for layer in range(num_layers)]
        return KVViews(ks, vs, page_size_tokens, token_bytes)

    # ---- SSM pages (hybrid models) --------------------------------------------

    def ssm_page_view(
        self, page_id: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A contiguous ``shape`` tensor at byte ``page_id * ssm_page_bytes``."""
        g = self.geometry
        if g.ssm_page_bytes is None:
            raise ValueError("ssm_page_view on a geometry without ssm_page_bytes")
        g._check_index("SSM page", page_id, g.num_ssm_pages)
        return self._page_view(page_id * g.ssm_page_bytes, g.ssm_page_bytes, shape, dtype)

    # Conv-state views go here: conv pages are small pages carved from expert
    # pages like KV pages (global byte-offset ids, holes at expert-page
    # boundaries), so the view will be ``torch.as_strided`` over ``self.data``
    # with a per-page stride of ``conv_page_bytes``, exactly like ``kv_views``.
    # Not built until the geometry gains ``conv_page_bytes``.

    # ---- helpers ----------------------------------------------------------------

    def _page_view(
        self, offset: int, page_bytes: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        elem = _itemsize(dtype)
        numel = 1
        for d in shape:
            numel *= d
        if numel * elem > page_bytes:
            raise ValueError(f"shape {tuple(shape)} of {dtype} needs {numel * elem} B, "
                             f"page has {page_bytes} B")
        if offset % elem:
            raise ValueError(f"byte offset {offset} is not aligned to {dtype} ({elem} B)")
        return self.data[offset: offset + numel * elem].view(dtype).view(shape)

    @staticmethod
    def _elems(name: str, nbytes: int, dtype: torch.dtype) -> int:
        elem = _itemsize(dtype)
        if nbytes % elem:
            raise ValueError(f"{name}={nbytes} is not a multiple of the {dtype} size ({elem} B)")
        return nbytes // elem


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
