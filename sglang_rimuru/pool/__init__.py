"""The unified page pool: one GPU byte buffer shared by expert weights and the KV cache.

Imports torch and the standard library only; never sglang (see README.md).
"""

from .buffer import KVViews, PoolBuffer
from .geometry import PoolGeometry, expert_page_bytes_for, kv_page_bytes_for
from .owners import EXPERT_MATRICES, ExpertKey, load_buffer_owner
from .page_pool import UnifiedPagePool
from .stats import PoolStats

__all__ = [
    "EXPERT_MATRICES",
    "ExpertKey",
    "KVViews",
    "PoolBuffer",
    "PoolGeometry",
    "PoolStats",
    "UnifiedPagePool",
    "expert_page_bytes_for",
    "kv_page_bytes_for",
    "load_buffer_owner",
]
