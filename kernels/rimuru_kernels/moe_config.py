"""Launch configs of the paged MoE kernel, kept as SGLang keeps its tuned MoE configs.

A config file ``E={E},N={I},device_name={name}.json`` (I: intermediate size per
TP shard; name: ``torch.cuda.get_device_name()`` with spaces as ``_``) maps a
token count to a config. The entry whose token count is nearest to the call's
wins. Looked up first in the folders of ``RIMURU_KERNELS_CONFIG_DIR``
(os.pathsep-separated), then in ``configs/`` beside this file; a shape with no
file gets ``configs/default.json``. As in SGLang, an optional
``..._down.json`` beside it holds the down GEMM's own configs (same token
keys, same BLOCK_SIZE_M: one token alignment serves both GEMMs); without it the
down GEMM takes the gate/up config.
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


def config_file_name(num_experts: int, inter_size: int, device_name: str, down: bool = False) -> str:
    return f"E={num_experts},N={inter_size},device_name={device_name}{'_down' if down else ''}.json"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace(" ", "_")


def _search_dirs() -> list[Path]:
    extra = os.environ.get("RIMURU_KERNELS_CONFIG_DIR", "")
    return [Path(d) for d in extra.split(os.pathsep) if d] + [CONFIG_DIR]


def _find(name: str) -> Path | None:
    for d in _search_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _read(path: Path) -> dict[int, dict]:
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def config_files(num_experts: int, inter_size: int, device_name: str) -> tuple[Path, Path | None]:
    """The files the lookup reads for this shape and device: (gate/up table, down table or None).

    The gate/up table is the shape's own file or ``configs/default.json``. The
    down table is only looked up beside a shape's own table, in the same folder:
    a down table tuned against another gate/up table could pair different
    BLOCK_SIZE_Ms.
    """
    up = _find(config_file_name(num_experts, inter_size, device_name))
    if up is None:
        return CONFIG_DIR / DEFAULT_CONFIG_FILE, None
    down = up.parent / config_file_name(num_experts, inter_size, device_name, down=True)
    return up, down if down.is_file() else None


@functools.lru_cache(maxsize=None)
def load_configs(num_experts: int, inter_size: int, device_name: str) -> dict[int, dict]:
    """{token count: config} for this shape and device, or the default table."""
    return _read(config_files(num_experts, inter_size, device_name)[0])


@functools.lru_cache(maxsize=None)
def load_down_configs(num_experts: int, inter_size: int, device_name: str) -> dict[int, dict] | None:
    """The down GEMM's own table, or None (it then takes the gate/up configs)."""
    down = config_files(num_experts, inter_size, device_name)[1]
    return None if down is None else _read(down)


def _nearest(configs: dict[int, dict], num_tokens: int) -> dict:
    return dict(configs[min(configs, key=lambda m: abs(m - num_tokens))])


def pipeline_shared_bytes(config: dict, fused: bool, elem_bytes: int = 2) -> int:
    """Shared memory one launch of ``config`` pipelines, as an upper estimate: ``num_stages``
    (Triton's default 3 where the config names none) copies of the A tile (BM x BK) and of
    the B tile (BK x BN), two B tiles where SiLU*up is fused (the gate and the up row of
    each column)."""
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    return config.get("num_stages", 3) * (bm * bk + (2 if fused else 1) * bk * bn) * elem_bytes


def table_fits(table: dict[int, dict], shared_bytes: int, fused: bool = True) -> bool:
    """Whether every entry of ``table`` pipelines within ``shared_bytes`` (a block's opt-in
    limit: 227 KiB on Hopper, 163 on A100, 99 on Ada and consumer Ampere). The kernel's
    ``default.json`` needs up to 136 KiB fused (BM 16, BN 128, BK 128, 2 stages): a GPU
    short of that would fail at its first launch of such a tile."""
    return all(pipeline_shared_bytes(c, fused) <= shared_bytes for c in table.values())


def tables_fit(num_experts: int, inter_size: int, device_name: str, shared_bytes: int) -> bool:
    """Whether the tables the fast kernel reads for this shape and device (``load_configs``
    fused gate/up, ``load_down_configs`` where there is one) fit ``shared_bytes``."""
    down = load_down_configs(num_experts, inter_size, device_name)
    return (table_fits(load_configs(num_experts, inter_size, device_name), shared_bytes)
            and (down is None or table_fits(down, shared_bytes, fused=False)))


def device_shared_bytes(device: torch.device) -> int:
    """The most shared memory one block may use on ``device`` (Triton's opt-in limit)."""
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def get_paged_moe_config(
    num_experts: int, inter_size: int, num_tokens: int, device: torch.device
) -> dict:
    """The launch config for ``num_tokens`` tokens (nearest tuned token count)."""
    if device.type == "cpu":
        return dict(INTERPRETER_CONFIG)
    return _nearest(load_configs(num_experts, inter_size, device_name(device)), num_tokens)


def get_paged_moe_down_config(
    num_experts: int, inter_size: int, num_tokens: int, device: torch.device
) -> dict | None:
    """The down GEMM's config for ``num_tokens`` tokens, or None: use the gate/up one."""
    if device.type == "cpu":
        return None
    table = load_down_configs(num_experts, inter_size, device_name(device))
    return None if table is None else _nearest(table, num_tokens)
