"""A device <-> host-thread handshake that a CUDA graph can capture.

Why: the CPU split (``sglang_rimuru/experts/cpu_split.py``) hands part of a MoE
layer's offloaded experts to the host's CPUs in the middle of a captured decode
step. A graph cannot call the host, so the two sides meet in mapped pinned host
memory (``HostMailbox``): the layer's inputs, the host's output, and int64 flags

    flags[0]  request: the request's number n, stored last, with release ordering
    flags[1]  reply:   n, written by the host thread once its share is in place
    flags[2]  meta:    (layer << 16) | tokens of request n (stored before flags[0])
    flags[3]  error:   n, when the device gave up waiting for reply n

Per layer, in stream order (each a launch a graph replays unchanged)::

    pack_request   T programs: token rows of hidden states, routing ids and weights,
                   and (program 0) the layer's table column into the mailbox, and the
                   table the GPU's share runs on: the split table when the layer
                   splits this pass, else the home table (every expert the GPU's)
    post_request   counter + 1; meta; request = counter
    ... the GPU's own share of the layer runs here, overlapping the host ...
    await_reply    spin on reply (volatile loads past the cache) until it reaches the
                   counter, or give up after max_spins polls and write error
    add_reply      out = the GPU's share + the host's (fp32 add, one rounding)

Each takes ``gate[pos]`` (a device int32 per layer): the least token count at which
the layer splits. A pass of ``T`` tokens splits the layer iff ``T >= gate[pos]``;
otherwise every launch is a no-op, ``add_reply`` a copy and the GPU runs the home
table, so a graph captured with the handshake costs a layer that does not split this
pass five empty launches, not a host round trip (the light-load decode step this
project must not slow down). ``T`` is fixed when a graph is captured (its padded batch)
and ``gate`` is read at replay, so which layers split at which batch sizes moves
between passes without a recapture (``cpu_split.CpuSplit`` sets it from measured
times). ``NEVER`` closes a layer.

Pinned host memory is addressed as ``anchor + offset`` (elements of the anchor's
dtype from a device tensor to the buffer; under unified addressing a pinned host
pointer is a device pointer), as ``paged_moe.py`` reaches host pages: Triton takes
device tensors only. A kernel's stores are complete when the next launch of the
stream starts, and the release store of ``post_request`` orders its meta before the
request, so the host that sees request n reads n's inputs.

Measured in one 48-layer graph on the H200 (``bench/device/cpu_split_step.py``,
bench/RESULTS.md "The CPU split"). Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FLAG_WORDS", "NEVER", "HostMailbox", "add_reply", "add_reply_reference", "await_reply",
           "pack_request", "post_request"]

#: request, reply, meta, error
FLAG_WORDS = 4
REQUEST, REPLY, META, ERROR = range(FLAG_WORDS)
#: a gate no pass reaches (tokens fit 16 bits)
NEVER = 1 << 30


@triton.jit
def _pack_kernel(x_ptr, x_stride, ids_ptr, w_ptr, tab_ptr, home_ptr, used_ptr, gate_ptr, pos, T,
                 xa_ptr, x_off, ia_ptr, ids_off, fa_ptr, w_off, tab_off,
                 H: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    on = T >= tl.load(gate_ptr + pos)
    if t == 0:  # the GPU's table this pass: the split's, or the home table's every expert
        r = tl.arange(0, BLOCK_E * 4)
        mr = (r < E * 3)
        if on:
            tl.store(used_ptr + r, tl.load(tab_ptr + r, mask=mr), mask=mr)
        else:
            tl.store(used_ptr + r, tl.load(home_ptr + r, mask=mr), mask=mr)
    if on:
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            m = offs < H
            tl.store(xa_ptr + x_off + t * H + offs, tl.load(x_ptr + t * x_stride + offs, mask=m), mask=m)
        k = tl.arange(0, BLOCK_K)
        mk = k < K
        tl.store(ia_ptr + ids_off + t * K + k, tl.load(ids_ptr + t * K + k, mask=mk).to(tl.int32), mask=mk)
        tl.store(fa_ptr + w_off + t * K + k, tl.load(w_ptr + t * K + k, mask=mk).to(tl.float32), mask=mk)
        if t == 0:
            e = tl.arange(0, BLOCK_E)
            me = e < E
            tl.store(ia_ptr + tab_off + e, tl.load(tab_ptr + e * 3, mask=me), mask=me)


@triton.jit
def _post_kernel(counter_ptr, gate_ptr, pos, T, la_ptr, flags_off, meta):
    if T >= tl.load(gate_ptr + pos):
        n = tl.load(counter_ptr) + 1
        tl.store(counter_ptr, n)
        tl.store(la_ptr + flags_off + 2, meta)
        # release at system scope: meta is visible to the host before the request number
        tl.atomic_xchg(la_ptr + flags_off, n, sem="release", scope="sys")


@triton.jit
def _await_kernel(counter_ptr, gate_ptr, pos, T, la_ptr, flags_off, max_spins):
    if T >= tl.load(gate_ptr + pos):
        want = tl.load(counter_ptr)
        # .cv: a cached line of system memory is stale, fetch it again (the host writes it)
        got = tl.load(la_ptr + flags_off + 1, cache_modifier=".cv", volatile=True)
        spins = 0
        while (got < want) & (spins < max_spins):
            got = tl.load(la_ptr + flags_off + 1, cache_modifier=".cv", volatile=True)
            spins += 1
        if got < want:
            tl.store(la_ptr + flags_off + 3, want)


@triton.jit
def _add_kernel(gpu_ptr, out_ptr, gate_ptr, pos, T, xa_ptr, part_off,
                H: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    active = T >= tl.load(gate_ptr + pos)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < H
        v = tl.load(gpu_ptr + t * H + offs, mask=m)
        if active:
            # .cv: the host wrote these lines after the device last saw them
            v = (v.to(tl.float32) + tl.load(xa_ptr + part_off + t * H + offs, mask=m, cache_modifier=".cv",
                                            volatile=True).to(tl.float32)).to(v.dtype)
        tl.store(out_ptr + t * H + offs, v, mask=m)


def _offset(anchor: torch.Tensor, buf: torch.Tensor) -> int:
    delta = buf.data_ptr() - anchor.data_ptr()
    if buf.dtype != anchor.dtype or delta % buf.element_size():
        raise ValueError(f"a {buf.dtype} buffer is not element-aligned relative to its {anchor.dtype} anchor")
    return delta // buf.element_size()


class HostMailbox:
    """Pinned host buffers of one handshake, and the device side's way to them.

    ``x``/``part`` [max_tokens, hidden] (``dtype``), ``ids`` [max_tokens, top_k] int32,
    ``weights`` [max_tokens, top_k] float32, ``table`` [num_experts] int32 (column 0 of
    the layer's page table: -1 marks the host's experts), ``flags`` [4] int64: views of
    one host block, page-locked with one registration when ``device`` is CUDA (small
    buffers registered apart may share a page, which a second registration refuses);
    plain memory on CPU (the Triton interpreter, tests). ``pin`` makes that block (the
    host store's ``pinned_empty``: the caller's, as this package imports no project code).
    """

    def __init__(self, *, max_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                 device: torch.device | str, pin=None):
        self.device = torch.device(device)
        self.max_tokens, self.hidden, self.top_k, self.num_experts = max_tokens, hidden, top_k, num_experts
        specs = [((max_tokens, hidden), dtype), ((max_tokens, hidden), dtype), ((max_tokens, top_k), torch.int32),
                 ((max_tokens, top_k), torch.float32), ((num_experts,), torch.int32), ((FLAG_WORDS,), torch.int64)]
        offsets, total = [], 0
        for shape, dt in specs:
            offsets.append(total)
            total += -(-(dt.itemsize * max(1, torch.Size(shape).numel())) // 256) * 256
        if self.device.type == "cuda":
            if pin is None:
                raise ValueError("a CUDA mailbox needs pin(shape, dtype) -> page-locked host memory")
            block = pin((total,), torch.uint8)
        else:
            block = torch.zeros(total, dtype=torch.uint8)
        views = [block[o:o + dt.itemsize * torch.Size(s).numel()].view(dt).view(s) for o, (s, dt) in zip(offsets, specs)]
        self.block = block
        self.x, self.part, self.ids, self.weights, self.table, self.flags = views
        self.flags.zero_()
        # one device anchor per dtype the kernels store through
        self._anchors = {dt: torch.zeros(1, dtype=dt, device=self.device)
                         for dt in (dtype, torch.int32, torch.float32, torch.int64)}
        a = self._anchors
        self.x_off, self.part_off = _offset(a[dtype], self.x), _offset(a[dtype], self.part)
        self.ids_off, self.tab_off = _offset(a[torch.int32], self.ids), _offset(a[torch.int32], self.table)
        self.w_off, self.flags_off = _offset(a[torch.float32], self.weights), _offset(a[torch.int64], self.flags)
        self.dtype = dtype
        #: requests posted (device), what reply and error are compared against
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)


def pack_request(mb: HostMailbox, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 table: torch.Tensor, home: torch.Tensor, used: torch.Tensor, gate: torch.Tensor, pos: int) -> None:
    """Enqueue: where ``T >= gate[pos]`` (T: x's rows), the first T rows of the mailbox's x,
    ids and weights := x, topk_ids, topk_weights, its table := table[:, 0], and ``used`` :=
    ``table`` (the split table); elsewhere ``used`` := ``home`` and nothing else moves.
    ``used`` is what the GPU's share of the layer runs on."""
    T, H = x.shape
    if T > mb.max_tokens or H != mb.hidden or topk_ids.shape != (T, mb.top_k) or topk_weights.shape != (T, mb.top_k):
        raise ValueError(f"pack_request: x {tuple(x.shape)}, ids {tuple(topk_ids.shape)}, weights "
                         f"{tuple(topk_weights.shape)} for a mailbox of {mb.max_tokens} x {mb.hidden}, top-{mb.top_k}")
    for t in (home, used):
        if t.shape != table.shape or t.dtype != table.dtype or not t.is_contiguous():
            raise ValueError(f"pack_request: home and used tables must match the split table "
                             f"({tuple(table.shape)} {table.dtype}, contiguous); got {tuple(t.shape)} {t.dtype}")
    if table.shape != (mb.num_experts, 3) or x.dtype != mb.dtype or x.stride(1) != 1:
        raise ValueError(f"pack_request: table {tuple(table.shape)} or x {x.dtype} stride {x.stride()} "
                         f"does not fit the mailbox ({mb.num_experts} experts, {mb.dtype}, rows contiguous)")
    if T == 0:
        return
    a = mb._anchors
    _pack_kernel[(T,)](x, x.stride(0), topk_ids.contiguous(), topk_weights.contiguous(), table.contiguous(),
                       home, used, gate, pos, T, a[mb.dtype], mb.x_off, a[torch.int32], mb.ids_off, a[torch.float32],
                       mb.w_off, mb.tab_off, H=H, K=mb.top_k, E=mb.num_experts,
                       BLOCK_H=min(1024, triton.next_power_of_2(H)), BLOCK_K=triton.next_power_of_2(mb.top_k),
                       BLOCK_E=triton.next_power_of_2(mb.num_experts))


def post_request(mb: HostMailbox, gate: torch.Tensor, pos: int, layer: int, tokens: int) -> None:
    """Enqueue: where ``tokens >= gate[pos]``, counter += 1, meta = (layer << 16) | tokens,
    request = counter."""
    if not (0 <= layer < 1 << 16 and 0 <= tokens < 1 << 16):
        raise ValueError(f"layer {layer} and tokens {tokens} must each fit 16 bits")
    _post_kernel[(1,)](mb.counter, gate, pos, tokens, mb._anchors[torch.int64], mb.flags_off, (layer << 16) | tokens)


def await_reply(mb: HostMailbox, gate: torch.Tensor, pos: int, tokens: int, max_spins: int) -> None:
    """Enqueue: where ``tokens >= gate[pos]``, wait until reply >= counter; after
    ``max_spins`` polls give up and write error = counter."""
    _await_kernel[(1,)](mb.counter, gate, pos, tokens, mb._anchors[torch.int64], mb.flags_off, max_spins)


def add_reply(mb: HostMailbox, gpu_part: torch.Tensor, gate: torch.Tensor, pos: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [T, H] := gpu_part + (the mailbox's part where ``T >= gate[pos]``, else 0)."""
    T, H = gpu_part.shape
    gpu_part = gpu_part.contiguous()
    out = torch.empty_like(gpu_part) if out is None else out
    if T:
        _add_kernel[(T,)](gpu_part, out, gate, pos, T, mb._anchors[mb.dtype], mb.part_off,
                          H=H, BLOCK_H=min(1024, triton.next_power_of_2(H)))
    return out


def add_reply_reference(gpu_part: torch.Tensor, part: torch.Tensor, active: bool) -> torch.Tensor:
    """``add_reply`` in torch: the fp32 sum rounded once to the parts' dtype."""
    if not active:
        return gpu_part.clone()
    return (gpu_part.float() + part[: gpu_part.shape[0]].float()).to(gpu_part.dtype)
