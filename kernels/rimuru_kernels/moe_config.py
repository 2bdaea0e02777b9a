"""Launch configs of the paged MoE kernel, kept as SGLang keeps its tuned MoE configs.

A config file ``E={E},N={I},device_name={name}.json`` (I: intermediate size per
TP shard; name: ``torch.cuda.get_device_name()`` with spaces as ``_``) maps a
token count to a config. The entry whose token count is nearest to the call's
wins. Looked up first in the folders of ``RIMURU_KERNELS_CONFIG_DIR``
(os.pathsep-separated), then in ``configs/`` beside this file; a shape with no
file gets ``configs/default.json``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG_FILE = "default.json"

# Small tiles for the Triton interpreter (CPU): it runs each program in numpy,
# so fewer, smaller programs are faster; 16 is tl.dot's smallest size.
INTERPRETER_CONFIG = {
    "BLOCK_SIZE_M": 16,
    "BLOCK_SIZE_N": 32,
    "BLOCK_SIZE_K": 32,
    "GROUP_SIZE_M": 1,
    "num_warps": 4,
    "num_stages": 1,
}


def config_file_name(num_experts: int, inter_size: int, device_name: str) -> str:
    return f"E={num_experts},N={inter_size},device_name={device_name}.json"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace(" ", "_")


def _search_dirs() -> list[Path]:
    extra = os.environ.get("RIMURU_KERNELS_CONFIG_DIR", "")
    return [Path(d) for d in extra.split(os.pathsep) if d] + [CONFIG_DIR]


@functools.lru_cache(maxsize=None)
def load_configs(num_experts: int, inter_size: int, device_name: str) -> dict[int, dict]:
    """{token count: config} for this shape and device, or the default table."""
    name = config_file_name(num_experts, inter_size, device_name)
    for d in _search_dirs():
        path = d / name
        if path.is_file():
            break
    else:
        path = CONFIG_DIR / DEFAULT_CONFIG_FILE
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def get_paged_moe_config(
    num_experts: int, inter_size: int, num_tokens: int, device: torch.device
) -> dict:
    """The launch config for ``num_tokens`` tokens (nearest tuned token count)."""
    if device.type == "cpu":
        return dict(INTERPRETER_CONFIG)
    configs = load_configs(num_experts, inter_size, device_name(device))
    return dict(configs[min(configs, key=lambda m: abs(m - num_tokens))])
