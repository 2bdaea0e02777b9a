"""``ElasticController``: one scheduler process's elastic split, round by round.

The scheduler's side of the migration-order protocol: it ties the ``Adjuster``
(what to move; the pool and the adjuster's own residency view) and its end of
the link (``SchedulerEnd``: orders out, acks in) to the points of SGLang's
scheduler loop where the integrator (``patches/rimuru_patches/elastic``) calls
it.  The worker's side (``OrderApplier`` over the ``ExpertManager``, with their
own residency and page tables) is reached only through the link's bytes, plus
``worker``: in SGLang 0.5.17 the TP worker runs in this thread, so the
controller gives it its turns (``worker.take_orders()`` at the start of a pass,
``worker.finish(block)`` after it or when an order must be applied now) and
calls nothing else on it.  A worker in another process would take its turns on
its own; ``worker`` would then only wait for the acks.

    note_demand(n)      the scheduler refused a prefill: the head of its waiting
                        queue needs n KV pages in all (what is free now + what
                        it lacked); the demand stands until a request is
                        admitted or the queue empties (``clear_demand``),
                        because SGLang does not retry a refused prefill every
                        round
    round(...)          after the round's batch is chosen: plan one order, send
                        it; at TP > 1 compare the orders across the ranks
                        (``agreement``, ``agreement.py``) in rounds that hold
                        a request
    before_forward()    start of the forward pass: the worker takes the order
    after_forward()     end of the pass: acks come back, orders complete
    urgent(n)           a decode step needs n KV pages in all and they are not
                        free: evict and apply now, before SGLang retracts requests

When do pages freed by an eviction reach a waiting request?  The order
planned at the end of round r's scheduling rides along forward pass r (which
may still read the victims); its pages are free when that pass ends, so the
request refused in round r is admitted in round r + 1 at the earliest (the
same round when round r runs no forward pass: the order is applied at once).
Decode shortfalls cannot wait a round (SGLang would retract requests now):
between two passes no pass can read a victim, so ``urgent`` applies the
eviction immediately and the decode step gets the pages in the same round.

Radix cache first, experts second: SGLang counts evictable radix-cache tokens
as available (``available + evictable``), so a shortfall reaches the adjuster
only when evicting every unlocked cached prefix would not be enough.  Cached
prefixes are the cheaper loss (a recomputation on a later hit); an evicted
expert costs a host copy in every pass that routes to it.  For the same
reason, whenever nothing waits (requests may be running) cached prefixes
give way to restores, and to the low water before an expert does:
``pages_wanted_from_cache`` tells the integrator how many expert pages to free
from the radix cache.  (Measured on the H200: as a
burst drained, the cache of finished requests held every page and the last
requests ran at 80 tok/s with 480 experts out.)  While requests wait,
restores take only whole free expert pages.

No SGLang import.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Protocol

from .agreement import TPAgreement
from .link import SchedulerEnd
from .orders import MigrationOrder, encode

__all__ = ["ElasticController", "WorkerTurns"]

logger = logging.getLogger(__name__)


class WorkerTurns(Protocol):
    """How the scheduler side lets an in-thread TP worker act (``OrderApplier``)."""

    def take_orders(self) -> object:
        """Take the orders on the link (start of a pass, or before ``finish``)."""

    def finish(self, block: bool = True) -> object:
        """Apply and acknowledge what the worker took (``block``: wait for its copies)."""


def price_text(price, margin: float) -> str:
    """The numbers behind a priced-out prefill shortfall (``Adjuster.last_price``), for its
    log line: what a reader needs to tell a loss from a gain under the margin."""
    if price is None:
        return ""
    head = (f"; priced at batch {price.batch}: {price.victims} experts out admit "
            f"{price.admits if price.after is not None else 'none'}")
    kv = f"{price.kv_per_request:.0f} KV pages a running request"
    if price.after is None:
        return f"{head} ({kv})"
    gain = (price.after / price.reference - 1.0) * 100 if price.reference > 0 else float("inf")
    larger = {None: "not asked", True: "pays", False: "does not pay"}[price.larger_move]
    return (f"{head}, {price.reference * 1e3:.4g} -> {price.after * 1e3:.4g} decode tok/s ({gain:+.2f} %, "
            f"margin {margin * 100:g} %), a larger move {larger}; {kv}")


class ElasticController:
    #: a priced-out shortfall repeats every round it lasts: one log line per this many seconds
    PRICED_OUT_LOG_S = 30.0

    def __init__(self, adjuster, link: SchedulerEnd, worker: WorkerTurns, *,
                 trace_path: str | None = None, check_invariants: bool = False) -> None:
        self.adjuster = adjuster
        self.link = link
        #: the in-thread worker's turns; never its state (see the module docstring)
        self.worker = worker
        self.trace_path = trace_path
        self.check_invariants = check_invariants
        #: called after the split changed (the integrator re-syncs SGLang's capacity copies)
        self.on_change = None
        #: TP > 1: each round's orders compared across the ranks (set by the integrator)
        self.agreement: TPAgreement | None = None
        self._round = 0
        self._demand = 0
        self._demand_requests = 0
        #: decode requests running (what an eviction's PCIe time slows down)
        self._running = 0
        #: KV pages only the radix cache holds (the last round's count)
        self._cached = 0
        #: pages were freed by evictions since the integrator last looked (it lets
        #: SGLang retry prefills it gave up on)
        self.freed = False
        self._waiting = 0
        self._n = Counter(orders_completed=0, orders_aborted=0, evictions=0, restores=0,
                          urgent_orders=0, refused_acks=0)
        #: orders the worker refused, as its acks say (aborted ones and ones not in flight)
        self._refused = 0
        #: rounds whose eviction the cost model dropped, and when that was last logged
        self._priced_out = 0
        self._priced_out_logged = float("-inf")
        #: rounds whose high-water restores the queue's price refused (requests ran and waited)
        self._restore_priced_out = 0
        if trace_path:
            open(trace_path, "w").close()  # one trace per server run

    # ---------------------------------------------------------------- scheduler side

    def note_demand(self, kv_pages: int, requests: int = 1) -> None:
        """The scheduler could not admit the head of its waiting queue (``requests``
        requests), which needs ``kv_pages`` KV pages in all."""
        self._demand = int(kv_pages)
        self._demand_requests = max(1, int(requests))

    def clear_demand(self) -> None:
        """A waiting request got in, or nothing waits any more (or more KV would admit nothing)."""
        self._demand = 0
        self._demand_requests = 0

    @property
    def demand(self) -> int:
        return self._demand

    def round(self, *, forward_follows: bool, waiting: int = 0, busy: bool = True,
              running: int = 0, cached: int = 0) -> MigrationOrder | None:
        """End of a round's scheduling: plan this round's order and send it to the worker.

        ``forward_follows``: a forward pass runs in this round (it applies the
        order); otherwise the order is applied now.  ``waiting``: requests in
        SGLang's waiting queue; ``running``: requests in the decode batch (with
        this round's prefill); ``cached``: KV pages only the radix cache holds
        (all three for the cost model and the log).  ``busy``: the scheduler holds a
        request (waiting, running or in this round's batch); at TP > 1 the
        ranks' orders are compared in busy rounds only (``agreement.py`` says
        why that is every rank's same choice), idle rounds' orders with the
        next busy round's.
        """
        self._waiting = waiting
        self._running = running
        self._cached = cached
        # Orders a pass never took are applied now; finished restore copies are acknowledged.
        # Copies still running are not waited for (they overlap the next passes).
        self.worker.take_orders()
        self.worker.finish(block=False)
        self._collect()
        order = self._plan(self._demand)
        if self.agreement is not None and busy:
            # before any pass runs this round's order (or an urgent one of this
            # round): RanksDisagree stops the scheduler
            self.agreement.check()
        if order is not None and not forward_follows:
            self.settle()
        return order

    def urgent(self, kv_pages: int, waiting: int | None = None, running: int | None = None) -> bool:
        """A decode step of ``running`` requests needs ``kv_pages`` KV pages in all,
        more than are free: evict now (see ``applier.py`` for why that is safe
        with a pass still running on the GPU).

        ``waiting`` / ``running``: None keeps the last round's count. The decode
        batch that asks does not see SGLang's queue; an urgent eviction is priced
        against retraction, so the queue only reaches the log and the trace (which
        showed "waiting 0" beside 100 queued requests on the H200 when it was 0).

        Returns True when pages were freed (the caller re-checks its memory).
        """
        if waiting is not None:
            self._waiting = waiting
        if running is not None:
            self._running = running
        self.settle()
        order = self._plan(int(kv_pages), urgent=True)
        if order is None:
            return False
        self._n["urgent_orders"] += 1
        freed = self.settle()
        return any(o.evict for o in freed)

    def pages_wanted_from_cache(self) -> int:
        """Whole free expert pages to make from the radix cache when nothing waits
        (0 with a standing demand or an order in flight).

        While experts are out (and restoring is on): enough for the next restore
        (the restore threshold plus one expert), because a hot expert is worth more
        to the running requests and the next burst than an idle cached prefix.
        Otherwise enough to stay clear of the low water (plus one expert): a running
        request's KV growing into the last free pages would make the low-water rule
        evict an expert the cache could spare, and the next round would restore it
        (seen on the H200: one request alone, an eviction and a restore every 3-6 s).
        """
        adj, res = self.adjuster, self.adjuster.residency
        policy = adj.policy
        if adj.in_flight or self._demand:
            return 0
        target = policy.evict_low_water + policy.pages_per_expert
        if policy.max_restores_per_round and not res.all_resident():
            target = policy.restore_high_water + policy.pages_per_expert
        return max(0, target - adj.page_pool.free_expert_page_count())

    # ---------------------------------------------------------------- the worker's turns

    def before_forward(self) -> None:
        """Start of a forward pass: the worker takes this round's order."""
        self.worker.take_orders()

    def after_forward(self) -> None:
        """End of a forward pass: the worker acknowledges what it applied; the acks
        complete their orders here, so freed pages reach the next round's schedule."""
        # Never wait for restore copies here: they overlap this pass and the next
        # ones; orders whose copies are still running are acknowledged later.
        self.worker.finish(block=False)
        self._collect()

    def settle(self) -> list[MigrationOrder]:
        """Apply and complete everything sent now, waiting for its restore copies
        (safe between passes, also with a pass still running on the GPU: see
        ``applier.py``)."""
        self.worker.take_orders()
        self.worker.finish()
        return self._collect()

    # ---------------------------------------------------------------- observability

    def snapshot(self) -> dict:
        """Counters and the pool's pages by owner, for metrics."""
        pool = self.adjuster.page_pool.stats()
        res = self.adjuster.residency
        return dict(
            resident_experts=res.num_resident(),
            offloaded_experts=len(res.shape.layer_ids) * res.shape.num_experts - res.num_resident(),
            expert_pages=pool.expert_pages,
            other_expert_pages=pool.other_expert_pages,
            kv_split_expert_pages=pool.kv_split_expert_pages,
            free_expert_pages=pool.free_expert_pages,
            kv_pages_used=pool.kv_pages_used,
            refused_orders=self._refused,
            priced_out_rounds=self._priced_out,
            restore_priced_out_rounds=self._restore_priced_out,
            **self._n,
        )

    # ---------------------------------------------------------------- internals

    def _plan(self, short: int, urgent: bool = False) -> MigrationOrder | None:
        round_no = self._round
        load = None
        if self.adjuster.cost is not None:
            from .adjuster import Load

            load = Load(running=self._running, admits=1 if urgent else max(1, self._demand_requests),
                        urgent=urgent, waiting=self._waiting, cached=self._cached)
        order = self.adjuster.plan_round(round_no, short, load) if load is not None \
            else self.adjuster.plan_round(round_no, short)
        last = self.adjuster.last_round
        reason = None if last is None else last.decision.reason
        if reason == "restore_priced_out":
            self._restore_priced_out += 1  # counted, not logged: it stands every round a queue lasts
        if reason == "priced_out":
            self._priced_out += 1
            now = time.monotonic()
            if now - self._priced_out_logged >= self.PRICED_OUT_LOG_S:  # a shortfall repeats every round
                self._priced_out_logged = now
                logger.info("sglang-rimuru round %d: eviction priced out (%s; %d rounds so far): the offloaded "
                            "experts' PCIe time per decode step would cost more than the requests it admits "
                            "(running %d, waiting %d); SGLang queues or retracts instead%s", round_no,
                            "decode short" if urgent else f"R_b={last.short_pages}", self._priced_out,
                            self._running, self._waiting,
                            price_text(self.adjuster.last_price, self.adjuster.cost.margin))
        self._round += 1
        encoded = None if order is None else encode(order)
        if self.agreement is not None:
            self.agreement.planned(round_no, order, encoded)
        if encoded is not None:
            self.link.send_order(encoded)
        return order

    def _collect(self) -> list[MigrationOrder]:
        done = []
        in_flight = {o.seq: o for o in self.adjuster.in_flight}
        for ack in self.link.recv_acks():
            seq = ack.get("seq")
            if not ack.get("ok"):
                self._refused += 1
            order = in_flight.pop(seq, None)
            if order is None:
                self._n["refused_acks"] += 1
                logger.warning("sglang-rimuru: worker refused an order the adjuster did not send "
                               "(seq=%r): %s", seq, ack.get("error"))
                continue
            if ack.get("ok"):
                self.adjuster.complete(order)
                self._n["orders_completed"] += 1
                self._n["evictions"] += len(order.evict)
                self._n["restores"] += len(order.restore)
                done.append(order)
                self._report(order)
            else:
                self.adjuster.abort(order)
                self._n["orders_aborted"] += 1
                logger.error("sglang-rimuru: worker refused migration order seq=%d: %s; "
                             "its reserved pages are freed, the split stays", seq, ack.get("error"))
        if done:
            if self.check_invariants:
                self.adjuster.check_invariants()
            if any(o.evict for o in done):
                self.freed = True
            if self.on_change is not None:
                self.on_change(done)
        return done

    def _report(self, order: MigrationOrder) -> None:
        pool = self.adjuster.page_pool.stats()
        res = self.adjuster.residency
        total = len(res.shape.layer_ids) * res.shape.num_experts
        moves = lambda ms: ", ".join(f"L{m.layer}E{m.expert}" for m in ms) or "-"  # noqa: E731
        logger.info(
            "sglang-rimuru round %d (order %d, %s): experts out [%s] in [%s]; resident %d/%d; "
            "pool expert pages: experts %d, load buffers %d, KV %d (%d KV pages used), free %d; "
            "waiting requests %d",
            order.round, order.seq, order.reason, moves(order.evict), moves(order.restore),
            res.num_resident(), total, pool.expert_pages, pool.other_expert_pages,
            pool.kv_split_expert_pages, pool.kv_pages_used, pool.free_expert_pages, self._waiting)
        if self.trace_path:
            line = dict(
                t=time.time(), round=order.round, seq=order.seq, reason=order.reason,
                evicted=[[m.layer, m.expert] for m in order.evict],
                restored=[[m.layer, m.expert] for m in order.restore],
                resident=res.num_resident(),
                resident_sets={str(l): res.resident(l) for l in res.shape.layer_ids},
                pool=dict(expert_pages=pool.expert_pages, load_buffer_pages=pool.other_expert_pages,
                          kv_split_expert_pages=pool.kv_split_expert_pages,
                          free_expert_pages=pool.free_expert_pages, kv_pages_used=pool.kv_pages_used,
                          trapped_kv_pages=pool.trapped_kv_pages),
                waiting=self._waiting, running=self._running)
            cost = self.adjuster.cost
            if cost is not None:  # what the cost-aware adjuster priced this order with
                line["cost_ms"] = dict(base=cost.base_ms, per_request=cost.per_request_ms, expert=cost.expert_ms,
                                       eager_prefill_share=cost.eager_prefill_share,
                                       replay_max_p=cost.replay_max_p)
            with open(self.trace_path, "a") as f:
                f.write(json.dumps(line) + "\n")
