"""``HostExpertStore``: every expert's weights in host memory, the source of every copy.

One tensor per MoE layer::

    layer tensor  [E, 3, matrix_elems]  shape.dtype, pinned when asked and CUDA exists
        [e, 0]  W1 (gate) of expert e, [inter, hidden] row-major
        [e, 1]  W3 (up),                [inter, hidden] row-major
        [e, 2]  W2 (down),              [hidden, inter] row-major

Each ``[e, m]`` row is exactly what one expert page holds (its first
``matrix_elems`` elements), so a host->device copy is one flat ``copy_`` per page,
or one per run of consecutive pages (``matrices``) when pages hold no padding.
"""

from __future__ import annotations

import math
import os

import torch

from .shapes import MoEShape

__all__ = ["HostExpertStore", "aligned_empty", "hugepage_empty", "pin_in_place", "pin_kind", "pinnable_empty", "pinned_empty", "PIN_ENV"]

#: ``SGLANG_RIMURU_HOST_PIN=torch``: page-lock with torch's pinned allocator instead;
#: ``=hugepage``: the default's 2 MiB-aligned memory, advised to use transparent huge pages
PIN_ENV = "SGLANG_RIMURU_HOST_PIN"
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
#: registered host tensors live as long as the process (unregistering memory that
#: views may still reach would make their copies synchronous, or fail)
_REGISTERED: list[torch.Tensor] = []


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly ``shape``, uninitialised.

    torch's pinned allocator (``pin_memory=True``) rounds every allocation up
    to a power of two and pins all of it (``CachingHostAllocator``): one
    Qwen1.5-MoE-A2.7B layer's experts, 1.04 GB, pinned 2 GiB, 48 GiB of host
    RAM for a 25 GB model. So this takes ordinary host memory (2 MiB-aligned:
    ``aligned_empty`` says why) and page-locks it in place with ``cudaHostRegister`` (portable, mapped: with unified
    addressing the GPU reads it at its host address, which the paged kernel's
    host pages rely on), as SGLang's own HiCache host pool does. The memory
    stays registered for the life of the process.
    """
    return pin_in_place(pinnable_empty(shape, dtype))


def pin_kind() -> str:
    """The page-locked memory ``PIN_ENV`` asks for: register (the default), hugepage or torch."""
    how = os.environ.get(PIN_ENV, "register")
    if how not in ("register", "hugepage", "torch"):
        raise ValueError(f"{PIN_ENV}={how!r}: expected register (the default), hugepage or torch")
    return how


def pinnable_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Host memory of exactly ``shape`` of the kind ``PIN_ENV`` names, not yet
    page-locked, for ``pin_in_place`` later (serving pins the host store only after
    the pool is sized: ``RimuruRuntime.build``): 2 MiB-aligned plain memory
    (``aligned_empty``), or the same advised to use huge pages. ``torch``'s pinned
    allocator cannot pin in place, so that kind comes pinned."""
    how = pin_kind()
    if how == "torch":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return aligned_empty(shape, dtype, huge_pages=how == "hugepage")


def pin_in_place(t: torch.Tensor) -> torch.Tensor:
    """Page-lock ``t``'s host memory where it is (``cudaHostRegister``, portable and
    mapped, as ``pinned_empty`` describes) and return it; already pinned: as is."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or t.is_pinned():
        return t
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
    if rc != 0 or not t.is_pinned():
        raise RuntimeError(f"cudaHostRegister of {nbytes} B of expert weights failed (cudaError {rc}, "
                           f"is_pinned {t.is_pinned()}); {PIN_ENV}=torch uses torch's pinned allocator instead")
    _REGISTERED.append(t)
    return t


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Host memory of exactly ``shape`` starting on a 2 MiB boundary (its own
    anonymous mapping, which the tensor keeps alive); ``huge_pages`` also asks the
    kernel for transparent huge pages (``MADV_HUGEPAGE``; a no-op where THP is off).

    Why aligned: the paged kernel reads an offloaded expert in place as tiles of
    its rows, a few hundred bytes of each row per load. torch's CPU allocator
    returns large blocks 64 B past a page start, so every such segment of a row
    straddles a 128 B line (twice the PCIe read requests for the same bytes) and
    every 4 KiB row (Qwen3-30B-A3B's hidden size) two host pages. On the H200
    a 48-layer decode step reading 38 GB of experts in place ran at 41.6 GB/s from
    that memory (``bench/device/cpu_split_step.py``; the server: 41) against 51.9
    from 2 MiB-aligned memory (``bench/kernel/zero_copy_scale.py``), with the same
    kernel and registration flags (``bench/RESULTS.md``, 2026-12-03, tenth session;
    the direct A/B, one region read aligned and 64 B off, is
    ``zero_copy_scale.py --host-offsets 64``).
    The storage itself begins at the aligned address (not a view into a larger
    one), since ``is_pinned`` and ``cudaHostRegister`` look at the storage's pointer.
    """
    import ctypes
    import mmap

    align = 2 << 20
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    window = (ctypes.c_char * max(nbytes, 1)).from_address(base + (-base) % align)
    window.mapping = mm  # the window does not own the memory: it keeps the mapping alive
    # frombuffer keeps the window (and so the mapping) alive as long as the tensor's storage
    return torch.frombuffer(window, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def hugepage_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``aligned_empty`` with transparent huge pages asked for
    (``SGLANG_RIMURU_HOST_PIN=hugepage``): the GPU reads host pages in place through
    its own translation of them, and 2 MiB pages need 512x fewer entries than 4 KiB
    ones for the same experts. Whether that is faster is measured by
    ``bench/device/zero_copy_diag.py``, not assumed."""
    return aligned_empty(shape, dtype, huge_pages=True)


class HostExpertStore:
    """Host copies of all experts of all MoE layers of one TP rank.

    Contract: ``matrix(layer, expert, m)`` is a flat view (no copy) of
    ``matrix_elems`` elements, ``matrices(layer, expert, m, n)`` of ``n`` adjacent
    ones; writes through ``put``/``put_fused`` are visible in them.  Memory is
    pinned only when ``pin_memory`` and CUDA is available (``pinned`` tells
    which); unpinned memory still works, copies are just synchronous and slower.
    """

    def __init__(self, shape: MoEShape, pin_memory: bool) -> None:
        self.shape = shape
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        # Pinned stores are left uninitialised: at a real shape zero-filling tens of
        # GiB of page-locked memory is most of a start-up, and the runtime fills every
        # layer (put_fused) before anything reads it. Unpinned (tests, CPU) are zeroed.
        size = (shape.num_experts, 3, shape.matrix_elems)
        self._layers: dict[int, torch.Tensor] = {
            lid: pinned_empty(size, shape.dtype) if self.pinned else torch.zeros(size, dtype=shape.dtype)
            for lid in shape.layer_ids
        }

    @classmethod
    def adopt(cls, shape: MoEShape, layers: dict[int, torch.Tensor]) -> "HostExpertStore":
        """A store over tensors made elsewhere (no copy): one ``[E, 3, matrix_elems]``
        host tensor per MoE layer of ``shape``, e.g. the ones SGLang's weight loaders
        filled through views (``patches/.../host_experts.py``). Pinned when all are."""
        if set(layers) != set(shape.layer_ids):
            raise ValueError(f"adopt: layers {sorted(layers)} differ from the MoE layers {list(shape.layer_ids)}")
        want = (shape.num_experts, 3, shape.matrix_elems)
        for lid, t in layers.items():
            if tuple(t.shape) != want or t.dtype != shape.dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"adopt: layer {lid} is a {tuple(t.shape)} {t.dtype} tensor on {t.device} "
                                 f"(contiguous: {t.is_contiguous()}); expected a contiguous {want} {shape.dtype} "
                                 "host tensor")
        store = cls.__new__(cls)
        store.shape = shape
        store.pinned = all(t.is_pinned() for t in layers.values())
        store._layers = {lid: layers[lid] for lid in shape.layer_ids}
        return store

    def pin(self) -> None:
        """Page-lock every layer's memory in place (``pin_in_place``; CUDA): for a store
        adopted unpinned, pinned once the GPU memory it costs no longer shrinks the pool."""
        for t in self._layers.values():
            pin_in_place(t)
        self.pinned = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._layers.values())

    def layer_tensor(self, layer: int) -> torch.Tensor:
        """The ``[E, 3, matrix_elems]`` host tensor of ``layer``."""
        self.shape.check_layer(layer)
        return self._layers[layer]

    def matrix(self, layer: int, expert: int, m: int) -> torch.Tensor:
        """Flat host view of matrix ``m`` (0 = W1, 1 = W3, 2 = W2) of one expert."""
        self.shape.check_expert(expert)
        self.shape.matrix_shape(m)  # validates m
        return self.layer_tensor(layer)[expert, m]

    def matrices(self, layer: int, expert: int, first_m: int, n: int) -> torch.Tensor:
        """Flat host view (no copy) of matrices ``first_m .. first_m+n-1`` of one
        expert: ``n * matrix_elems`` elements, adjacent in the layer tensor."""
        self.shape.check_expert(expert)
        if isinstance(first_m, bool) or isinstance(n, bool) or not (0 <= first_m < first_m + n <= 3):
            raise ValueError(f"matrices {first_m!r}..+{n!r} not within 0..2 (W1, W3, W2)")
        return self.layer_tensor(layer)[expert, first_m: first_m + n].view(-1)

    def put(self, layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor,
            w2: torch.Tensor) -> None:
        """Copy one expert's W1, W3 ``[inter, hidden]`` and W2 ``[hidden, inter]`` in."""
        self.shape.check_expert(expert)
        dst = self.layer_tensor(layer)[expert]
        for m, (name, w) in enumerate((("w1", w1), ("w3", w3), ("w2", w2))):
            want = self.shape.matrix_shape(m)
            self._check(name, w, want)
        for m, w in enumerate((w1, w3, w2)):
            dst[m].copy_(w.reshape(-1))

    def put_fused(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy a whole layer in from SGLang's ``FusedMoE`` layout.

        ``w13``: ``[E, 2*inter, hidden]`` (rows ``[0, inter)`` W1/gate, ``[inter, 2*inter)``
        W3/up), ``w2``: ``[E, hidden, inter]`` -- ``layer.w13_weight`` / ``layer.w2_weight``.
        """
        s = self.shape
        self._check("w13", w13, (s.num_experts, 2 * s.inter, s.hidden))
        self._check("w2", w2, (s.num_experts, s.hidden, s.inter))
        dst13, dst2 = self.fused_views(self.layer_tensor(layer), s.inter, s.hidden)
        dst13.copy_(w13)
        dst2.copy_(w2)

    @staticmethod
    def fused_views(layer_tensor: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's ``w13 [E, 2*inter, hidden]`` and ``w2 [E, hidden, inter]`` as views
        (no copy) of a ``[E, 3, inter*hidden]`` layer tensor in this store's layout."""
        experts = layer_tensor.shape[0]
        return (layer_tensor[:, 0:2].view(experts, 2 * inter, hidden),
                layer_tensor[:, 2].view(experts, hidden, inter))

    def _check(self, name: str, w: torch.Tensor, want: tuple[int, ...]) -> None:
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(w).__name__}")
        if tuple(w.shape) != tuple(want):
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(want)} "
                             f"(inter={self.shape.inter}, hidden={self.shape.hidden})")
        if w.dtype != self.shape.dtype:
            raise ValueError(f"{name} has dtype {w.dtype}, expected {self.shape.dtype}")

    def __repr__(self) -> str:
        return (f"HostExpertStore(layers={len(self._layers)}, experts={self.shape.num_experts}, "
                f"nbytes={self.nbytes}, pinned={self.pinned})")
