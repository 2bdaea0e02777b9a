"""Worker-side expert residency: which experts live on which pool pages, the load
buffers, host copies, per-layer page tables and the per-forward copy protocol.

Imports torch, the standard library and ``sglang_rimuru.pool`` only (and
``rimuru_kernels`` lazily inside ``ExpertManager.compute_cuda``); never sglang.
See README.md.
"""

from .copy_runs import page_runs
from .host_store import HostExpertStore
from .in_place import reads_in_place, replay_max_probability
from .load_buffers import NUM_LOAD_BUFFERS, LoadBuffers, load_buffer_page_owner
from .manager import BufferContent, ExpertManager, ExpertNotPreparedError, ExpertStats, KernelHooks
from .ranking import FORMAT, VERSION, ExpertRanking, RankingError, load_ranking, save_ranking
from .residency import ExpertResidency, expert_owners
from .shapes import MATRIX_NAMES, MoEShape, NotEnoughPagesError

__all__ = [
    "FORMAT",
    "MATRIX_NAMES",
    "NUM_LOAD_BUFFERS",
    "VERSION",
    "BufferContent",
    "ExpertManager",
    "ExpertNotPreparedError",
    "ExpertRanking",
    "ExpertResidency",
    "ExpertStats",
    "HostExpertStore",
    "KernelHooks",
    "LoadBuffers",
    "MoEShape",
    "NotEnoughPagesError",
    "RankingError",
    "expert_owners",
    "load_buffer_page_owner",
    "load_ranking",
    "page_runs",
    "reads_in_place",
    "replay_max_probability",
    "save_ranking",
]
