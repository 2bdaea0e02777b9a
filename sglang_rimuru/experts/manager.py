"""``ExpertManager``: the worker side of expert residency -- page tables, copies, compute.

Called from SGLang's MoE layer on the TP worker, layer by layer, in forward order.
Two ways to make every routed expert readable:

    manager.begin_forward()
    for each MoE layer l (position p in shape.layer_ids):
        # copy path (eager, large batches): offloaded routed experts are copied
        # into a load buffer; reads routing on the host (one sync per layer)
        manager.prefetch_next(l, hidden)           # guess layer p+1's experts, copy them
        table = manager.prepare_layer(l, topk_ids) # copy what is routed and missing
        # (forward_copy_path does both and the kernel, leaving the CPU split's host
        # experts uncopied where the layer splits)
        # zero-copy path (CUDA graphs, small batches): nothing to do on the host
        table = manager.table(l)                   # offloaded experts read from pinned host memory
        out = manager.compute(l, hidden, topk_weights, topk_ids, table)
    manager.end_forward()

State map::

    _tables[l]        int32 [E, 3] on device, persistent ("home" table; what a CUDA
                      graph captured reads at every replay), updated in place only
                      between forward passes (refresh_tables):
                        resident expert e -> its pages (W1, W3, W2)
                        offloaded e       -> its host pages -2 - (3e + m) when the device
                                             reads the host store in place (pinned CUDA
                                             memory, or CPU), else -1
    _work[l]          int32 [E, 3], the copy path's table: the home rows, except
                      _loaded_rows[l] {expert: pages}: offloaded experts routed in the
                      last prepare_layer(l), pointing into the load buffer (or at a
                      restore's reserved pages, once its copy is ordered)
    _bufs[b]          what buffer b holds *in this forward*: the layer and {expert: slot};
                      forgotten by begin_forward (prefetches live within one forward)
    _offloaded_now[l] the offloaded experts of l (ranking order) as of the last table
                      refresh: within a forward, residency is what the tables say
    _pending[b]       slots of b written by prefetch copies the compute stream has not
                      waited for yet (a load into such a slot must wait for them first)

Streams (CUDA only; on CPU every copy is synchronous and the flow is the same):

* ``_prefetch_stream`` carries ``prefetch_next``'s copies, ``_load_stream`` the
  on-demand loads of ``prepare_layer``, so a miss never queues behind the next
  layer's prefetch.
* Before a copy into buffer b, the copy stream waits for an event recorded on
  the compute stream at that moment: every earlier reader of b (the layer two
  positions back, and any earlier forward) was enqueued before it.
* ``prepare_layer`` makes the compute stream wait for the copies of its layer
  (the prefetch event when a prefetched expert is used, the load event when it
  loaded any) before returning the table.

``prepare_layer`` and ``prefetch_next`` read routing on the host (one device
sync each) whenever the layer has offloaded experts: not CUDA-graph safe in
that case.  ``table(l)`` never syncs and never points into a load buffer, so
a graph that captured it stays right across evictions and restores: those
change ``_tables`` in place between passes (no recapture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple

import torch
import torch.nn.functional as F

from sglang_rimuru.pool import PoolBuffer

from .copy_runs import page_runs
from .host_store import HostExpertStore
from .load_buffers import NUM_LOAD_BUFFERS, LoadBuffers
from .residency import ExpertResidency
from .shapes import MoEShape

__all__ = ["BufferContent", "ExpertManager", "ExpertNotPreparedError", "ExpertStats", "KernelHooks"]


class ExpertNotPreparedError(RuntimeError):
    """A routed expert has no pages in the table passed to compute (prepare_layer not called?)."""


@dataclass(frozen=True)
class ExpertStats:
    """Counters since construction (a snapshot)."""

    forwards: int = 0
    layers_prepared: int = 0
    prefetched: int = 0  # experts copied into a load buffer by prefetch_next
    prefetch_hits: int = 0  # routed offloaded experts found already prefetched
    on_demand_loads: int = 0  # routed offloaded experts copied by prepare_layer (misses)
    restored: int = 0  # experts copied into their own pages by start_uploads (restores)
    restore_hits: int = 0  # routed experts read from a restore's pages in the pass that copied them
    bytes_copied: int = 0  # host -> device bytes of all those copies
    in_place_layers: int = 0  # layer calls that read offloaded experts from the host in place (eager only)
    in_place_overflow: int = 0  # routed offloaded experts read in place because the load buffer was full

    @property
    def prefetch_hit_rate(self) -> float:
        n = self.prefetch_hits + self.on_demand_loads
        return self.prefetch_hits / n if n else 0.0


@dataclass(frozen=True)
class KernelHooks:
    """What ``compute_cuda`` hands the paged kernel besides the tensors (None = the kernel's own).

    configs(num_tokens) -> (config, down_config or None): the launch configs of the
        gate/up and down GEMMs for a call with ``num_tokens`` tokens (same
        ``BLOCK_SIZE_M``: one alignment serves both);
    act_and_mul(x [T*k, 2I], out [T*k, I]): writes SiLU(gate) * up into out;
    combine(intermediate [T, k, H], out [T, H]): writes the top-k reduction into out.

    The SGLang seam sets SGLang's own functions here, so that the CUDA path does
    SGLang's fused-MoE arithmetic exactly (``rimuru_patches.unified_pool.sglang_moe``).
    """

    configs: Callable[[int], tuple[dict, dict | None]] | None = None
    act_and_mul: Callable[[torch.Tensor, torch.Tensor], object] | None = None
    combine: Callable[[torch.Tensor, torch.Tensor], object] | None = None


class BufferContent(NamedTuple):
    """What one load buffer holds in this forward: its layer and ``{expert: slot}``."""

    layer: int | None
    slots: dict[int, int]


class _BufferState:
    __slots__ = ("layer", "slot_of")

    def __init__(self) -> None:
        self.layer: int | None = None
        self.slot_of: dict[int, int] = {}

    def reset(self, layer: int | None) -> None:
        self.layer = layer
        self.slot_of = {}


class ExpertManager:
    """Per-layer page tables over resident experts and the two load buffers.

    Contract:
      * ``table(l)`` and the tensor ``prepare_layer(l, ...)`` returns are
        persistent ``int32 [E, 3]`` tensors (their addresses never change);
      * ``table(l)`` holds resident pages and, with ``host_reads``, host pages for
        every other expert: nothing routed ever reads page -1 (contributes zero);
      * after ``prepare_layer(l, topk_ids)``, every expert in ``topk_ids`` has a
        row that points at pages holding its weights (resident pages or a
        load-buffer slot), and the compute stream is ordered after the copies;
      * the other rows of that table are the home rows;
      * resident-set changes (``ExpertResidency.evict`` / ``admit``) reach the
        tables at ``begin_forward`` / ``end_forward`` / ``refresh_tables()``,
        never in the middle of a layer;
      * ``residency`` is this worker's own (the residency as applied; in elastic
        mode changed only by ``OrderApplier``), never an object the scheduler's
        adjuster holds; nothing here touches the page pool's bookkeeping.
    """

    def __init__(
        self,
        shape: MoEShape,
        pool_buffer: PoolBuffer,
        residency: ExpertResidency,
        host_store: HostExpertStore,
        load_buffers: LoadBuffers,
        gates: dict[int, torch.Tensor] | None,
        device: torch.device | str,
        host_reads: bool | None = None,
    ) -> None:
        for name, obj in (("residency", residency), ("host_store", host_store),
                          ("load_buffers", load_buffers)):
            if obj.shape != shape:
                raise ValueError(f"{name}.shape {obj.shape} differs from {shape}")
        geo = pool_buffer.geometry
        if geo.expert_page_bytes < shape.expert_page_bytes:
            raise ValueError(f"the pool's expert page ({geo.expert_page_bytes} B) is smaller than one "
                             f"expert matrix ({shape.expert_page_bytes} B)")
        placed = [p for l in shape.layer_ids for pages in residency.resident_pages(l).values() for p in pages]
        ours = set(placed) | set(load_buffers.all_pages())
        if len(ours) != len(placed) + len(load_buffers.all_pages()) or (ours and max(ours) >= geo.num_expert_pages):
            raise ValueError(f"resident experts and load buffers must be on distinct pages of the pool's "
                             f"{geo.num_expert_pages} expert pages")
        self.device = _normalize(torch.device(device))
        if _normalize(pool_buffer.device) != self.device:
            raise ValueError(f"pool_buffer is on {pool_buffer.device}, manager device is {self.device}")
        self.shape = shape
        self.pool_buffer = pool_buffer
        self.residency = residency
        self.host_store = host_store
        self.load_buffers = load_buffers
        self.gates = self._checked_gates(gates)
        self.page_elems = pool_buffer.expert_page_elems(shape.dtype)
        self.pool_flat = pool_buffer.expert_pages_flat(shape.dtype)

        e = shape.num_experts
        #: offloaded experts are read in place from the host store (zero-copy): pinned
        #: memory is mapped into the device's address space; on CPU it is just memory.
        #: Without it an offloaded expert's home row is -1 (the copy path must run).
        can = self.device.type == "cpu" or host_store.pinned
        if host_reads and not can:
            raise ValueError("host_reads needs a pinned host store on CUDA")
        self.host_reads = can if host_reads is None else bool(host_reads)
        if load_buffers.slots < residency.offload_limit and not self.host_reads:
            raise ValueError(f"load buffers have {load_buffers.slots} slots, fewer than the offload "
                             f"limit {residency.offload_limit} (--rimuru-expert-offload-limit), and "
                             "offloaded experts cannot be read in place (no pinned host store)")
        self._tables = {l: torch.full((e, 3), -1, dtype=torch.int32, device=self.device)
                        for l in shape.layer_ids}
        self._work = {l: torch.full((e, 3), -1, dtype=torch.int32, device=self.device)
                      for l in shape.layer_ids}
        self._home_rows: dict[int, list[tuple[int, int, int]]] = {}
        self._table_version = {l: -1 for l in shape.layer_ids}
        self._offloaded_now: dict[int, list[int]] = {}  # per layer, at the last refresh
        self._loaded_rows: dict[int, dict[int, int]] = {l: {} for l in shape.layer_ids}
        ranking = residency.ranking
        self._rank = {l: [ranking.rank(l, x) for x in range(e)] for l in shape.layer_ids}
        self._token_p = {l: ranking.token_probabilities(l, shape.top_k) for l in shape.layer_ids}
        self._max_p: tuple[int, dict[int, float], float] | None = None  # (residency.changes, per layer, all)
        self._bufs = [_BufferState() for _ in range(NUM_LOAD_BUFFERS)]
        self._pending: list[set[int]] = [set() for _ in range(NUM_LOAD_BUFFERS)]
        #: what compute_cuda passes the paged kernel (set once, e.g. by the SGLang seam)
        self.kernel_hooks = KernelHooks()
        self._n = dict(forwards=0, layers_prepared=0, prefetched=0, prefetch_hits=0,
                       on_demand_loads=0, restored=0, restore_hits=0, bytes_copied=0, in_place_layers=0,
                       in_place_overflow=0)

        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._prefetch_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)
            self._ready_ev = torch.cuda.Event()
            self._prefetch_ev = [torch.cuda.Event() for _ in range(NUM_LOAD_BUFFERS)]
            self._load_ev = [torch.cuda.Event() for _ in range(NUM_LOAD_BUFFERS)]
            self._upload_ev = torch.cuda.Event()
            #: recorded at the end of every forward pass on the stream the pass ran on:
            #: with SGLang's overlap scheduler a pass may still run on the GPU while
            #: the scheduler plans the next round, so a restore copy into pages that
            #: pass may read waits for this, not for whatever stream is current then
            self._pass_ev = torch.cuda.Event()
        self._uploads_pending = False
        #: the CPU split (``cpu_split.CpuSplit``), when attached: its tables follow ours
        self.cpu_split = None
        self._uploading: dict[int, dict[int, tuple[int, int, int]]] = {}  # layer -> {expert: pages}
        self.refresh_tables()

    # ================================================================ forward protocol

    def begin_forward(self) -> None:
        """Start a forward pass: forget what the load buffers hold; apply residency changes."""
        self._n["forwards"] += 1
        for st in self._bufs:
            st.reset(None)
        self.refresh_tables()

    def end_forward(self) -> None:
        """End a forward pass (its kernels enqueued): residency changes made during
        the pass (evictions) reach the tables here, stream-ordered after every layer."""
        if self._cuda:
            self._pass_ev.record(torch.cuda.current_stream(self.device))
        self.refresh_tables()

    def prepare_layer(self, layer_id: int, topk_ids: torch.Tensor, skip: Collection[int] = ()) -> torch.Tensor:
        """Make every expert routed in ``topk_ids`` readable; return the layer's table.
        ``skip``: offloaded experts not to copy (the CPU split's host computes them); they
        keep their home rows.

        Offloaded routed experts: a slot of buffer ``position % 2`` that the
        prefetch filled (hit), else copied now from the host store into the
        lowest slot holding nothing in this forward (miss); misses in ranking order.
        "Offloaded" means offloaded at the last table refresh: an expert evicted
        during this forward is still read from its resident pages.
        """
        pos = self.shape.position(layer_id)
        self._n["layers_prepared"] += 1
        table = self._work[layer_id]
        offloaded = self._offloaded_now[layer_id]
        if not offloaded and not self._loaded_rows[layer_id]:
            return self._tables[layer_id]  # every expert resident: no sync, graph-safe
        ids, counts = torch.stack(torch.unique(topk_ids, return_counts=True)).tolist()  # one device sync
        token_count = dict(zip(ids, counts))
        e_count = self.shape.num_experts
        if ids and (ids[0] < 0 or ids[-1] >= e_count):
            bad = [i for i in ids if not 0 <= i < e_count]
            raise ValueError(f"layer {layer_id}: topk_ids hold expert ids outside [0, {e_count}): {bad[:8]}")
        routed = set(ids)
        # A routed expert whose restore copy is under way is read from its reserved
        # pages (after that copy), not copied a second time into a load buffer.
        restoring = {e: p for e, p in self._uploading.get(layer_id, {}).items() if e in routed}
        skip = set(skip)
        needed = [e for e in offloaded if e in routed and e not in restoring and e not in skip]  # ranking order

        b = pos % NUM_LOAD_BUFFERS
        st = self._bufs[b]
        if st.layer != layer_id:
            st.reset(layer_id)
        hits = [e for e in needed if e in st.slot_of]
        misses = [e for e in needed if e not in st.slot_of]
        overflow = self._fit_misses(st, misses, set(needed), token_count, layer_id)
        if misses:
            plan = self._assign_slots(st, misses, layer_id)
            self._copy_into_buffer(layer_id, b, plan, prefetch=False)
            self._n["on_demand_loads"] += len(misses)
        self._n["prefetch_hits"] += len(hits)
        self._n["in_place_overflow"] += len(overflow)

        # Overflow experts keep their home rows: read in place from the host store.
        rows = {e: self.load_buffers.pages(b, st.slot_of[e]) for e in needed if e in st.slot_of}
        rows.update(restoring)
        self._update_rows(layer_id, rows)
        self._n["restore_hits"] += len(restoring)
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            if restoring:
                compute.wait_event(self._upload_ev)
            if self._pending[b] and any(st.slot_of[e] in self._pending[b] for e in hits):
                compute.wait_event(self._prefetch_ev[b])
                self._pending[b].clear()
            if misses:
                compute.wait_event(self._load_ev[b])
        return table

    def note_in_place(self, layer_id: int) -> None:
        """Count a layer call that reads through ``table(layer_id)`` (zero-copy). Host
        counters only: a CUDA graph's replays run no Python."""
        if self._offloaded_now[layer_id]:
            self._n["in_place_layers"] += 1

    def prefetch_next(self, layer_id: int, hidden_states: torch.Tensor, skip: Collection[int] = ()) -> None:
        """Guess the next MoE layer's experts from this layer's MoE input and copy them.

        ``gates[next](hidden_states)`` -> top_k per token -> the offloaded ones,
        most tokens first (ties: ranking order), at most ``slots`` -> slots
        0, 1, ... of the next layer's buffer.  No-op without gates, on the last
        layer, or when the next layer has nothing offloaded. ``skip``: the next
        layer's experts not to copy (the CPU split's host computes them).
        """
        nxt = self.shape.next_layer(layer_id)
        if self.gates is None or nxt is None:
            return
        offloaded = self._offloaded_now[nxt]
        if not offloaded or hidden_states.shape[0] == 0:
            return
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.shape.hidden:
            raise ValueError(f"hidden_states must be [T, {self.shape.hidden}], "
                             f"got {tuple(hidden_states.shape)}")
        gate = self.gates[nxt]
        logits = F.linear(hidden_states.to(gate.dtype), gate)
        picked = torch.topk(logits, self.shape.top_k, dim=-1).indices
        counts = torch.bincount(picked.reshape(-1), minlength=self.shape.num_experts).tolist()
        restoring = self._uploading.get(nxt, {})
        skip = set(skip)
        want = [e for e in offloaded if counts[e] > 0 and e not in restoring and e not in skip]  # deduplicated
        want.sort(key=lambda e: -counts[e])  # stable: ties stay in ranking order
        want = want[: self.load_buffers.slots]

        b = self.shape.position(nxt) % NUM_LOAD_BUFFERS
        st = self._bufs[b]
        if st.layer != nxt:
            st.reset(nxt)
        # (at most the free slots: a second prediction for a layer finds some taken)
        new = [e for e in want if e not in st.slot_of][: self.load_buffers.slots - len(st.slot_of)]
        if not new:
            return
        plan = self._assign_slots(st, new, nxt)
        self._copy_into_buffer(nxt, b, plan, prefetch=True)
        self._n["prefetched"] += len(plan)

    def forward_copy_path(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
        """One layer on the copy path: the next layer's predicted loads first (they overlap
        this layer's compute), this layer's routed offloaded experts made readable, the
        kernel. With the CPU split attached, where a layer splits at this pass's tokens
        (``CpuSplit.host_experts_at``) its host experts are neither prefetched nor copied:
        the host computes them beside the GPU's share (``CpuSplit.forward_copied``), so PCIe
        carries only the rest. (An eager Qwen3-30B-A3B decode pass at ~320 running copies at
        53 GB/s where in-place reads move 41: bench/RESULTS.md, forty-third session.)"""
        split, tokens = self.cpu_split, hidden.shape[0]
        nxt = self.shape.next_layer(layer_id)
        skip_next = split.host_experts_at(nxt, tokens) if split is not None and nxt is not None else ()
        self.prefetch_next(layer_id, hidden, skip=skip_next)
        host = split.host_experts_at(layer_id, tokens) if split is not None else []
        table = self.prepare_layer(layer_id, topk_ids, skip=host)
        if not host:
            return self.compute(layer_id, hidden, topk_weights, topk_ids, table)
        return split.forward_copied(layer_id, hidden, topk_weights, topk_ids, table, lambda used: self.compute_cuda(
            layer_id, hidden, topk_weights, topk_ids, used, absent_is_zero=True))

    # ================================================================ compute

    def sglang_weights(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(w13 [E, 2I, H], w2 [E, H, I])``: contiguous views of the pool holding layer
        ``layer_id`` as SGLang's own ``w13_weight`` / ``w2_weight``, when every expert of
        the layer is resident in SGLang's layout (``ExpertResidency.sglang_layout_base``)
        and a page is exactly one matrix (no padding between them); else None. Only
        for a residency that never changes (static mode): the views go stale when an
        expert moves."""
        base = self.residency.sglang_layout_base(layer_id)
        sh = self.shape
        if base is None or self.page_elems != sh.matrix_elems:
            return None
        e, pe = sh.num_experts, self.page_elems
        w13 = self.pool_flat[base * pe:(base + 2 * e) * pe].view(e, 2 * sh.inter, sh.hidden)
        w2 = self.pool_flat[(base + 2 * e) * pe:(base + 3 * e) * pe].view(e, sh.hidden, sh.inter)
        return w13, w2

    def compute(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``compute_cuda`` for CUDA tensors, ``compute_cpu`` otherwise."""
        if hidden.device.type == "cuda":
            return self.compute_cuda(layer_id, hidden, topk_weights, topk_ids, table)
        return self.compute_cpu(layer_id, hidden, topk_weights, topk_ids, table)

    def compute_cuda(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, table: torch.Tensor,
                     config: dict | None = None, down_config: dict | None = None,
                     hooks: KernelHooks | None = None, absent_is_zero: bool = False) -> torch.Tensor:
        """The paged Triton kernel (``rimuru_kernels.paged_fused_moe``) over the pool.

        ``hooks`` (default ``self.kernel_hooks``) supply the launch configs,
        SiLU*up and top-k combine; an explicit ``config`` / ``down_config``
        wins over ``hooks.configs``. ``absent_is_zero``: rows of -1 contribute zero
        (the CPU split's table: the host computes those experts) instead of being
        refused where the kernel validates (CPU tensors). Also runs on CPU tensors when
        ``TRITON_INTERPRET=1`` was set before ``rimuru_kernels`` was first
        imported (tests only).
        """
        from rimuru_kernels import paged_fused_moe  # lazy: triton only where it runs

        self.shape.check_layer(layer_id)
        hooks = self.kernel_hooks if hooks is None else hooks
        if config is None and hooks.configs is not None and hidden.shape[0] > 0:
            config, hooked_down = hooks.configs(hidden.shape[0])
            down_config = hooked_down if down_config is None else down_config
        return paged_fused_moe(hidden, self.pool_flat, table, topk_weights, topk_ids,
                               inter_size=self.shape.inter, page_elems=self.page_elems,
                               config=config, down_config=down_config,
                               act_and_mul=hooks.act_and_mul, combine=hooks.combine,
                               host_pages=self.host_pages(layer_id), validate=False if absent_is_zero else None)

    def compute_cpu(self, layer_id: int, hidden: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Torch path, bit-identical to SGLang 0.5.17 ``moe_forward_native`` (silu, no bias)
        on ``w13 = cat(W1, W3)`` / ``w2``: same ops, same order, same dtypes.
        (SGLang's fails on zero tokens; this returns an empty ``[0, hidden]``.)"""
        self.shape.check_layer(layer_id)
        if topk_ids.shape[0] == 0:
            return hidden.new_empty((0, hidden.shape[-1]))
        len_experts = self.shape.num_experts
        rows = table.tolist()

        cnts = topk_ids.new_zeros((topk_ids.shape[0], len_experts))
        cnts.scatter_(1, topk_ids.to(torch.int64), 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()

        sorted_tokens = hidden[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().tolist()

        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            p1, p3, p2 = rows[i]
            if -1 in (p1, p3, p2):
                raise ExpertNotPreparedError(
                    f"layer {layer_id}: expert {i} is routed but its table row is {rows[i]} "
                    f"(call prepare_layer first)")
            w13 = torch.cat((self._page(layer_id, p1, 0), self._page(layer_id, p3, 1)))
            gate_up = F.linear(tokens_for_this_expert, w13)
            d = gate_up.shape[-1] // 2
            gate_up = F.silu(gate_up[..., :d]) * gate_up[..., d:]
            expert_out = F.linear(gate_up, self._page(layer_id, p2, 2))
            outputs.append(expert_out)
            start_idx = end_idx

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)

        new_x[idxs] = outs
        final_out = (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weights.dtype)
            .mul_(topk_weights.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )
        return final_out

    # ================================================================ tables, state

    def table(self, layer_id: int) -> torch.Tensor:
        """The persistent home ``int32 [E, 3]`` page table of ``layer_id``: resident
        experts' pages, offloaded experts' host pages (``host_reads``) or -1.

        Every routed expert is readable through it without a host round trip
        when ``host_reads``: the zero-copy path, what CUDA graphs capture."""
        self.shape.check_layer(layer_id)
        return self._tables[layer_id]

    def host_pages(self, layer_id: int) -> torch.Tensor | None:
        """The host store of ``layer_id`` as flat pages (host page ``3e + m`` = matrix
        m of expert e), the kernel's ``host_pages``; None without ``host_reads``."""
        return self.host_store.layer_tensor(layer_id).view(-1) if self.host_reads else None

    def home_row(self, layer_id: int, expert: int) -> tuple[int, int, int]:
        """What the home table holds for ``expert`` (see ``table``)."""
        return self._home_rows[layer_id][expert]

    def refresh_tables(self) -> None:
        """Rewrite the tables of layers whose resident set changed: resident rows get
        their pages, every other row its host pages (or -1 without ``host_reads``);
        the copy path's rows into the load buffer are dropped."""
        for l in self.shape.layer_ids:
            v = self.residency.version(l)
            if v == self._table_version[l]:
                continue
            rows = [self._host_row(e) for e in range(self.shape.num_experts)]
            for e, pages in self.residency.resident_pages(l).items():
                rows[e] = tuple(pages)
            self._home_rows[l] = rows
            host = torch.tensor(rows, dtype=torch.int32)
            if self._cuda:  # pinned + async: a pageable copy would wait for the running pass
                host = host.pin_memory()
            self._tables[l].copy_(host, non_blocking=self._cuda)
            self._work[l].copy_(self._tables[l])
            self._loaded_rows[l] = {}
            self._offloaded_now[l] = self.residency.offloaded(l)
            self._table_version[l] = v
            if self.cpu_split is not None:  # its split table follows the home table, same stream order
                self.cpu_split.update_layer(l, rows, self._offloaded_now[l], self._token_p[l], self._tables[l])

    def attach_cpu_split(self, split) -> None:
        """Keep ``split``'s tables (``cpu_split.CpuSplit``) beside the home tables from now on."""
        if not self.host_reads:
            raise ValueError("the CPU split needs host reads: its table keeps every other offloaded row readable")
        self.cpu_split = split
        for l in self.shape.layer_ids:
            split.update_layer(l, self._home_rows[l], self._offloaded_now[l], self._token_p[l], self._tables[l])

    def offloaded_max_p(self, layer_id: int | None = None) -> float:
        """The largest per-token routing probability (the ranking's, scaled to ``top_k``
        a token) among the experts offloaded now, in ``layer_id`` or in any layer; 0.0
        where none is. What ``in_place.reads_in_place`` takes; recomputed only after
        the resident set changed."""
        res = self.residency
        if self._max_p is None or self._max_p[0] != res.changes:
            per = {l: max((self._token_p[l][x] for x in res.offloaded(l)), default=0.0)
                   for l in self.shape.layer_ids}
            self._max_p = (res.changes, per, max(per.values(), default=0.0))
        return self._max_p[2] if layer_id is None else self._max_p[1][layer_id]

    def _host_row(self, expert: int) -> tuple[int, int, int]:
        if not self.host_reads:
            return (-1, -1, -1)
        return tuple(-2 - (3 * expert + m) for m in range(3))

    def upload_resident(self) -> None:
        """Copy every resident expert's weights from the host store into its pages
        (start-up; synchronous).  Not counted in ``stats()``."""
        for l in self.shape.layer_ids:
            for e, pages in self.residency.resident_pages(l).items():
                self._copy_expert(l, e, pages, non_blocking=False)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def start_uploads(self, moves: list[tuple[int, int, tuple[int, int, int]]]) -> None:
        """Start copying experts ``(layer, expert, pages)`` from the host store into
        pages reserved for them (restores of a migration order).

        On CUDA the copies go on the prefetch stream, ahead of every prediction the
        forward pass queues after them, and overlap the pass; ``wait_uploads``
        blocks until they landed.  Until ``wait_uploads`` the experts count as
        "restoring": ``prefetch_next`` does not predict them (deduplicated), and a
        layer that routes to one points its row at the reserved pages, the compute
        stream waiting for the copy first; no load-buffer copy is made.  Their
        table rows become permanent with ``ExpertResidency.admit`` and the next
        refresh.  On CPU the copies are done on return.
        """
        if not moves:
            return
        for layer, expert, pages in moves:
            self.shape.check_layer(layer)
            self.shape.check_expert(expert)
        for layer, expert, pages in moves:
            self._uploading.setdefault(layer, {})[expert] = tuple(int(p) for p in pages)
        if self._cuda:
            # After every pass enqueued so far (one may still read these pages under the
            # overlap scheduler) and everything on the current stream.
            self._prefetch_stream.wait_event(self._pass_ev)
            self._prefetch_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._prefetch_stream):
                for layer, expert, pages in moves:
                    self._copy_expert(layer, expert, tuple(pages), non_blocking=True)
                self._upload_ev.record(self._prefetch_stream)
            self._uploads_pending = True
        else:
            for layer, expert, pages in moves:
                self._copy_expert(layer, expert, tuple(pages), non_blocking=False)
        self._n["restored"] += len(moves)
        self._n["bytes_copied"] += len(moves) * 3 * self.shape.matrix_elems * self.shape.dtype.itemsize

    def uploads_done(self) -> bool:
        """Whether every copy ``start_uploads`` started has landed (no blocking)."""
        return not (self._cuda and self._uploads_pending) or self._upload_ev.query()

    def wait_uploads(self) -> None:
        """Block until every copy ``start_uploads`` started has landed."""
        if self._cuda and self._uploads_pending:
            self._upload_ev.synchronize()
            self._uploads_pending = False
        self._uploading.clear()

    def buffer_content(self, buffer: int) -> BufferContent:
        st = self._bufs[buffer]
        return BufferContent(st.layer, dict(st.slot_of))

    def stats(self) -> ExpertStats:
        return ExpertStats(**self._n)

    # ================================================================ internals

    def _checked_gates(self, gates: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor] | None:
        if gates is None:
            return None
        want = (self.shape.num_experts, self.shape.hidden)
        for l in self.shape.layer_ids[1:]:
            g = gates.get(l)
            if g is None:
                raise ValueError(f"gates: no router weight for MoE layer {l} "
                                 f"(needed to prefetch it from the layer before)")
            if tuple(g.shape) != want:
                raise ValueError(f"gates[{l}] has shape {tuple(g.shape)}, expected {want}")
            if _normalize(g.device) != self.device:
                raise ValueError(f"gates[{l}] is on {g.device}, expected {self.device}")
        return dict(gates)

    def _page(self, layer: int, page: int, m: int) -> torch.Tensor:
        """Matrix ``m`` on pool page ``page``, or on host page ``-2 - page`` of ``layer``."""
        me = self.shape.matrix_elems
        if page <= -2:
            h = -2 - page
            return self.host_store.layer_tensor(layer).view(-1)[h * me: (h + 1) * me].view(self.shape.matrix_shape(m))
        start = page * self.page_elems
        return self.pool_flat[start: start + me].view(self.shape.matrix_shape(m))

    def _copy_expert(self, layer: int, expert: int, pages: tuple[int, int, int],
                     non_blocking: bool) -> None:
        me = self.shape.matrix_elems
        if self.page_elems == me:
            # No padding in a page: matrices on consecutive pages are adjacent on both
            # sides, so each run is one copy (every transfer pays a DMA set-up cost).
            for m, n, p in page_runs(pages):
                start = p * me
                self.pool_flat[start: start + n * me].copy_(
                    self.host_store.matrices(layer, expert, m, n), non_blocking=non_blocking)
            return
        for m, p in enumerate(pages):
            start = p * self.page_elems
            self.pool_flat[start: start + me].copy_(
                self.host_store.matrix(layer, expert, m), non_blocking=non_blocking)

    def _fit_misses(self, st: _BufferState, misses: list[int], needed: set[int], token_count: dict[int, int],
                    layer: int) -> list[int]:
        """Make ``misses`` fit the buffer's free slots; return the ones left out (in place).

        With slots >= the offload limit (static's default) they always fit: a buffer
        holds only experts of one layer offloaded at the last table refresh.
        With fewer (``--rimuru-load-buffer-slots``), slots holding a mispredicted
        prefetch are given back first (a copy into one waits for that prefetch),
        then the misses with the most tokens are copied and the rest read in place
        from the host store, where a copy would pay its PCIe time once and an
        in-place read once per block of tokens. ``misses`` is cut in place.
        """
        free = self.load_buffers.slots - len(st.slot_of)
        if len(misses) <= free:
            return []
        for e in [e for e in st.slot_of if e not in needed]:
            del st.slot_of[e]
        free = self.load_buffers.slots - len(st.slot_of)
        if len(misses) <= free:
            return []
        if not self.host_reads:
            raise RuntimeError(f"layer {layer}: load buffer has {free} free slots, {len(misses)} experts "
                               "to load, and offloaded experts cannot be read in place")
        misses.sort(key=lambda e: -token_count[e])  # stable: ties stay in ranking order
        overflow = misses[free:]
        del misses[free:]
        return overflow

    def _assign_slots(self, st: _BufferState, experts: list[int], layer: int) -> list[tuple[int, int]]:
        """Give each expert the lowest slot not holding anything in this forward
        (``_fit_misses`` made sure there are enough)."""
        used = set(st.slot_of.values())
        free = [s for s in range(self.load_buffers.slots) if s not in used]
        if len(experts) > len(free):
            raise RuntimeError(f"layer {layer}: load buffer has {len(free)} free slots, "
                               f"{len(experts)} experts to load (offload limit exceeded?)")
        plan = list(zip(experts, free))
        st.slot_of.update(plan)
        return plan

    def _copy_into_buffer(self, layer: int, b: int, plan: list[tuple[int, int]],
                          prefetch: bool) -> None:
        """Copy ``(expert, slot)`` pairs of ``layer`` into buffer ``b``."""
        self._n["bytes_copied"] += len(plan) * self.shape.expert_bytes
        if not self._cuda:
            for e, s in plan:
                self._copy_expert(layer, e, self.load_buffers.pages(b, s), non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device)
        stream = self._prefetch_stream if prefetch else self._load_stream
        self._ready_ev.record(compute)  # after every earlier reader of buffer b
        stream.wait_event(self._ready_ev)
        if not prefetch and any(s in self._pending[b] for _, s in plan):
            stream.wait_event(self._prefetch_ev[b])  # write-after-write on a prefetched slot
        with torch.cuda.stream(stream):
            for e, s in plan:
                self._copy_expert(layer, e, self.load_buffers.pages(b, s), non_blocking=True)
        if prefetch:
            self._prefetch_ev[b].record(stream)
            self._pending[b].update(s for _, s in plan)
        else:
            self._load_ev[b].record(stream)

    def _update_rows(self, layer: int, rows: dict[int, tuple[int, int, int]]) -> None:
        """Point the working table's ``rows`` (expert -> pages) at their pages; reset
        stale ones to their home rows."""
        old = self._loaded_rows[layer]
        if old == rows:
            return
        changes = []
        for e, s in old.items():
            if e not in rows:
                changes.append((e, *self._home_rows[layer][e]))
        for e, pages in rows.items():
            if old.get(e) != pages:
                changes.append((e, *pages))
        if changes:
            upd = torch.tensor(changes, dtype=torch.int32).to(self.device)
            self._work[layer][upd[:, 0].long()] = upd[:, 1:]
        self._loaded_rows[layer] = dict(rows)

    def __repr__(self) -> str:
        return (f"ExpertManager(layers={self.shape.num_layers}, device={self.device}, "
                f"slots={self.load_buffers.slots}, {self.stats()})")


def _normalize(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
