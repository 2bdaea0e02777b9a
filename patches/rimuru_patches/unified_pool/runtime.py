"""One scheduler process's unified pool: built at start, used by the allocator and the MoE layers.

Each TP rank's scheduler process runs one ``RimuruRuntime``. It is built in
``ModelRunner.alloc_memory_pool`` after SGLang loaded the weights and before
SGLang builds its KV pool:

1. every routed expert of every MoE layer is in host memory (pinned on CUDA):
   made there at load (``host_experts.py``), else copied out of SGLang's
   contiguous ``w13_weight`` / ``w2_weight``, which are freed;
2. the pool is sized (``sglang_rimuru.plan``), its byte buffer allocated,
   KV slot 0 reserved for SGLang's dummy writes, the two load buffers and the
   resident experts (highest ranked first) placed, and the residents copied in;
3. SGLang then builds its KV pool and allocator over the same bytes
   (``kv.py``), sized to what the pool can give KV.

During a forward pass ``FusedMoE.run_moe_core`` of a managed layer calls
:meth:`RimuruRuntime.moe_forward` instead of SGLang's quant method. On CUDA the
manager's paged kernel runs as ``--rimuru-moe-kernel`` says
(:meth:`RimuruRuntime.kernel_hooks`): ``exact`` gives it SGLang's launch
configs, SiLU*up and top-k combine (``sglang_moe.py``), so its outputs are
bit-identical to SGLang's fused MoE; ``fast`` leaves it its own defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import torch

from rimuru_patches import card_cap
from rimuru_patches.unified_pool import host_experts
from sglang_rimuru.config import RimuruConfig, choose_moe_kernel
from sglang_rimuru.experts import (
    ExpertManager,
    NotEnoughPagesError,
    ExpertRanking,
    ExpertResidency,
    HostExpertStore,
    KernelHooks,
    LoadBuffers,
    MoEShape,
    load_ranking,
    reads_in_place,
    replay_max_probability,
)
from sglang_rimuru.experts import read_probe
from sglang_rimuru.experts.host_store import pin_kind
from sglang_rimuru.experts.cpu_split import CpuSplit, CpuSplitFailed
from sglang_rimuru.plan import GIB, ModelFacts, PlanError, PoolPlan, plan_pool
from sglang_rimuru.pool import PoolBuffer, PoolGeometry, UnifiedPagePool

logger = logging.getLogger(__name__)

#: owner tag of KV slot 0 (SGLang writes padded tokens' KV there)
DUMMY_SLOT_OWNER = "sglang_dummy_slot"

_ACTIVE: "RimuruRuntime | None" = None


def active() -> "RimuruRuntime | None":
    """The runtime of this process, once built (None in plain SGLang processes)."""
    return _ACTIVE


#: decode step (base ms, ms per request) assumed until decode rounds were timed: plain
#: SGLang serving ShareGPT on the H200 (Qwen1.5-MoE shape, CUDA graphs: 6.6 ms at batch < 8,
#: 9.7 at 16-23, 11.6 at 32-35). Not a decode probe's line (3.75 ms at 1, 4.47 at 32, short
#: contexts): under that a request looked nearly free and the first burst's evictions
#: all paid (bench/RESULTS.md, elastic32 of 2026-12-01)
STEP_PRIOR_MS = (5.9, 0.17)
#: in-place reads reached 93 % of a pinned copy on the H200 (bench/RESULTS.md)
IN_PLACE_SHARE = 0.93
#: throughput lost while an expert is out that long prefill passes route more than a block of
#: tokens to, with prefill graphs on: those passes then run eagerly (prefill_graph_may_replay). H200, elastic32 at equal decode steps: 811 tok/s with
#: every prefill eager (7508738) against 1,037 with the graphs replaying (312737e),
#: bench/RESULTS.md; CostModel.eager_prefill_share
EAGER_PREFILL_SHARE = 0.2


def _largest_replayed_prefill(server_args) -> int:
    """The most tokens a captured prefill pass holds: SGLang's prefill-graph size
    (0.5.17: ``cuda_graph_config.prefill.max_bs``), at most the chunked prefill size.
    A renamed attribute fails the elastic start here, by name."""
    try:
        graph_max = server_args.cuda_graph_config.prefill.max_bs
    except AttributeError as exc:
        raise RuntimeError("sglang-rimuru: SGLang's ServerArgs.cuda_graph_config.prefill.max_bs is gone "
                           f"({exc}); the cost model needs the longest captured prefill pass") from exc
    sizes = [v for v in (graph_max, server_args.chunked_prefill_size) if isinstance(v, int) and v > 0]
    # neither set: a prefill pass is at most max_prefill_tokens (an int in every ServerArgs)
    return min(sizes) if sizes else int(server_args.max_prefill_tokens)


#: ``SGLANG_RIMURU_PCIE_GBPS``: the in-place read rate the cost model assumes, GB/s (instead of
#: timing a copy; for A/B runs and for CPU tests that need offloading to cost something)
PCIE_ENV = "SGLANG_RIMURU_PCIE_GBPS"


def _in_place_read_gbps(device) -> float:
    """What an in-place read of host pages moves per second here: the fastest of five
    timings of three pinned 64 MiB host->device copies, scaled by what in-place reads
    reached on the H200. CPU: a nominal 50 GB/s (nothing crosses PCIe there).
    ``PCIE_ENV`` overrides. The fastest, because the probe's error is one-sided: one
    timing on an H100 read 34.6 GB/s where two later starts on the same machine read 51
    (bench/RESULTS.md, thirty-eighth session), and the cost-aware adjuster then priced
    every read 1.48x dearer for the whole run."""
    override = os.environ.get(PCIE_ENV)
    if override is not None:
        try:
            gbps = float(override)
        except ValueError:
            gbps = 0.0
        if not gbps > 0:
            raise ValueError(f"{PCIE_ENV}={override!r}: expected GB/s > 0")
        return gbps
    device = torch.device(device)
    if device.type != "cuda":
        return 50.0
    # one key for "cuda" and "cuda:N" alike (the manager's device and the worker's may differ in form)
    return _copy_probe_gbps(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _copy_probe_gbps(index: int) -> float:
    """``_in_place_read_gbps``'s probe, once a process and device: the cost-aware adjuster
    and the CPU split's gates price a read from the same figure, and start-up pays once."""
    n = 64 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", index))
    dev.copy_(host, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_ms = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    return IN_PLACE_SHARE * 3 * n / (best_ms * 1e6)


def _range(counts) -> str:
    counts = list(counts)
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def find_moe_layers(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, torch.Tensor]]:
    """``{layer_id: (FusedMoE, router weight [E, hidden])}`` of a Qwen-style MoE model."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    layers = {}
    for module in model.modules():
        experts = getattr(module, "experts", None)
        gate = getattr(module, "gate", None)
        if isinstance(experts, FusedMoE) and gate is not None and hasattr(gate, "weight"):
            layers[experts.layer_id] = (experts, gate.weight)
    return dict(sorted(layers.items()))


class RimuruRuntime:
    def __init__(self, *, config, plan, geometry, page_pool, buffer, shape, residency, manager, device,
                 elastic=None):
        self.config: RimuruConfig = config
        self.plan: PoolPlan = plan
        self.geometry: PoolGeometry = geometry
        self.page_pool: UnifiedPagePool = page_pool
        self.buffer: PoolBuffer = buffer
        self.shape: MoEShape = shape
        #: the scheduler side's residency: the pool's placement; in elastic mode the
        #: adjuster's view, changed by the worker's acks (the worker's own is ``manager.residency``)
        self.residency: ExpertResidency = residency
        self.manager: ExpertManager = manager
        self.device = torch.device(device)
        self.layer_ids = frozenset(shape.layer_ids)
        #: the elastic mode's ``ElasticController`` (None in static mode)
        self.elastic = elastic
        #: static layers SGLang's own MoE computes, from pool views (``use_sglang_moe``)
        self.sglang_moe_layers: frozenset[int] = frozenset()
        #: the CPU split (``--rimuru-cpu-experts``; sglang_rimuru/experts/cpu_split.py), or None
        self.cpu_split: CpuSplit | None = None
        self._stats_logged = time.monotonic()  # log_stats_every's last line

    @property
    def kv_id_limit(self) -> int:
        """One past the largest KV token id the pool can hand out: the rows of the
        KV views. SGLang's KV pool is built with ``size = kv_id_limit - page_size``
        so that its bound ``size + page_size`` covers every id (``kv.py``)."""
        return self.geometry.num_kv_page_ids * self.plan.page_size

    @property
    def kv_tokens_now(self) -> int:
        """KV tokens the pool can hold with today's residency (free and KV pages)."""
        return self.page_pool.kv_capacity_now() * self.plan.page_size

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens SGLang may ever hold: now (static), or once every expert the
        offload limit lets go has left the pool (elastic; KV pages per expert page
        counted at the geometry's minimum, so it is always reachable)."""
        if self.elastic is None:
            return self.kv_tokens_now
        min_resident = len(self.shape.layer_ids) * (self.shape.num_experts - self.plan.offload_limit)
        evictable_pages = 3 * max(0, self.residency.num_resident() - min_resident)
        return self.kv_tokens_now + evictable_pages * self.plan.kv_pages_per_expert_page * self.plan.page_size

    # -- building ---------------------------------------------------------

    @classmethod
    def build(cls, model_runner, config: RimuruConfig, profile_bytes) -> "RimuruRuntime":
        """Move the experts of ``model_runner.model`` into a new pool.

        ``profile_bytes()`` returns SGLang's KV budget in bytes; it is called
        (after the experts left the GPU) only when no flag fixes the pool size.
        """
        global _ACTIVE
        server_args = model_runner.server_args
        facts = ModelFacts.from_config(model_runner.model_config.hf_config.to_dict())
        layers = find_moe_layers(model_runner.model)
        if tuple(layers) != facts.moe_layer_ids:
            raise RuntimeError(
                f"--rimuru-mode: the model's FusedMoE layers {tuple(layers)} differ from the MoE layers "
                f"{facts.moe_layer_ids} its config describes"
            )
        first = next(iter(layers.values()))[0]
        dtype = first.w13_weight.dtype
        plan = plan_pool(
            facts,
            config,
            tp_size=model_runner.ps.tp_size,
            page_size=server_args.page_size or 1,
            dtype_bytes=dtype.itemsize,
            kv_dtype_bytes=torch.empty((), dtype=model_runner.kv_cache_dtype).element_size(),
            max_total_tokens=server_args.max_total_tokens,
            context_len=server_args.context_length,
        )
        shape = facts.moe_shape(tp_size=model_runner.ps.tp_size, dtype=dtype)
        device = torch.device(model_runner.device)
        for moe, _ in layers.values():
            cls._check_layer(moe, shape)
        hosted = host_experts.take()
        if set(hosted) == set(shape.layer_ids):  # made in host memory at load (host_experts.py)
            host = HostExpertStore.adopt(shape, hosted)
        else:  # made by SGLang on the device: copied out
            if hosted:
                raise RuntimeError(f"--rimuru-mode: MoE layers {sorted(hosted)} were made in host memory, "
                                   f"but not all of {list(shape.layer_ids)}")
            host = HostExpertStore(shape, pin_memory=device.type == "cuda")
            for layer_id, (moe, _) in layers.items():
                host.put_fused(layer_id, moe.w13_weight.data, moe.w2_weight.data)
        for moe, _ in layers.values():
            # SGLang's tensors (or views) go; the pool and the host store hold the experts now.
            moe.w13_weight.data = torch.empty(0, dtype=dtype, device=device)
            moe.w2_weight.data = torch.empty(0, dtype=dtype, device=device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

        pool_bytes = plan.pool_bytes
        if pool_bytes is None:
            pool_bytes = int(profile_bytes())
            longest = plan.check_pool_bytes(pool_bytes, flag="--mem-fraction-static (the GPU memory SGLang leaves "
                                            "for KV)", like_sglang=True)
            if longest < plan.request_tokens:
                logger.warning(
                    "sglang-rimuru static pool: KV holds about %d tokens beside the resident experts, less than "
                    "the %d-token context; requests are capped at the KV size, as SGLang caps them without the "
                    "pool (fewer resident experts give KV more room)", longest, plan.request_tokens)
        geometry = PoolGeometry(
            total_bytes=pool_bytes, expert_page_bytes=plan.expert_page_bytes, kv_page_bytes=plan.kv_page_bytes
        )
        page_pool = UnifiedPagePool(geometry)
        dummy = page_pool.alloc_kv_pages(1, owner=DUMMY_SLOT_OWNER)
        if dummy != [0]:
            raise RuntimeError(f"KV slot 0 must be the first KV page of the pool, got {dummy}")
        buffer = PoolBuffer(geometry, device)
        if device.type == "cuda" and not host.pinned:
            # Page-locked only now, after the pool took its memory: pinning maps the host pages
            # into the GPU's address space, and that map lives in GPU memory (41 MiB more in use
            # than plain SGLang at SGLang's "Load weight end" with 23.2 GiB pinned during load,
            # bench/RESULTS.md), which then comes out of what SGLang leaves for activations,
            # not out of the KV. Logged, so every run measures it.
            free = torch.cuda.mem_get_info(device)[0]
            host.pin()
            taken = free - torch.cuda.mem_get_info(device)[0]
            logger.info("sglang-rimuru host store: %.3f GiB page-locked in place after the pool was sized, "
                        "taking %.1f MiB of GPU memory (%s)", host.nbytes / GIB, taken / (1 << 20), pin_kind())
            card_cap.follow(force=True)  # an emulated card's cap (bench only): that memory is outside torch
        ranking = (
            load_ranking(config.expert_ranking, shape) if config.expert_ranking else ExpertRanking.default(shape)
        )
        # The pool's placement, and the scheduler side's view of it (the adjuster's in elastic mode)
        residency = ExpertResidency(shape, ranking, plan.offload_limit)
        # elastic: buffers for what is offloaded at start, not the limit (plan.start_buffer_slots)
        plan = dataclasses.replace(plan, load_buffer_slots=plan.start_buffer_slots(
            page_pool.free_expert_page_count(), config.adjuster_evict_low_water))
        load_buffers = LoadBuffers(shape, page_pool, slots=plan.buffer_slots)
        sglang_layout = cls._sglang_layout(config)
        cls._place_residents(plan, config, shape, page_pool, ranking, residency, sglang_layout)
        gates = {layer_id: gate for layer_id, (_, gate) in layers.items()}
        # The TP worker's own residency and load buffers, built from plain page ids: the
        # worker side shares no mutable object with the scheduler side (adjuster/README.md)
        manager = ExpertManager(
            shape, buffer, ExpertResidency(shape, ranking, plan.offload_limit, resident=residency.placement()),
            host, LoadBuffers.of_pages(shape, load_buffers.slots, load_buffers.all_pages()), gates, device)
        kernel = "torch (CPU)"
        if device.type == "cuda":
            manager.kernel_hooks, kernel = cls.kernel_hooks(config, layers, shape, server_args, device)
        manager.upload_resident()
        elastic = None
        if config.mode == "elastic":
            prefill_graphs = (device.type == "cuda" and not server_args.disable_cuda_graph
                              and not server_args.disable_prefill_cuda_graph)
            elastic = cls._build_elastic(config, page_pool, residency, ranking, manager, model_runner.ps.tp_rank,
                                         _largest_replayed_prefill(server_args) if prefill_graphs else 0)
        runtime = cls(
            config=config,
            plan=plan,
            geometry=geometry,
            page_pool=page_pool,
            buffer=buffer,
            shape=shape,
            residency=residency,
            manager=manager,
            device=device,
            elastic=elastic,
        )
        _ACTIVE = runtime
        if config.cpu_experts:
            runtime.cpu_split = cls._build_cpu_split(config, manager, host, device, model_runner.ps.tp_size,
                                                     server_args)
        if sglang_layout:
            kernel += runtime.use_sglang_moe(layers)
        stats = page_pool.stats()
        logger.info(
            "sglang-rimuru %s pool: %.3f GiB in %d expert pages of %d B; %d resident experts "
            "(%s of %d per layer x %d layers), load buffers 2 x %d, KV now %d tokens, at most %d; "
            "%d experts (%.3f GiB) in host memory, at most %d a layer out of the pool "
            "(--rimuru-expert-offload-limit); ranking: %s; MoE kernel: %s",
            config.mode,
            geometry.pool_bytes / GIB,
            geometry.num_expert_pages,
            geometry.expert_page_bytes,
            residency.num_resident(),
            _range(residency.num_resident(l) for l in shape.layer_ids),
            shape.num_experts,
            len(shape.layer_ids),
            plan.buffer_slots,
            runtime.kv_tokens_now,
            runtime.kv_capacity_tokens,
            len(shape.layer_ids) * shape.num_experts,
            host.nbytes / GIB,
            plan.offload_limit,
            config.expert_ranking or "expert index order",
            kernel,
        )
        for layer_id in shape.layer_ids[:4]:
            logger.info("sglang-rimuru layer %d resident experts: %s", layer_id, residency.resident(layer_id))
        logger.debug("sglang-rimuru pool stats: %s", stats)
        if os.environ.get(read_probe.PROBE_ENV, "0") not in ("", "0"):
            # diagnostic: the rate this process's own host store gives in-place reads
            logger.info(read_probe.describe(read_probe.probe_in_place(manager)))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return runtime

    @staticmethod
    def _build_cpu_split(config: RimuruConfig, manager: ExpertManager, host: HostExpertStore, device,
                         tp_size: int, server_args) -> CpuSplit:
        """``--rimuru-cpu-experts``: the split, its tables attached to the manager's, its host
        thread started (before SGLang captures its graphs: their warm-up passes run it)."""
        problems = config.cpu_split_problems(device.type, tp_size,
                                             getattr(server_args, "enable_deterministic_inference", False))
        if not manager.host_reads:
            problems.append("the host store is not pinned (offloaded experts are not read in place)")
        if problems:
            raise ValueError(f"--rimuru-cpu-experts {config.cpu_experts}: " + "; ".join(problems))
        threads = config.cpu_threads or max(1, len(os.sched_getaffinity(0)) - 2)
        if threads > 1:
            # each host thread runs its experts' matmuls alone: torch's own intra-op team inside
            # every small matmul halved the host's rate (cpu_experts.py); process-wide
            torch.set_num_threads(1)
        # the GPU's read time of one offloaded expert: what a layer's split must beat (the gates)
        expert_ms = manager.shape.expert_bytes / (_in_place_read_gbps(device) * 1e6)
        split = CpuSplit(manager.shape, host, device, share=config.cpu_share, min_tokens=config.cpu_min_tokens,
                         max_tokens=config.cpu_max_tokens, threads=threads, expert_ms=expert_ms,
                         engine=config.cpu_engine)
        manager.attach_cpu_split(split)
        split.start()
        logger.info("sglang-rimuru CPU split: %s of each layer's offloaded experts on %d host threads (%s) in "
                    "passes of %d-%d tokens (now %s a layer); a layer splits from the batch at which its offloaded "
                    "experts' reads (%.3f ms an expert) take longer than the host's measured time; torch "
                    "intra-op threads %d",
                    ("the count balancing host and GPU (auto)" if config.cpu_share is None
                     else f"{config.cpu_share:.2f}"), split.threads, config.cpu_engine, config.cpu_min_tokens,
                    config.cpu_max_tokens, _range(split.host_counts()), expert_ms, torch.get_num_threads())
        if config.cpu_max_tokens > config.zero_copy_max_tokens:
            # passes past the in-place range copy their offloaded experts (moe_forward): there
            # the split leaves its host experts uncopied (ExpertManager.forward_copy_path)
            logger.info("sglang-rimuru CPU split: passes of %d-%d tokens copy the GPU's offloaded experts "
                        "(past --rimuru-zero-copy-max-tokens %d) and split with the host's left uncopied",
                        config.zero_copy_max_tokens + 1, config.cpu_max_tokens, config.zero_copy_max_tokens)
        return split

    def check_cpu_split(self) -> None:
        """Before each pass: the host side is alive, and the split's tables still follow the
        manager's. A split table the manager stopped rewriting keeps pages the pool has since
        given to KV, which the GPU would read as weights (fast, and wrong: the thirty-seventh
        session's first split runs, bench/RESULTS.md)."""
        if self.manager.cpu_split is not self.cpu_split:
            raise CpuSplitFailed("the CPU split's tables no longer follow the expert manager's (detached)")
        self.cpu_split.check()
        self.cpu_split.regate()

    @staticmethod
    def _sglang_layout(config: RimuruConfig) -> bool:
        """Static mode with the exact kernel (given, or ``auto``'s pick in static mode) places
        layers that keep every expert in SGLang's layout, for SGLang's own MoE (``use_sglang_moe``).
        ``SGLANG_RIMURU_PAGED_ONLY=1`` keeps the paged kernel everywhere (A/B runs)."""
        return (config.mode == "static" and config.moe_kernel in ("exact", "auto")
                and os.environ.get("SGLANG_RIMURU_PAGED_ONLY", "0") in ("", "0"))

    def use_sglang_moe(self, layers) -> str:
        """Point SGLang's ``w13_weight`` / ``w2_weight`` of every layer that holds all its
        experts in SGLang's layout at the pool's pages (``ExpertManager.sglang_weights``)
        and let SGLang's own MoE compute those layers (the ``experts.moe_core`` seam
        hands them back to it). Why: with every expert resident the paged kernel took
        1.054x and 1.042x plain SGLang's decode step at Qwen1.5-MoE batch 8 and 128
        beside two plain servers within 1 % (bench/RESULTS.md, eleventh session); SGLang's
        own path on its own layout is its speed and its bits. Static only: the residency
        never changes, so the views never go stale (a captured graph keeps them).
        Returns the start line's words for it."""
        done = []
        for layer_id, (moe, _) in layers.items():
            views = self.manager.sglang_weights(layer_id)
            if views is None:
                continue
            moe.w13_weight.data, moe.w2_weight.data = views
            done.append(layer_id)
        self.sglang_moe_layers = frozenset(done)
        return (f"; {len(done)} of {len(layers)} layers keep every expert in SGLang's layout and run "
                f"SGLang's own MoE on the pool's pages")

    @staticmethod
    def _place_residents(plan: PoolPlan, config: RimuruConfig, shape: MoEShape, page_pool, ranking,
                         residency, sglang_layout: bool = False) -> None:
        """The experts resident at start: a fixed count per layer, or (elastic without
        ``--rimuru-resident-experts``) as many as fit, the rest chosen as the
        adjuster chooses victims (least probable first, ties spread over layers).
        ``sglang_layout``: full layers in SGLang's layout (``ExpertResidency.place_all_but``)."""
        if plan.resident_per_layer is not None:
            try:
                residency.place_initial(page_pool, plan.resident_per_layer, sglang_layout=sglang_layout)
            except NotEnoughPagesError as exc:
                raise PlanError(str(exc)) from None
            return
        from sglang_rimuru.adjuster import pick_offloaded_at_start

        total = plan.residents_at_start(page_pool.free_expert_page_count(), config.adjuster_evict_low_water)
        n_out = len(shape.layer_ids) * shape.num_experts - total
        residency.place_all_but(page_pool, pick_offloaded_at_start(shape.layer_ids, ranking, plan.offload_limit,
                                                                   n_out))

    @staticmethod
    def kernel_hooks(config: RimuruConfig, layers, shape: MoEShape, server_args,
                     device: torch.device) -> tuple[KernelHooks, str]:
        """The paged kernel's hooks on CUDA for ``--rimuru-moe-kernel``, and the start line's words for them.

        ``auto`` picks one of the two below (``choose_moe_kernel``: elastic mode with a
        tuned table runs ``fast``, everything else ``exact``).

        * ``exact``: SGLang's launch configs (up and down), ``silu_and_mul`` and
          top-k combine (``sglang_moe.py``): outputs bit-equal to ``--rimuru-mode off``;
          loud if SGLang moved them.
        * ``fast``: ``KernelHooks()``, the kernel's own defaults: its config tables
          (``rimuru_kernels/configs``, looked up by E, N = the per-shard
          intermediate size and the token count; ``default.json`` for a shape or
          GPU without a table, which ``auto`` takes only where it fits the GPU's
          shared memory), SiLU*up fused into the gate/up GEMM, its Triton
          top-k sum. Refused for layers with a ``routed_scaling_factor`` other
          than 1, which that sum does not apply.
        """
        from rimuru_kernels import moe_config

        scales = {getattr(moe.moe_runner_config, "routed_scaling_factor", None) for moe, _ in layers.values()}
        if len(scales) > 1:
            raise RuntimeError(f"--rimuru-mode: MoE layers use different routed_scaling_factor values {scales}")
        scale = scales.pop()
        tables = tuned = None
        fits, sglang_tuned = True, False
        if config.moe_kernel != "exact":  # the fast kernel's tables for this shape on this GPU
            name = moe_config.device_name(device)
            up, down = moe_config.config_files(shape.num_experts, shape.inter, name)
            tables = up.name + (f" + {down.name}" if down else "")
            tuned = None if up.name == moe_config.DEFAULT_CONFIG_FILE else tables
            if config.moe_kernel == "auto" and config.mode == "elastic":  # what auto weighs there
                fits = moe_config.tables_fit(shape.num_experts, shape.inter, name,
                                             moe_config.device_shared_bytes(device))
                if tuned is None:
                    from rimuru_patches.unified_pool.sglang_moe import sglang_has_tuned_table

                    sglang_tuned = sglang_has_tuned_table(shape.num_experts, shape.inter, shape.dtype)
        kernel, why = choose_moe_kernel(
            config.moe_kernel, config.mode,
            deterministic=bool(getattr(server_args, "enable_deterministic_inference", False)),
            tuned_table=tuned, routed_scaling_factor=scale, table_fits=fits, sglang_tuned=sglang_tuned)
        chosen = "" if config.moe_kernel != "auto" else f"auto -> {why}: "
        if kernel == "fast":
            if scale not in (None, 1.0):
                raise RuntimeError(f"--rimuru-moe-kernel fast: the MoE layers scale their output by "
                                   f"routed_scaling_factor {scale}, which the kernel's top-k sum does not apply; "
                                   "use --rimuru-moe-kernel exact")
            return KernelHooks(), f"{chosen}fast (configs {tables}; SiLU*up fused, Triton top-k sum)"
        return (RimuruRuntime._sglang_kernel_hooks(shape, server_args, scale),
                f"{chosen}exact (SGLang's configs, silu_and_mul and top-k sum: bit-equal to --rimuru-mode off)")

    @staticmethod
    def _sglang_kernel_hooks(shape: MoEShape, server_args, scale: float | None) -> KernelHooks:
        """SGLang's configs, SiLU*up and combine for the paged kernel (CUDA); loud if SGLang moved them."""
        from rimuru_patches.unified_pool.sglang_moe import sglang_kernel_hooks

        if getattr(server_args, "enable_fused_moe_sum_all_reduce", False) and shape.top_k > 2:
            logger.warning(
                "sglang-rimuru: --enable-fused-moe-sum-all-reduce: SGLang's down GEMM adds atomically into "
                "its output; the paged kernel reduces top-k as SGLang does without the flag"
            )
        return sglang_kernel_hooks(
            num_experts=shape.num_experts,
            hidden=shape.hidden,
            inter=shape.inter,
            top_k=shape.top_k,
            dtype=shape.dtype,
            routed_scaling_factor=scale,
        )

    @staticmethod
    def _build_elastic(config: RimuruConfig, page_pool, residency, ranking, manager, tp_rank: int,
                       prefill_graph_tokens: int = 0):
        """``prefill_graph_tokens``: the longest prefill pass a captured graph replays
        (0: prefill graphs off, prefills run eagerly anyway)."""
        from sglang_rimuru.adjuster import Adjuster
        from sglang_rimuru.adjuster.applier import OrderApplier
        from sglang_rimuru.adjuster.controller import ElasticController
        from sglang_rimuru.adjuster.link import OrderLink

        cost = None
        if config.adjuster_policy_name == "cost":
            from sglang_rimuru.adjuster.cost import CostModel

            shape = residency.shape
            graphs = prefill_graph_tokens > 0
            replay_p = (replay_max_probability(prefill_graph_tokens, config.zero_copy_max_tokens, shape.top_k,
                                               shape.num_experts) if graphs else 0.0)
            cost = CostModel.for_expert(shape.expert_bytes, _in_place_read_gbps(manager.device),
                                        base_ms=STEP_PRIOR_MS[0], per_request_ms=STEP_PRIOR_MS[1],
                                        eager_prefill_share=EAGER_PREFILL_SHARE if graphs else 0.0,
                                        replay_max_p=replay_p)
            logger.info("sglang-rimuru cost-aware adjuster: an expert costs %.3f ms per decode step that "
                        "routes to it (%d B over PCIe); step time fitted from decode rounds; %s", cost.expert_ms,
                        shape.expert_bytes,
                        f"an expert out that a token picks with probability above {replay_p:.5f} (uniform: "
                        f"{shape.top_k / shape.num_experts:.5f}) costs {cost.eager_prefill_share:.0%} of "
                        f"throughput (prefill passes of {prefill_graph_tokens} tokens then run without CUDA graphs)"
                        if graphs else "prefill runs eagerly anyway")
        adjuster = Adjuster(config.adjuster_policy(), page_pool, residency, ranking, cost=cost)
        link = OrderLink()
        trace = config.adjuster_trace
        if trace and tp_rank:
            trace = f"{trace}.tp{tp_rank}"
        # scheduler side: the adjuster (pool, its residency view) and the link's scheduler end;
        # worker side: the applier over the manager (its own residency, the tables) and the worker end
        return ElasticController(
            adjuster,
            link.scheduler,
            OrderApplier(manager, link.worker),
            trace_path=trace,
            check_invariants=os.environ.get("SGLANG_RIMURU_CHECK_INVARIANTS") == "1",
        )

    @staticmethod
    def _check_layer(moe, shape: MoEShape) -> None:
        cfg = moe.moe_runner_config
        problems = []
        if moe.moe_ep_size > 1:
            problems.append("expert parallelism")
        if cfg.num_experts != cfg.num_local_experts:
            problems.append(f"{cfg.num_local_experts} local of {cfg.num_experts} experts (fused shared experts?)")
        if (cfg.activation != "silu" or not cfg.is_gated or cfg.apply_router_weight_on_input
                or cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None or cfg.swiglu_limit is not None):
            problems.append(f"activation {cfg.activation} (plain gated silu only)")
        if cfg.no_combine:
            problems.append("no_combine")
        if getattr(moe, "w13_weight_bias", None) is not None:
            problems.append("expert biases")
        expected13 = (shape.num_experts, 2 * shape.inter, shape.hidden)
        if tuple(moe.w13_weight.shape) != expected13:
            problems.append(f"w13_weight {tuple(moe.w13_weight.shape)} (expected {expected13})")
        if problems:
            raise RuntimeError(f"--rimuru-mode: MoE layer {moe.layer_id} uses {', '.join(problems)}, not supported")

    # -- forward ----------------------------------------------------------

    def log_stats_every(self, forwards: int, seconds: float = 60.0) -> None:
        """One line of expert traffic every ``forwards`` forward passes, or after a pass once
        ``seconds`` have gone by since the last line (passes that read offloaded experts
        take ~1 s at Qwen3-30B-A3B's shape: 500 of them outlast a benchmark run)."""
        stats = self.manager.stats()
        now = time.monotonic()
        if stats.forwards % forwards and now - self._stats_logged < seconds:
            return
        self._stats_logged = now
        logger.info(
            "sglang-rimuru experts after %d forwards: %d prefetched, %d prefetch hits (%.0f%%), "
            "%d on-demand loads, %.1f MiB copied host->device; %d layer calls read offloaded experts "
            "in place (outside CUDA graphs); %d routed experts read in place past full load buffers",
            stats.forwards,
            stats.prefetched,
            stats.prefetch_hits,
            100 * stats.prefetch_hit_rate,
            stats.on_demand_loads,
            stats.bytes_copied / (1 << 20),
            stats.in_place_layers,
            stats.in_place_overflow,
        )
        if self.cpu_split is not None:
            cs = self.cpu_split.stats()
            gates = self.cpu_split.open_gates()
            line = cs["line"]
            logger.info("sglang-rimuru CPU split: %d layer requests served, %.2f ms and %.1f routed experts a "
                        "request on the host (recent median %s; line %s); host experts a layer now %s; %d of "
                        "%d layers split, from %s tokens; forward passes so far: %d within its %d-%d tokens, "
                        "%d longer, %d shorter", cs["requests"], cs["host_ms_per_request"],
                        cs["host_experts_per_request"],
                        "not yet measured" if cs["host_ms"] is None else f"{cs['host_ms']:.2f} ms",
                        "-" if line is None else (f"{line[0]:.2f} ms + {line[1]:.3f} an expert" + (
                            "" if cs["design_tokens"] is None else f", balanced at {cs['design_tokens']} tokens")),
                        _range(self.cpu_split.host_counts()), len(gates), len(self.cpu_split.gates()),
                        _range(gates) if gates else "-", cs["passes_within"], self.cpu_split.min_tokens,
                        self.cpu_split.max_tokens, cs["passes_longer"], cs["passes_shorter"])

    def prefill_graph_may_replay(self, num_tokens: int) -> bool:
        """Whether a captured prefill pass of ``num_tokens`` tokens may replay.

        Captured, the MoE reads every routed expert through the home table: resident
        ones from their pages, offloaded ones in place from host memory, once per
        block of tokens. With every expert resident that is exactly what an eager
        pass computes (``moe_forward``'s copy path has nothing to copy), and so it is
        for passes that an eager pass reads in place too: up to
        ``--rimuru-zero-copy-max-tokens`` tokens under uniform routing, more where only
        cold experts are out (``_reads_in_place``). Otherwise the eager copy path moves each offloaded expert across
        PCIe once (the H200's 4.7k-token prefill with experts out: 0.75 s captured,
        0.14 s eager), and without host reads an offloaded row is -1, which a
        replay would read as zero: both run eagerly.

        Replaying when it may matters: with prefill graphs off, elastic's decode
        steps matched plain SGLang's on the H200 (ITL median 7.18 vs 7.28 ms) while
        its eager prefills made TPOT 10.6 against 8.1 ms (bench/RESULTS.md).
        """
        if self.manager.residency.all_resident():
            return True
        return self.manager.host_reads and self._reads_in_place(num_tokens)

    def _reads_in_place(self, num_tokens: int, layer_id: int | None = None) -> bool:
        """Whether a pass of ``num_tokens`` reads the offloaded experts (of ``layer_id``,
        or of every layer) in place: up to ``--rimuru-zero-copy-max-tokens`` under
        uniform routing, longer where only cold experts are out
        (``sglang_rimuru/experts/in_place.py``)."""
        shape = self.manager.shape
        return reads_in_place(num_tokens, self.manager.offloaded_max_p(layer_id), self.config.zero_copy_max_tokens,
                              shape.top_k, shape.num_experts)

    def moe_forward(self, layer, dispatch_output):
        """The MoE of one managed layer, experts read from the pool, the load buffers
        or (in place) pinned host memory.

        Which way (``--rimuru-zero-copy-max-tokens`` = N):

        * under CUDA-graph capture, and for passes whose offloaded experts (of this
          layer) expect about one block of tokens each: in place (``manager.table``:
          resident pages + host pages); under uniform routing the passes of up to N
          tokens, longer ones where only cold experts are out
          (``sglang_rimuru/experts/in_place.py``). Each offloaded expert is read
          about once, so PCIe carries what a copy would, with no host round trip:
          what a decode graph captures and replays.
        * longer eager passes: the copy path (prefetch +
          ``prepare_layer``), where an expert crosses PCIe once instead of once per
          block of tokens. It reads routing on the host, so it cannot be captured:
          SGLang's captured prefill graphs replay only where they compute what
          this path would (``prefill_graph_may_replay``: every expert resident, or
          a pass of up to N tokens), and a prefill runs eagerly otherwise. (Cutting
          the prefill graph around the MoE with SGLang's ``eager_on_graph`` fails:
          Qwen2-MoE runs the routed experts on a side stream, where a segment
          cannot end.)
        """
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[:2]
        lid = layer.layer_id
        in_place = self.manager.host_reads and (
            (x.is_cuda and torch.cuda.is_current_stream_capturing()) or self._reads_in_place(x.shape[0], lid))
        if in_place:
            self.manager.note_in_place(lid)
        if in_place and self.cpu_split is not None and x.is_cuda and self.cpu_split.applies(x.shape[0]):
            # part of the layer's offloaded experts on the host's CPUs (its handshake is captured
            # with the pass; a layer with none offloaded then skips it on the device)
            out = self.cpu_split.forward(lid, x, topk_weights, topk_ids, lambda table: self.manager.compute_cuda(
                lid, x, topk_weights, topk_ids, table, absent_is_zero=True))
        elif in_place:
            out = self.manager.compute(lid, x, topk_weights, topk_ids, self.manager.table(lid))
        else:
            # prefetch, copies and the kernel; where the CPU split takes this pass (its range may
            # reach past the in-place one), its host experts are computed there, not copied
            out = self.manager.forward_copy_path(lid, x, topk_weights, topk_ids)
        return StandardCombineInput(hidden_states=out)
