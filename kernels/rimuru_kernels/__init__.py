"""rimuru_kernels: the paged fused-MoE Triton kernel. Imports only torch and triton."""

from .align import AlignedTokens, moe_align_block_size, moe_align_block_size_triton
from .moe_config import get_paged_moe_config, load_configs
from .pages import (
    PagedWeights,
    contiguous_page_table,
    pack_contiguous_weights,
    pack_weights_into_pool,
)
from .paged_moe import ExpertNotResidentError, paged_fused_moe
from .reference import (
    expert_weights_from_pool,
    fused_moe_dense_reference,
    paged_fused_moe_reference,
)

__all__ = [
    "AlignedTokens",
    "ExpertNotResidentError",
    "PagedWeights",
    "contiguous_page_table",
    "expert_weights_from_pool",
    "fused_moe_dense_reference",
    "get_paged_moe_config",
    "load_configs",
    "moe_align_block_size",
    "moe_align_block_size_triton",
    "pack_contiguous_weights",
    "pack_weights_into_pool",
    "paged_fused_moe",
    "paged_fused_moe_reference",
]
