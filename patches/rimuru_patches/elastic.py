"""The elastic split inside SGLang's scheduler (``--rimuru-mode elastic``).

The round logic lives in ``sglang_rimuru.adjuster`` (``ElasticController``,
built with the pool in ``unified_pool/runtime.py``); these seams feed it from
SGLang 0.5.17's scheduler loop (ledger in ``patches/README.md``):

* ``Scheduler.get_next_batch_to_run`` (after it returns): the round hook. The
  adjuster plans this round's order from the shortfall the round recorded;
  the order goes to the worker over the ZMQ link; the invariant checker's
  copy of the KV capacity follows the split.  At TP > 1 the ranks' orders
  are compared over SGLang's TP CPU group (``tp_agreement``,
  ``sglang_rimuru/adjuster/agreement.py``) in every round that holds a
  request: a mismatch stops the scheduler with one log line naming the round,
  the ranks and their digests.
* ``PrefillAdder.add_one_req`` returning ``NO_TOKEN``: the KV the head of the
  waiting queue lacks (the requests SGLang would admit this round if memory
  allowed, found by SGLang's own ``add_one_req`` on probes with more free KV:
  ``prefill_head.py``) becomes the adjuster's demand until a request gets in;
  once an eviction completes, SGLang's ``batch_is_full`` is cleared so the next
  round tries the prefill again (``controller.py`` says in which round it is
  admitted).
* ``ScheduleBatch.check_decode_mem`` failing: before SGLang retracts running
  requests, evict experts now (no forward pass is running) while the offload
  limit allows; retract only what eviction cannot cover.

The forward-pass half (the worker takes the order at the start of
``ModelRunner.forward`` and acknowledges after it) is in the
``experts.forward_pass`` seam of ``unified_pool``. Both of SGLang's loops
work: with the overlap scheduler (SGLang's default) the previous pass may
still run on the GPU while a round is planned; victims' pages are then
reused only by KV writes of later passes on the same stream, and restore
copies wait for every enqueued pass (``sglang_rimuru/adjuster/applier.py``).
"""

from __future__ import annotations

import json
import logging
import time

from rimuru_patches import pass_timer
from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, register

logger = logging.getLogger(__name__)


def _on(ctx: ProcessContext) -> bool:
    return ctx.rimuru.get("mode") == "elastic"


def _controller():
    from rimuru_patches.unified_pool.runtime import active

    runtime = active()
    return None if runtime is None else runtime.elastic


def _kv_now(alloc) -> int:
    """The KV the split gives now: what KV holds plus what it could take now."""
    return alloc.held_count + alloc.available_size()


def _evictable_tokens(cache) -> int:
    """Full-attention KV tokens the radix cache could evict. SGLang 0.5.17's hybrid
    caches (SWA, Mamba) raise from ``evictable_size`` and count these with
    ``full_evictable_size``; the plain radix cache has only the former."""
    try:
        tokens = cache.evictable_size()
    except NotImplementedError:
        tokens = cache.full_evictable_size()
    return tokens[0] if isinstance(tokens, tuple) else tokens


def _cached_pages(scheduler) -> int:
    """KV pages only the radix cache holds (finished requests' prefixes): no running
    request's KV."""
    return _evictable_tokens(scheduler.tree_cache) // max(1, scheduler.page_size)


def sync_capacity(scheduler) -> None:
    """Point SGLang's fixed copies of the KV capacity at the pool's current one.

    SGLang's idle leak check asserts ``available + evictable + protected +
    session_held == max_total_num_tokens``; with a moving split the right total
    is what KV holds plus what it could take now. ``Scheduler.max_total_num_tokens``
    stays the most KV can ever have (it bounds request lengths), and so does the
    pool-stats observer's copy (a frozen dataclass field; ``_token_usage``
    reports against the KV there is now instead).
    """
    scheduler.invariant_checker.max_total_num_tokens = _kv_now(scheduler.token_to_kv_pool_allocator)


def _token_usage(orig, ctx):
    """``#token`` and token usage (decode log, /metrics) of the KV there is now.

    SGLang computes ``used = max_total - available - evictable`` against its
    fixed maximum, so pages the experts hold counted as used tokens: the H200
    run logged "#token: 46125, token usage: 0.98" with one request running.
    """
    import dataclasses

    def _get_token_info(self):
        stats = orig(self)
        total = _kv_now(self.token_to_kv_pool_allocator)
        used = stats.full_num_used - (self.max_total_num_tokens - total)
        return dataclasses.replace(stats, full_num_used=used, full_token_usage=used / total if total else 0.0)

    return _get_token_info


def _after_change(scheduler) -> None:
    """An order completed (after a forward pass, or in the round hook)."""
    sync_capacity(scheduler)
    ctl = _controller()
    _Metrics.publish(ctl, changed=True)
    if ctl.freed:
        # SGLang stops trying prefills after one is refused for lack of KV
        # (batch_is_full) until a request finishes; pages freed by eviction must
        # let it try again in the next round.
        ctl.freed = False
        scheduler.running_batch.batch_is_full = False


def _cache_gives_way(scheduler, ctl) -> None:
    """Nothing waits: evict cached prefixes (LRU first) so offloaded experts can come back,
    and so a running request's growth takes cache pages before an expert's. (Every
    round that nothing waits: the imports only when there is something to evict.)"""
    pages = ctl.pages_wanted_from_cache()
    cache = scheduler.tree_cache
    if pages and _evictable_tokens(cache) > 0:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        from rimuru_patches.unified_pool.runtime import active

        cache.evict(EvictParams(num_tokens=pages * active().plan.kv_pages_per_expert_page))
        sync_capacity(scheduler)


def tp_agreement(tp_group):
    """The ranks' orders compared across SGLang's TP group (its CPU side, gloo):
    one all-gather of 3 int64 per rank per busy round; None at TP = 1.

    ``tp_group``: the scheduler's ``GroupCoordinator`` (``world_size``,
    ``rank_in_group``, ``cpu_group``), the group SGLang broadcasts requests over.
    """
    if tp_group.world_size == 1:
        return None
    import torch
    import torch.distributed as dist

    from sglang_rimuru.adjuster.agreement import TPAgreement

    size, cpu_group = tp_group.world_size, tp_group.cpu_group

    def gather(row):
        out = torch.empty(size * len(row), dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor(row, dtype=torch.int64), group=cpu_group)
        return out.view(size, len(row)).tolist()

    return TPAgreement(gather, tp_group.rank_in_group)


#: this process's scheduler (one per process), set by the round hook: the
#: prefill-demand seam reads its waiting queue and request limit
_scheduler = None


def _attach(scheduler, ctl) -> None:
    """First round: tie the controller to this scheduler."""
    global _scheduler
    _scheduler = scheduler
    ctl.on_change = lambda done: _after_change(scheduler)
    ctl.agreement = tp_agreement(scheduler.tp_group)
    _Metrics.maybe_start(scheduler, ctl)


def _round(orig, ctx):
    def get_next_batch_to_run(self, *args, **kwargs):
        ctl = _controller()
        if ctl is None:
            return orig(self, *args, **kwargs)
        if ctl.on_change is None:
            _attach(self, ctl)
        plan = orig(self, *args, **kwargs)
        if not self.waiting_queue:
            # nothing waits: cached prefixes give way to restores and ahead of the low
            # water, also while requests run (as load falls the cache of finished requests
            # would otherwise hold the pages, and the running tail keeps paying for its
            # offloaded experts or evicts one to grow)
            ctl.clear_demand()
            _cache_gives_way(self, ctl)
        busy = plan.batch_to_run is not None or bool(self.waiting_queue) or not plan.running_batch.is_empty()
        running = len(plan.running_batch.reqs) if plan.running_batch is not None else 0
        batch = plan.batch_to_run
        if batch is not None and batch is not plan.running_batch and batch.forward_mode.is_extend():
            running += len(batch.reqs)  # this round's prefill joins the decode batch next
        if ctl.adjuster.cost is not None:
            _StepTiming.round(self, ctl, batch)
        ctl.round(forward_follows=plan.batch_to_run is not None, waiting=len(self.waiting_queue), busy=busy,
                  running=running, cached=_cached_pages(self))
        sync_capacity(self)
        if ctl.freed:  # evictions done in this hook: the next round may admit again
            ctl.freed = False
            plan.running_batch.batch_is_full = False
        _Metrics.publish(ctl)
        return plan

    return get_next_batch_to_run


def _prefill_shortfall(orig, ctx):
    from sglang.srt.managers.schedule_policy import AddReqResult

    from rimuru_patches.prefill_head import head_demand

    def add_one_req(self, req, *args, **kwargs):
        result = orig(self, req, *args, **kwargs)
        ctl = _controller()
        if ctl is None:
            return result
        if result is AddReqResult.NO_TOKEN:
            # SGLang's loop stops here: what the queue's head lacks, found by SGLang's own
            # add_one_req on probes with more free KV (prefill_head.py)
            sched = _scheduler
            queue = sched.waiting_queue if sched is not None else [req]
            limit = (sched.get_num_allocatable_reqs(len(self.running_batch.reqs))
                     if sched is not None and self.running_batch is not None else None)
            head = head_demand(orig, self, req, queue, limit, args, kwargs)
            if head is None:
                ctl.clear_demand()  # more KV would admit nothing more this round
            else:
                ctl.note_demand(self.token_to_kv_pool_allocator.available_size() + head.extra_tokens,
                                requests=head.requests)
                logger.debug("sglang-rimuru: prefill refused for KV: the head of %d requests lacks %d tokens "
                             "(%d probes)", head.requests, head.extra_tokens, head.probes)
        elif result is AddReqResult.CONTINUE:
            ctl.clear_demand()
        return result

    return add_one_req


def _decode_shortfall(orig, ctx):
    def check_decode_mem(self, selected_indices=None):
        ok = orig(self, selected_indices)
        ctl = _controller()
        while not ok and ctl is not None:
            need = self.new_tokens_required_next_decode(selected_indices)
            if not ctl.urgent(need, running=len(self.reqs)):  # the queue: as of the last round
                break  # the offload limit is reached: SGLang retracts as usual
            ok = orig(self, selected_indices)
        return ok

    return check_decode_mem


class _StepTiming:
    """Decode step times for the cost-aware adjuster (``--rimuru-adjuster-policy cost``).

    The time between two consecutive decode rounds is one decode step (under the
    overlap scheduler, whichever of the GPU pass and the CPU's scheduling is
    longer: what bounds throughput), with the offloaded experts it was expected
    to read. It is recorded only when the round before those two was a decode
    round as well: under the overlap scheduler round ``i + 1`` starts once pass
    ``i - 1`` has finished, so the first decode interval after a prefill is
    mostly that prefill (on the H200 such intervals averaged 144-218 ms against
    decode steps of ~10 ms, and made one more request look free: bench/RESULTS.md).
    With ``--rimuru-adjuster-trace PATH`` every timed step is also written, every
    ``REFIT_ROUNDS`` rounds, to ``step_record_path(PATH)`` (one JSON line of
    ``[batch, ms, expected reads]`` rows, under ``"gpu"`` the ``[batch, GPU ms]``
    of the decode passes finished since the last dump, and under ``"passes"`` the
    ``[kind, batch, GPU ms]`` of the prefill passes, extend or mixed:
    ``pass_timer.py``): the per-step record that checks the cost model's price of
    one more request, whether the GPU or the CPU set a step, and how many tokens
    the passes made (a run stopped at its budget still has them). It is also
    written once ``DUMP_S`` has passed since the last write (passes of a second
    make 256 rounds minutes long): a server stopped between two writes loses at
    most that much of it. Every ``REFIT_ROUNDS`` rounds the
    fit (step line and per-expert PCIe time) replaces the cost model's; at TP > 1
    rank 0's fit is broadcast over SGLang's TP CPU group so that every rank
    plans with the same numbers (the orders must agree).
    """

    REFIT_ROUNDS = 256
    DUMP_S = 20.0
    dumped = float("-inf")
    LOG_S = 60.0  # the fit's log line, at most this often
    logged = float("-inf")
    clock = None
    last: tuple[float, int] | None = None  # (time, batch size) of the last round, if decode
    before_last = False  # the round before that was a decode round too
    reads_key: tuple | None = None  # (last order seq, orders in flight, batch) of ``reads``
    reads = 0.0
    batch_now: int | None = None  # the last decode round's batch: the fit's line is the tangent there
    rounds = 0
    pending: list | None = None  # [batch, ms, reads] timed since the last dump (with a trace)
    gpu_pending: list = []  # [batch, GPU ms] of decode passes since the last dump (with a trace, on CUDA)
    passes_pending: list = []  # [kind, batch, GPU ms] of extend and mixed passes since then
    mem_pending: list = []  # [kind, batch, peak allocated MiB, reserved MiB] of passes since then

    @classmethod
    def round(cls, scheduler, ctl, batch) -> None:
        import dataclasses

        from sglang_rimuru.adjuster.cost import RoutedExperts, StepClock, step_record_path

        adjuster = ctl.adjuster
        cost = adjuster.cost
        if cls.clock is None:
            # the resident step grows with the distinct experts a batch routes to, not the batch
            # (cost.py StepClock): the line the adjuster prices with is that curve's tangent
            cls.clock = StepClock(prior=(cost.base_ms, cost.per_request_ms, cost.expert_ms),
                                  routed=RoutedExperts(adjuster.token_probabilities()))
        now = time.monotonic()
        decode = batch is not None and batch.forward_mode.is_decode()
        if decode and cls.last is not None and cls.before_last:
            # the step's expected offloaded reads (experts out now ~ out then) keep
            # their PCIe time out of the per-request slope (cost.py: the ratchet)
            key = (adjuster.last_seq, len(adjuster.in_flight), cls.last[1])
            if key != cls.reads_key:  # the set out changes only with orders: once per order and batch
                cls.reads_key = key
                cls.reads = cost.expected_reads(adjuster.offloaded_token_probabilities(), cls.last[1])
            reads = cls.reads
            ms = 1e3 * (now - cls.last[0])
            cls.clock.record(cls.last[1], ms, reads)
            if ctl.trace_path:
                if cls.pending is None:
                    cls.pending = []
                    open(step_record_path(ctl.trace_path), "w").close()  # one record per server run
                cls.pending.append([cls.last[1], round(ms, 3), round(reads, 2)])
        if ctl.trace_path and cls.pending is not None and (timer := pass_timer.current()) is not None:
            for b, ms, kind in timer.collect():
                if kind == "decode":
                    cls.gpu_pending.append([b, ms])
                else:
                    cls.passes_pending.append([kind, b, ms])
            cls.mem_pending += timer.collect_memory()
        cls.before_last = cls.last is not None
        cls.last = (now, len(batch.reqs)) if decode else None
        if decode:
            cls.batch_now = len(batch.reqs)
        cls.rounds += 1
        refit = cls.rounds % cls.REFIT_ROUNDS == 0
        if (refit or now - cls.dumped >= cls.DUMP_S) and (cls.pending or cls.gpu_pending or cls.passes_pending):
            cls.dumped = now
            with open(step_record_path(ctl.trace_path), "a") as f:
                f.write(json.dumps({"t": time.time(), "steps": cls.pending, "gpu": cls.gpu_pending,
                                    "passes": cls.passes_pending, "memory": cls.mem_pending}) + "\n")
            cls.pending, cls.gpu_pending, cls.passes_pending, cls.mem_pending = [], [], [], []
        if not refit:
            return
        from rimuru_patches.unified_pool.runtime import active

        runtime = active()
        split = None if runtime is None else runtime.cpu_split
        # the CPU split leaves the GPU only its share of the offloaded reads: the floor on a
        # read's price follows (cost.py StepClock); 0 would be a split that takes them all
        share = 1.0 if split is None else max(split.gpu_read_share(), 1e-3)
        fit = cls.clock.fit(floor_scale=share, at_batch=cls.batch_now)
        group = scheduler.tp_group
        if group.world_size > 1:
            import torch.distributed as dist

            box = [fit]
            dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
            fit = box[0]
        try:
            adjuster.cost = dataclasses.replace(cost, base_ms=fit[0], per_request_ms=fit[1], expert_ms=fit[2])
        except ValueError as e:  # a fit CostModel refuses: keep the last one, say so
            logger.warning("sglang-rimuru cost-aware adjuster: step fit %s refused (%s); keeping %s", fit, e, cost)
            return
        if now - cls.logged >= cls.LOG_S:  # what the evictions are priced with, now and then
            cls.logged = now
            at = cls.clock.tangent_at
            logger.info("sglang-rimuru cost-aware adjuster: decode step %.2f ms + %.3f ms per request + %.3f ms "
                        "per offloaded expert read (%d timed steps)%s%s", *fit, len(cls.clock),
                        "" if at is None else f"; the line is the tangent at batch {at} to the resident step's "
                        "curve in the experts a batch routes to",
                        "" if split is None else f"; the CPU split leaves the GPU {share:.2f} of the offloaded "
                        "experts, the floor on a read's price scaled by it")


class _Metrics:
    """``sglang_rimuru:*`` gauges on SGLang's /metrics (only with --enable-metrics)."""

    gauges: dict | None = None
    labels: dict = {}

    DOCS = {
        "resident_experts": "Routed experts resident in the pool (all MoE layers)",
        "offloaded_experts": "Routed experts in host memory (all MoE layers)",
        "expert_pages": "Pool expert pages holding resident experts",
        "other_expert_pages": "Pool expert pages of the load buffers",
        "kv_split_expert_pages": "Pool expert pages split into KV pages",
        "free_expert_pages": "Whole free pool expert pages",
        "kv_pages_used": "KV pages in use",
        "evictions": "Experts evicted to host memory (cumulative)",
        "restores": "Experts restored into the pool (cumulative)",
        "orders_completed": "Migration orders applied (cumulative)",
        "orders_aborted": "Migration orders refused by the worker (cumulative)",
        "urgent_orders": "Evictions made to avoid retracting decode requests (cumulative)",
        "refused_orders": "Malformed or out-of-sequence orders refused (cumulative)",
        "priced_out_rounds": "Rounds whose eviction the cost model dropped as not worth its PCIe time (cumulative)",
        "restore_priced_out_rounds": "Rounds whose high-water restores the cost model held back while requests "
                                     "waited: the pages hold more requests than the experts' PCIe time costs "
                                     "(cumulative)",
        "bytes_copied": "Host-to-device expert bytes copied (cumulative)",
        "on_demand_loads": "Offloaded experts loaded after routing: load-buffer misses (cumulative)",
        "prefetch_hits": "Offloaded experts found prefetched (cumulative)",
        "cpu_split_host_experts": "Offloaded experts the CPU split computes on the host's CPUs (all MoE layers; "
                                  "0 without --rimuru-cpu-experts)",
        "cpu_split_layers_split": "MoE layers whose CPU split gate opens within its batch range",
        "cpu_split_host_ms": "The host's median time a CPU split layer request, over its last 32 (ms; 0 until "
                             "measured)",
        "cpu_split_requests": "CPU split layer requests the host served (cumulative)",
        "cpu_split_passes_within": "Forward passes within the CPU split's token range (cumulative)",
        "cpu_split_passes_longer": "Forward passes longer than the CPU split's token range, which it takes no "
                                   "part in (cumulative)",
    }

    @classmethod
    def maybe_start(cls, scheduler, ctl) -> None:
        if not getattr(scheduler.metrics_reporter, "enable_metrics", False):
            return
        from prometheus_client import Gauge

        cls.labels = {"tp_rank": str(scheduler.ps.tp_rank)}
        cls.gauges = {
            k: Gauge(f"sglang_rimuru:{k}", doc, labelnames=list(cls.labels), multiprocess_mode="mostrecent")
            for k, doc in cls.DOCS.items()
        }

    last = 0.0

    @classmethod
    def publish(cls, ctl, changed: bool = False) -> None:
        """Set the gauges after a change, else at most once a second (idle rounds spin fast)."""
        if cls.gauges is None:
            return
        now = time.monotonic()
        if not changed and now - cls.last < 1.0:
            return
        cls.last = now
        from rimuru_patches.unified_pool.runtime import active

        values = ctl.snapshot()
        runtime = active()
        stats = runtime.manager.stats()
        values.update(bytes_copied=stats.bytes_copied, on_demand_loads=stats.on_demand_loads,
                      prefetch_hits=stats.prefetch_hits, **cls.split_values(runtime.cpu_split))
        for k, g in cls.gauges.items():
            g.labels(**cls.labels).set(values[k])

    @staticmethod
    def split_values(split) -> dict[str, float]:
        """The CPU split's gauges (zeros without it)."""
        if split is None:
            return dict(cpu_split_host_experts=0, cpu_split_layers_split=0, cpu_split_host_ms=0.0,
                        cpu_split_requests=0, cpu_split_passes_within=0, cpu_split_passes_longer=0)
        cs = split.stats()
        return dict(cpu_split_host_experts=sum(split.host_counts()),
                    cpu_split_layers_split=len(split.open_gates()),
                    cpu_split_host_ms=cs["host_ms"] or 0.0, cpu_split_requests=cs["requests"],
                    cpu_split_passes_within=cs["passes_within"], cpu_split_passes_longer=cs["passes_longer"])


_SCHED = "sglang.srt.managers.scheduler:Scheduler"
for _name, _target, _why, _build in (
    ("elastic.round", f"{_SCHED}.get_next_batch_to_run", "plan each round's migration order after the batch is chosen", _round),
    ("elastic.prefill_shortfall", "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req", "a prefill refused for lack of KV is the round's shortfall", _prefill_shortfall),
    ("elastic.decode_shortfall", "sglang.srt.managers.schedule_batch:ScheduleBatch.check_decode_mem", "evict experts before SGLang retracts decode requests", _decode_shortfall),
    ("elastic.token_usage", "sglang.srt.managers.scheduler_components.pool_stats_observer:SchedulerPoolStatsObserver._get_token_info", "report KV usage against the KV the split gives now", _token_usage),
):
    register(Seam(name=_name, target=_target, why=_why, build=_build, applies=_on))
