"""A stand-in for the ``sgl_kernel`` package on a CPU without its CPU build.

SGLang 0.5.17 imports ``*_cpu`` ops from ``sgl_kernel`` at module import when
``SGLANG_USE_CPU_ENGINE=1``, but the PyPI ``sglang-kernel`` wheel is a CUDA
build that cannot even be imported without ``libcuda.so.1``. This module takes
its place in ``sys.modules`` (see :func:`install`). It implements the ops the
project's CPU path really calls, in torch, with the contract of the Triton
kernels SGLang uses on GPU; every other ``*_cpu`` name resolves to a function
that raises ``NotImplementedError`` naming the op, so an unexpected call fails
loudly instead of silently computing something else. Names that are not
``*_cpu`` do not exist here (``AttributeError``/``ImportError``), so SGLang's
CUDA-only imports fail exactly as they would on a CPU build.

Because ``torch.ops.sgl_kernel`` stays empty, SGLang's probes choose its torch
fallbacks: torch-native attention, pytorch sampling, ``moe_forward_native``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch

#: ops with a real implementation here, by name
IMPLEMENTED: dict[str, object] = {}


def _op(fn):
    IMPLEMENTED[fn.__name__] = fn
    return fn


@_op
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV locations into its ``req_to_token`` row.

    Request i takes ``end_offset[i] - start_offset[i]`` consecutive entries of
    ``out_cache_loc`` (after those of requests 0..i-1) into columns
    ``[start_offset[i], end_offset[i])`` of row ``req_pool_indices[i]``.
    """
    del pool_len  # implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    src = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[src : src + n].to(req_to_token.dtype)
        src += n


@_op
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy the KV rows ``src_loc`` to ``tgt_loc`` in every layer buffer.

    ``data_ptrs[i]`` is the address of buffer i and ``strides[i]`` its row size
    in bytes; the buffers are viewed as raw bytes through their addresses.
    """
    if tgt_loc.numel() == 0:
        return
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = max(int(tgt_loc.max()), int(src_loc.max())) + 1
        buf = _bytes_at(ptr, rows * stride).view(rows, stride)
        buf[tgt_loc.long()] = buf[src_loc.long()]


def _bytes_at(ptr: int, nbytes: int) -> torch.Tensor:
    import ctypes

    array = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(array, dtype=torch.uint8)


def _missing(name: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"{name} is not available: this CPU runs SGLang without the CPU "
            "build of sgl-kernel, and sglang-rimuru's stand-in has no implementation of "
            f"it (see patches/README.md). Called with {len(args)} args."
        )

    fail.__name__ = fail.__qualname__ = name.rsplit(".", 1)[-1]
    return fail


class _StandinModule(types.ModuleType):
    """Module whose ``*_cpu`` attributes exist (implemented or failing loudly)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in IMPLEMENTED:
            return IMPLEMENTED[name]
        if name.endswith("_cpu"):
            return _missing(f"{self.__name__}.{name}")
        raise AttributeError(f"module {self.__name__!r} (sglang-rimuru CPU stand-in) has no attribute {name!r}")


#: submodules SGLang imports ``*_cpu`` ops from on CPU paths; any other
#: ``sgl_kernel.<sub>`` import fails with ModuleNotFoundError, so SGLang's
#: ``try: from sgl_kernel.x import ...`` probes take their no-kernel branch.
SUBMODULES = ("mamba",)


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel`` and its known submodules as stand-in modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.removeprefix("sgl_kernel.") in SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []  # a package, so submodule imports come back here
        module.__doc__ = __doc__
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Make ``import sgl_kernel`` (and submodules) resolve to the stand-in.

    Must run before the first ``import sglang`` in the process. Idempotent.
    """
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _StandinFinder())
