"""Byte geometry of the unified page pool: page sizes, counts and id maps.

Pure arithmetic, no state, no torch.  Every other module of the pool takes a
``PoolGeometry`` and never recomputes an offset on its own.

Byte map of the pool buffer (``pool_bytes = num_huge_pages * huge_page_bytes``)::

    [h*H, (h+1)*H)   huge page h          H = lcm(E, S), or E without SSM
    [j*E, (j+1)*E)   expert page j        E = expert_page_bytes (middle level)
    [s*S, (s+1)*S)   SSM page s           S = ssm_page_bytes    (middle level)
    [k*K, (k+1)*K)   KV page id k         K = kv_page_bytes     (small level)

KV page ids are global byte-offset ids, so one strided tensor over the whole
buffer indexes every KV page by its id (SGLang's attention kernels need one
uniform token stride).  Expert page j *owns* the KV ids whose bytes lie wholly
inside it::

    kv_pages_of_expert_page(j) == range(ceil(j*E/K), floor((j+1)*E/K))

A KV id that straddles an expert-page boundary belongs to no expert page and is
never handed out (a *hole*).  When K does not divide E the number of KV pages
per expert page therefore alternates between ``floor(E/K)`` and
``floor(E/K) - 1``; the pattern repeats every ``K / gcd(E, K)`` expert pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["PoolGeometry", "expert_page_bytes_for", "kv_page_bytes_for"]


def expert_page_bytes_for(hidden_size: int, intermediate_size: int, elem_bytes: int) -> int:
    """Bytes of one expert matrix (W1, W3 or W2) of one TP shard: ``d * f * elem``."""
    return hidden_size * intermediate_size * elem_bytes


def kv_page_bytes_for(
    num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: int, page_size: int
) -> int:
    """Bytes of one KV page: ``page_size`` token slots of K and V for every layer.

    Matches ``PoolBuffer.kv_views``: a token slot is all layers' K then V,
    contiguous, ``num_layers * 2 * num_kv_heads * head_dim * elem_bytes`` bytes.
    """
    return page_size * num_layers * 2 * num_kv_heads * head_dim * elem_bytes


@dataclass(frozen=True)
class PoolGeometry:
    """Page sizes of one pool and everything derived from them.

    Contract:
      * all sizes are positive byte counts; ``kv_page_bytes <= expert_page_bytes``;
      * every expert page holds at least one whole KV page (guaranteed by
        requiring ``K | E`` or ``2*K <= E``);
      * ``total_bytes`` is the memory offered; only whole huge pages are used,
        the rest (``tail_bytes``) is reported and never touched.
    """

    total_bytes: int
    expert_page_bytes: int
    kv_page_bytes: int
    ssm_page_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("total_bytes", "expert_page_bytes", "kv_page_bytes"):
            _check_positive_int(name, getattr(self, name))
        if self.ssm_page_bytes is not None:
            _check_positive_int("ssm_page_bytes", self.ssm_page_bytes)
        e, k = self.expert_page_bytes, self.kv_page_bytes
        if k > e:
            raise ValueError(
                f"kv_page_bytes={k} is larger than expert_page_bytes={e}; "
                "a KV page must fit inside an expert page (lower the KV page_size)"
            )
        if e % k != 0 and 2 * k > e:
            raise ValueError(
                f"kv_page_bytes={k} neither divides expert_page_bytes={e} nor is at most "
                "half of it, so some expert pages would hold no whole KV page"
            )
        if self.total_bytes < self.huge_page_bytes:
            raise ValueError(
                f"total_bytes={self.total_bytes} is smaller than one huge page "
                f"(huge_page_bytes={self.huge_page_bytes})"
            )

    # ---- levels -----------------------------------------------------------

    @property
    def huge_page_bytes(self) -> int:
        """``lcm(expert_page_bytes, ssm_page_bytes)``, or ``expert_page_bytes``."""
        if self.ssm_page_bytes is None:
            return self.expert_page_bytes
        return math.lcm(self.expert_page_bytes, self.ssm_page_bytes)

    @property
    def num_huge_pages(self) -> int:
        return self.total_bytes // self.huge_page_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes actually used: ``num_huge_pages * huge_page_bytes`` (the buffer size)."""
        return self.num_huge_pages * self.huge_page_bytes

    @property
    def tail_bytes(self) -> int:
        """Bytes of ``total_bytes`` below one huge page, left unused."""
        return self.total_bytes - self.pool_bytes

    @property
    def expert_pages_per_huge_page(self) -> int:
        return self.huge_page_bytes // self.expert_page_bytes

    @property
    def num_expert_pages(self) -> int:
        return self.num_huge_pages * self.expert_pages_per_huge_page

    @property
    def has_ssm(self) -> bool:
        return self.ssm_page_bytes is not None

    @property
    def ssm_pages_per_huge_page(self) -> int:
        """0 for non-hybrid models."""
        if self.ssm_page_bytes is None:
            return 0
        return self.huge_page_bytes // self.ssm_page_bytes

    @property
    def num_ssm_pages(self) -> int:
        """Size of the global SSM id space (every huge page split into SSM pages)."""
        return self.num_huge_pages * self.ssm_pages_per_huge_page

    # ---- KV id space --------------------------------------------------------

    @property
    def num_kv_page_ids(self) -> int:
        """Size of the global KV id space: ``pool_bytes // kv_page_bytes``.

        Ids in ``range(num_kv_page_ids)`` cover the buffer, so a strided view of
        ``num_kv_page_ids`` pages never reads past it.  Holes are inside this
        range but are never allocated.
        """
        return self.pool_bytes // self.kv_page_bytes

    @property
    def kv_period(self) -> int:
        """Expert pages after which the KV/expert alignment repeats: ``K / gcd(E, K)``."""
        return self.kv_page_bytes // math.gcd(self.expert_page_bytes, self.kv_page_bytes)

    @property
    def max_kv_pages_per_expert_page(self) -> int:
        return self.expert_page_bytes // self.kv_page_bytes

    @property
    def min_kv_pages_per_expert_page(self) -> int:
        """Fewest KV pages any expert page holds (``floor(E/K) - 1`` unless ``K | E``)."""
        lo = self.max_kv_pages_per_expert_page
        if self.kv_period == 1:
            return lo
        return lo - 1

    @property
    def num_usable_kv_pages(self) -> int:
        """KV pages the pool could hold if every expert page were split (ids minus holes).

        Closed form of ``sum(len(kv_pages_of_expert_page(j)))``: the ids below
        ``num_expert_pages * E / K`` minus one hole per inner expert-page boundary
        that is not KV-aligned.
        """
        m = self.num_expert_pages
        aligned_inner = (m - 1) // self.kv_period
        holes = (m - 1) - aligned_inner
        return (m * self.expert_page_bytes) // self.kv_page_bytes - holes

    @property
    def num_kv_holes(self) -> int:
        return self.num_kv_page_ids - self.num_usable_kv_pages

    def kv_pages_of_expert_page(self, j: int) -> range:
        """KV ids wholly inside expert page ``j``."""
        self._check_index("expert page", j, self.num_expert_pages)
        e, k = self.expert_page_bytes, self.kv_page_bytes
        return range(-(-j * e // k), (j + 1) * e // k)

    def expert_page_of_kv_page(self, k: int) -> int | None:
        """The expert page that owns KV id ``k``; ``None`` for a hole."""
        self._check_index("KV page id", k, self.num_kv_page_ids)
        kb = self.kv_page_bytes
        j = k * kb // self.expert_page_bytes
        if (k + 1) * kb <= (j + 1) * self.expert_page_bytes:
            return j
        return None

    def waste_bytes_of_expert_page(self, j: int) -> int:
        """Bytes of expert page ``j`` not covered by its whole KV pages (head + tail)."""
        return self.expert_page_bytes - len(self.kv_pages_of_expert_page(j)) * self.kv_page_bytes

    @property
    def waste_bytes_per_expert_page(self) -> Fraction:
        """Mean KV waste per expert page over one alignment period: ``K*(P-1)/P``.

        Exact (a ``Fraction``); 0 when K divides E.
        """
        p = self.kv_period
        return Fraction(self.kv_page_bytes * (p - 1), p)

    # ---- SSM id space ---------------------------------------------------------

    def ssm_pages_of_huge_page(self, h: int) -> range:
        self._check_index("huge page", h, self.num_huge_pages)
        n = self.ssm_pages_per_huge_page
        return range(h * n, (h + 1) * n)

    def expert_pages_of_huge_page(self, h: int) -> range:
        self._check_index("huge page", h, self.num_huge_pages)
        n = self.expert_pages_per_huge_page
        return range(h * n, (h + 1) * n)

    def huge_page_of_expert_page(self, j: int) -> int:
        self._check_index("expert page", j, self.num_expert_pages)
        return j // self.expert_pages_per_huge_page

    def huge_page_of_ssm_page(self, s: int) -> int:
        self._check_index("SSM page", s, self.num_ssm_pages)
        return s // self.ssm_pages_per_huge_page

    @staticmethod
    def _check_index(what: str, i: int, n: int) -> None:
        if not 0 <= i < n:
            raise ValueError(f"{what} {i} out of range [0, {n})")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
