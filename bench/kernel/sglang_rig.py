"""SGLang 0.5.17's fused MoE outside a server, for the kernel bench and the tuner.

What a process needs before SGLang's fused MoE runs (:func:`setup`):

* a published ``ServerArgs``: SGLang reads its flags through ``runtime_context``;
* for the whole ``fused_experts_impl`` (what serving runs), a tensor-parallel
  group: its output is allocated under ``use_symmetric_memory(get_tp_group(),
  ...)``, and ``get_tp_group()`` asserts "tensor model parallel group is not
  initialized" without one. :func:`init_tp_group` makes SGLang's own groups
  with world size 1 (gloo over a file store in a temp dir: no port, no NCCL;
  nothing is ever communicated, a group of one skips every communicator).

SGLang's tuned configs: ``get_moe_configs`` reads
``$SGLANG_MOE_CONFIG_DIR/configs/triton_<version>/<get_config_file_name(...)>``
(default: its own folder), cached per shape. :func:`config_dir` points it at
another folder for a block (cache cleared on entry and exit), so SGLang's own
lookup (``try_get_optimal_moe_config``, also inside ``fused_experts_impl``)
reads a table the tuner wrote with :func:`write_tables`.

:class:`SGLangRig`: SGLang's two GEMMs (``invoke_fused_moe_kernel``, as
``fused_experts_impl`` calls them for unquantized weights without EP) as
separate calls on contiguous weights, with the interface of ``paged_rig.Rig``,
so ``tune_paged_moe.py --kernel sglang`` times them as it times ours.

On CPU (dry runs, Triton interpreter) SGLang's device name is None and its
align needs sgl_kernel: ``setup(cpu=True)`` names the device
:data:`CPU_DEVICE_NAME` and gives ``fused_moe`` the project's torch align
(same three outputs).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch

import paged_rig as rig

#: SGLang's device name in CPU dry runs (its own lookup returns None there)
CPU_DEVICE_NAME = "CPU_dry_run"
FUSED_MOE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
CONFIG = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"

_STATE: dict = {}


def write_model_config(d: str) -> str:
    """A config.json-only model dir: all ServerArgs needs (no weights, no tokenizer)."""
    from sglang_rimuru.models.specs import build_config, get_spec

    os.makedirs(d, exist_ok=True)
    build_config(get_spec("qwen3-30b-a3b")).to_json_file(os.path.join(d, "config.json"))
    return d


def setup(cpu: bool, tp_group: bool = True) -> dict:
    """Make this process ready for SGLang's fused MoE (idempotent); what was done, for the JSON
    (``tp_group_error`` when the TP group could not be made: then only the pieces can run)."""
    import importlib

    import sglang
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    if "published" not in _STATE:
        model = write_model_config(os.path.join(tempfile.mkdtemp(prefix="sglang_rig_"), "qwen3-moe-cfg"))
        kw = dict(model_path=model, device="cpu") if cpu else dict(model_path=model)
        try:
            sa = ServerArgs(**kw, attention_backend="triton", sampling_backend="pytorch",
                            disable_cuda_graph=True, grammar_backend="none")
        except Exception:
            sa = ServerArgs(**kw)
        runtime_context.publish(sa, role="test")
        _STATE["published"] = True
        _STATE["info"] = dict(version=getattr(sglang, "__version__", "?"), server_args="ServerArgs + publish")
    if cpu and "cpu" not in _STATE:
        from rimuru_kernels import moe_align_block_size

        def torch_align(topk_ids, block_size, num_experts, ignore_invalid_expert=False):
            a = moe_align_block_size(topk_ids, block_size, num_experts)
            return a.sorted_token_ids, a.expert_ids, a.num_tokens_post_padded

        importlib.import_module(CONFIG).get_device_name = lambda device_id=0: CPU_DEVICE_NAME
        importlib.import_module(FUSED_MOE).moe_align_block_size = torch_align
        _STATE["cpu"] = torch_align
        _STATE["info"]["cpu_stand_ins"] = (f"device name {CPU_DEVICE_NAME!r}; fused_moe.moe_align_block_size = "
                                           "rimuru_kernels' torch align (sgl_kernel has no CPU op)")
    if "quiet" not in _STATE:  # the bench switches config folders per call: say each lookup message once
        import logging

        seen: set = set()

        def once(record: logging.LogRecord) -> bool:
            msg = record.getMessage()
            return msg not in seen and not seen.add(msg)

        logging.getLogger(CONFIG).addFilter(once)
        _STATE["quiet"] = True
    if tp_group and "tp" not in _STATE:
        try:
            _STATE["tp"] = _STATE["info"]["tp_group"] = init_tp_group()
        except Exception as exc:  # the caller runs what needs no group (SGLang's pieces) and says why
            _STATE["tp"] = None
            _STATE["info"]["tp_group_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return dict(_STATE["info"])


def init_tp_group() -> str:
    """SGLang's model-parallel groups with world size 1, unless some already exist."""
    from sglang.srt.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return "already initialized"
    store = os.path.join(tempfile.mkdtemp(prefix="sglang_rig_dist_"), "store")
    ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{store}",
                                    local_rank=0, backend="gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    return f"world size {ps.get_tp_group().world_size} (gloo, file store)"


def configs_module():
    import importlib

    return importlib.import_module(CONFIG)


def versioned_dir(root: str | os.PathLike) -> Path:
    """Where ``get_moe_configs`` looks first under ``SGLANG_MOE_CONFIG_DIR=root``."""
    import triton

    return Path(root) / "configs" / f"triton_{triton.__version__.replace('.', '_')}"


def table_path(root: str | os.PathLike, E: int, N: int, dtype: torch.dtype, down: bool = False) -> Path:
    """The file SGLang reads for this shape under ``root`` (named by SGLang's own function)."""
    m = configs_module()
    return versioned_dir(root) / m.get_config_file_name(E, N, m.get_config_dtype_str(dtype=dtype), down_moe=down)


@contextlib.contextmanager
def device_name_as(name: str):
    """SGLang's config file names with another device's name (writing a device's tables elsewhere)."""
    m = configs_module()
    old = m.get_device_name
    m.get_device_name = lambda device_id=0: name
    try:
        yield
    finally:
        m.get_device_name = old


def write_tables(root: str | os.PathLike, E: int, N: int, dtype: torch.dtype, ups: dict[int, dict],
                 downs: dict[int, dict]) -> list[Path]:
    """SGLang's up and ``_down`` tables (token count -> config) where ``config_dir(root)`` finds them."""
    import json

    paths = []
    for table, down in ((ups, False), (downs, True)):
        path = table_path(root, E, N, dtype, down)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({str(T): table[T] for T in sorted(table)}, f, indent=4)
            f.write("\n")
        paths.append(path)
    return paths


@contextlib.contextmanager
def config_dir(root: str | os.PathLike | None):
    """SGLang's config lookup reads ``root`` (None: its own folder) inside the block."""
    if root is None:
        yield
        return
    m = configs_module()
    old = os.environ.get("SGLANG_MOE_CONFIG_DIR")
    os.environ["SGLANG_MOE_CONFIG_DIR"] = str(root)
    m.get_moe_configs.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SGLANG_MOE_CONFIG_DIR", None)
        else:
            os.environ["SGLANG_MOE_CONFIG_DIR"] = old
        m.get_moe_configs.cache_clear()


def resolve_configs(E: int, H: int, I: int, k: int, T: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(up, down) as ``fused_experts_impl`` resolves them for w13 [E, 2I, H], w2 [E, H, I]
    (TMA dropped: no shipped table for these shapes asks for it; down shares up's BLOCK_SIZE_M)."""
    m = configs_module()
    cfg, (down, _) = m.try_get_optimal_moe_config((E, 2 * I, H), (E, H, I), k, m.get_config_dtype_str(dtype=dtype),
                                                  T, return_down_config=True)
    cfg = dict(cfg)
    cfg.pop("USE_TMA", None)
    down = dict(down) if down else dict(cfg)
    down.pop("USE_TMA", None)
    down["BLOCK_SIZE_M"] = cfg["BLOCK_SIZE_M"]
    return cfg, down


def compute_type(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def sglang_align(ti: torch.Tensor, block_m: int, E: int):
    """SGLang's ``moe_align_block_size`` as ``fused_experts_impl`` calls it (the torch align on CPU)."""
    import importlib

    return importlib.import_module(FUSED_MOE).moe_align_block_size(ti, block_m, E)


def invoke(a, w, out, tw, ti, aligned, mul_routed_weight: bool, top_k: int, config: dict, router_topk: int = 1):
    """One ``invoke_fused_moe_kernel`` as ``_fused_moe_kernel_sequence`` makes it (unquantized, no EP)."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel

    sorted_ids, expert_ids, ntp = aligned
    invoke_fused_moe_kernel(a, w, None, out, None, None, None, tw, ti, sorted_ids, expert_ids, ntp,
                            mul_routed_weight, top_k, config, compute_type=compute_type(a.dtype),
                            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                            per_channel_quant=False, filter_expert=False, router_topk=router_topk)


class SGLangRig(rig.Rig):
    """One shape, SGLang's layout: contiguous ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``; the same
    input sets as ``paged_rig.Rig`` (inherited ``inputs``); its GEMMs as separate calls.

    ``align`` returns what both GEMMs need: (SGLang's three align outputs, topk_ids).
    The gate/up GEMM writes ``[T*k, 2I]`` (SGLang's SiLU*up is a separate kernel,
    not tuned here); the down GEMM passes ``router_topk=k`` as the full path does.
    """

    def __init__(self, name: str, E: int, k: int, H: int, I: int, device, dtype=torch.bfloat16, seed=0,
                 weights: bool = True):  # noqa: E741 - not Rig's pool: SGLang reads contiguous weights
        self.name, self.E, self.k, self.H, self.I = name, E, k, H, I
        self.device, self.dtype = device, dtype
        self._gen = torch.Generator(device="cpu").manual_seed(seed)
        if weights:
            gd = torch.Generator(device=device).manual_seed(seed)
            self.w13 = (torch.randn(E, 2 * I, H, generator=gd, device=device) / H**0.5).to(dtype)
            self.w2 = (torch.randn(E, H, I, generator=gd, device=device) / I**0.5).to(dtype)
        else:
            self.w13 = torch.empty(E, 2 * I, H, dtype=dtype, device=device)
            self.w2 = torch.empty(E, H, I, dtype=dtype, device=device)

    @property
    def up_width(self) -> int:
        """Columns the gate/up GEMM writes (gate and up; SiLU*up runs after it)."""
        return 2 * self.I

    def align(self, ti, bm, one_program=None):
        return sglang_align(ti, bm, self.E), ti

    def gemm_up(self, x, tw, aligned, out, cfg, fuse_silu=False):
        assert not fuse_silu, "SGLang's gate/up GEMM has no fused SiLU*up"
        al, ti = aligned
        invoke(x, self.w13, out, tw, ti, al, False, self.k, cfg)

    def gemm_down(self, act, tw, aligned, out, cfg):
        al, ti = aligned
        invoke(act, self.w2, out.view(-1, self.k, self.H), tw, ti, al, True, 1, cfg, router_topk=self.k)
