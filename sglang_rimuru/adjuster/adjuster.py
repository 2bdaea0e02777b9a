"""``Adjuster``: the scheduler-side round logic of the elastic split (DESIGN §2, §5).

No I/O.  After each scheduling round the integrator calls
``plan_round(round_no, kv_pages_needed)``; a returned ``MigrationOrder`` goes
to the TP worker(s) (``orders.encode``); when the worker acknowledges that it
has applied the order, the integrator calls ``complete(order)`` (or
``abort(order)`` when the worker refused it and applied nothing).

The adjuster owns the page pool's expert pages (it reserves and frees them)
and plans on its own ``ExpertResidency``: its view of what the worker holds,
changed only by ``complete``, i.e. by the worker's acks.  The worker's
residency and page tables are the worker's (``applier.py``); no object is
shared between the two.

Life of an order (state map)::

    plan_round   restore pages RESERVED in the pool now, owned by
                 ExpertKey(layer, expert, w1/w3/w2): no KV page can take them.
                 Victims stay resident and keep their pages (the running
                 forward pass may read them): they are NOT free yet.
                 Every expert of the order is frozen (in flight).
    (worker)     copies the restores into their reserved pages, applies the
                 order to its own residency after the pass that may read the
                 victims, acks.
    complete     on the ack: victims: residency.evict (this view) +
                 page_pool.free_expert_pages (allocatable from now on);
                 restores: residency.admit on the reserved pages.  Unfrozen.
    abort        reserved restore pages freed; victims untouched.  Unfrozen.

In-flight consistency rule (several orders may be in flight, e.g. under
SGLang's overlap scheduler): with ``P`` = pages of in-flight victims,

  * an expert of an in-flight order is never picked again, and an in-flight
    victim already counts against its layer's offload limit (in-flight
    restores do not give budget back until complete);
  * the policy sees the pool as it will be once the in-flight orders are
    complete and the waiting KV demand is served:
        short = max(0, R_b - P)
        free  = max(0, F_b - D) + P   if R_b == 0   (D: free expert pages the
                                                    demand will split for KV)
                max(0, P - R_b)       if R_b > 0
    so one shortfall is not answered twice while its victims are in flight;
  * a restore needs pages free NOW (they are reserved at once): at most
    ``F_b // 3`` restores, and none while R_b > 0 (the KV cache is short now)
    unless a cost model prices it ("restore_pays": whole free expert pages
    the queue's head cannot use yet, never while victims are in flight);
    with a cost model, while requests run and others wait, the high water's
    restores are priced the same way (the queue would take their pages).

When do waiting requests get the pages?  Pages of an order's victims become
allocatable in the first scheduling round that starts after ``complete`` for
that order; until then ``alloc_kv_pages`` cannot have them.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NamedTuple

from sglang_rimuru.experts.residency import expert_owners
from sglang_rimuru.pool import EXPERT_MATRICES, UnifiedPagePool

from .orders import ORDER_VERSION, ExpertMove, MigrationOrder
from .cost import CostModel
from .policy import REASONS, AdjusterPolicy, Decision
from .selection import pick_restores, pick_victims

if TYPE_CHECKING:
    from sglang_rimuru.experts import ExpertRanking, ExpertResidency

__all__ = ["Adjuster", "AdjusterStats", "EvictionPrice", "Load", "RoundRecord"]


class Load(NamedTuple):
    """What the scheduler runs and what an eviction would buy (for a cost-aware adjuster).

    ``running``: requests in the decode batch (and the prefill batch about to
    join it); ``admits``: requests the demand's pages would let in (prefill) —
    for a decode shortfall (``urgent``), the one request SGLang would otherwise
    retract; ``waiting``: requests in SGLang's waiting queue (a queue fills
    whatever KV an eviction frees, so a prefill shortfall is priced at the batch
    the KV holds, not the one running now); ``cached``: KV pages held by the radix
    cache alone.
    """

    running: int
    admits: int
    urgent: bool = False
    waiting: int = 0
    #: KV pages only the radix cache holds (evictable prefixes of finished requests):
    #: not a running request's KV, so not counted in its size
    cached: int = 0


class EvictionPrice(NamedTuple):
    """How the cost-aware adjuster priced a prefill shortfall's victims (``last_price``):
    the batch the KV holds now, the requests the victims' pages admit, decode tokens per
    ms in the reference state and after (``CostModel.eviction_price``; ``after`` None
    when the victims admit no request), the KV pages a running request holds, and the
    answer of the larger move the queue would carry on (None: not asked)."""

    batch: int
    admits: int
    victims: int
    reference: float
    after: float | None
    kv_per_request: float
    larger_move: bool | None


class RoundRecord(NamedTuple):
    """What one ``plan_round`` saw and did."""

    round: int
    short_pages: int  # R_b from the pool
    free_pages: int  # F_b from the pool
    in_flight_pages: int  # P: pages of in-flight victims
    decision: Decision  # the policy's answer on the projected (short, free)
    evicted: int  # experts ordered out
    restored: int  # experts ordered in
    seq: int | None  # the order's seq, None when nothing changed


class AdjusterStats(NamedTuple):
    """Cumulative counters (``unmet_*``: wanted by the policy, no candidate or no pages)."""

    rounds: int
    orders: int
    evictions: int
    restores: int
    unmet_evictions: int
    unmet_restores: int
    completed_orders: int
    aborted_orders: int
    in_flight_orders: int
    in_flight_victim_pages: int
    reserved_restore_pages: int
    decisions: dict[str, int]  # rounds per Decision.reason
    last: RoundRecord | None


class Adjuster:
    """Plans one migration order per scheduling round and keeps its bookkeeping.

    Contract:
      * ``residency`` is this adjuster's own view, placed in ``page_pool`` (every
        resident expert's pages are owned by it there); ``ranking`` fits its shape;
      * ``round_no`` strictly increases from call to call;
      * ``complete`` is called for in-flight orders in ``seq`` order, after the
        worker has finished the forward pass that could read the victims and has
        copied the restored experts into their reserved pages;
      * everything is deterministic, so schedulers of all TP ranks fed the same
        inputs plan identical orders.
    """

    def __init__(self, policy: AdjusterPolicy, page_pool: UnifiedPagePool,
                 residency: ExpertResidency, ranking: ExpertRanking, cost: CostModel | None = None) -> None:
        if policy.pages_per_expert != len(EXPERT_MATRICES):
            raise ValueError(f"AdjusterPolicy.pages_per_expert={policy.pages_per_expert}, but one "
                             f"expert is {len(EXPERT_MATRICES)} pool pages {EXPERT_MATRICES}")
        owners = page_pool.expert_page_owners()
        for l in residency.shape.layer_ids:
            for e, pages in residency.resident_pages(l).items():
                if [owners.get(q) for q in pages] != expert_owners(l, e):
                    raise ValueError(f"the residency has layer {l} expert {e} on pages {pages}, which "
                                     f"the adjuster's page pool does not hold for it")
        ranking.check_fits(residency.shape)
        self.policy = policy
        self.page_pool = page_pool
        self.residency = residency
        self.ranking = ranking
        #: with a cost model, evictions must pay for their PCIe time (``cost.py``)
        self.cost = cost
        top_k = residency.shape.top_k
        # per-token routing probability of each expert: the ranking's, scaled so a
        # layer's sum to top_k (a token picks top_k experts)
        self._token_p = {l: ranking.token_probabilities(l, top_k) for l in residency.shape.layer_ids}
        # Leaving the states whose prefills replay (cost.py's eager_prefill_share): a larger
        # move takes each layer's coldest experts first (_leave_candidates)
        self._coldest = {l: sorted(range(residency.shape.num_experts), key=lambda e, l=l: (self._token_p[l][e], e))
                         for l in residency.shape.layer_ids}
        self._leaving_memo: tuple | None = None  # (inputs, answer) of the last _leaving_pays
        self._last_price: EvictionPrice | None = None
        self._seq = 0
        self._last_round: int | None = None
        self._in_flight: dict[int, MigrationOrder] = {}  # seq -> order, insertion = seq order
        self._frozen: dict[tuple[int, int], int] = {}  # (layer, expert) -> seq
        self._victim_pages = 0  # P
        self._reserved_pages = 0
        self._n = Counter()
        self._decisions: Counter[str] = Counter({r: 0 for r in REASONS})
        self._last: RoundRecord | None = None

    # ================================================================ the round

    def plan_round(self, round_no: int, kv_pages_needed: int, load: Load | None = None) -> MigrationOrder | None:
        """Decide this round's evictions / restores; reserve restore pages; ``None`` if no change.

        ``kv_pages_needed``: KV pages the schedule wants beyond what it got
        (its shortfall; 0 when everything fit), passed to
        ``page_pool.missing_expert_pages``. ``load``: with a cost model, what the
        evictions would buy; an eviction that does not pay for its PCIe time is
        dropped (reason ``priced_out``). Without ``load`` or a cost model the
        policy's thresholds alone decide (the paper's rule).
        """
        for name, v in (("round_no", round_no), ("kv_pages_needed", kv_pages_needed)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self._last_round is not None and round_no <= self._last_round:
            raise ValueError(f"round_no must increase: got {round_no} after {self._last_round}")
        self._last_round = round_no
        self._last_price = None
        pool, ppe = self.page_pool, self.policy.pages_per_expert
        stats = pool.stats()
        r_b = stats.missing_expert_pages(kv_pages_needed)
        f_b = pool.free_expert_page_count()
        p = self._victim_pages
        short = max(0, r_b - p)
        # A standing demand that fits (R_b == 0) will take some of the free expert
        # pages when its request is admitted: those are not free for restores.
        taken = 0
        if r_b == 0 and kv_pages_needed > stats.trapped_kv_pages:
            taken = -(-(kv_pages_needed - stats.trapped_kv_pages) // stats.min_kv_pages_per_expert_page)
        free = max(0, f_b - taken) + p if r_b == 0 else max(0, p - r_b)
        decision = self.policy.decide(short, free)

        frozen = self._frozen.keys()
        victims = (pick_victims(self.residency, self.ranking, decision.evict, frozen)
                   if decision.evict else [])
        if victims and self.cost is not None and load is not None and not self._pays(victims, load, decision, kv_pages_needed, stats):
            self._n["priced_out"] += 1
            decision, victims = Decision(0, 0, "priced_out"), []
        n_restore = min(decision.restore, max(0, f_b - taken) // ppe) if r_b == 0 else 0
        # While requests run and wait, SGLang's queue takes every KV page that comes free:
        # a restore at the high water is evicted again by the next shortfall (H200, skewed
        # routing at 20 req/s: five cold experts back at 76 free pages with 7 waiting, out
        # again 0.3 s later, a dozen times a burst). Then only the price below restores.
        queue_prices = n_restore > 0 and self._queue_prices_restores(load)
        restores = (pick_restores(self.residency, self.ranking, n_restore, frozen)
                    if n_restore and not queue_prices else [])
        if not victims and not restores and p == 0 and self.cost is not None and load is not None:
            # the thresholds restore nothing (or are priced) while requests wait; the price may
            restores = self._restores_that_pay(load, max(0, f_b - taken) if r_b == 0 else f_b, stats, frozen,
                                               refused=r_b > 0)
            if restores:
                decision = Decision(0, len(restores), "restore_pays")
        if queue_prices and not restores:
            decision = Decision(0, 0, "restore_priced_out")

        self._n["rounds"] += 1
        self._decisions[decision.reason] += 1
        self._n["unmet_evictions"] += decision.evict - len(victims)
        self._n["unmet_restores"] += decision.restore - len(restores)
        if not victims and not restores:
            self._last = RoundRecord(round_no, r_b, f_b, p, decision, 0, 0, None)
            return None

        evict = tuple(ExpertMove(l, e, self.residency.pages(l, e)) for l, e in victims)
        restore = []
        for l, e in restores:  # reserve now: from here on the KV allocator cannot take them
            pages = pool.alloc_expert_pages(ppe, expert_owners(l, e))
            if pages is None:  # cannot happen: n_restore <= F_b // 3
                raise RuntimeError(f"pool refused {ppe} pages for restore of layer {l} expert {e}")
            restore.append(ExpertMove(l, e, tuple(pages)))
        self._seq += 1
        order = MigrationOrder(
            version=ORDER_VERSION, seq=self._seq, round=round_no, evict=evict,
            restore=tuple(restore),
            reason=f"{decision.reason}: R_b={r_b} F_b={f_b} in_flight_pages={p}")
        self._in_flight[order.seq] = order
        for key in order.experts:
            self._frozen[key] = order.seq
        self._victim_pages += ppe * len(evict)
        self._reserved_pages += ppe * len(restore)
        self._n["orders"] += 1
        self._n["evictions"] += len(evict)
        self._n["restores"] += len(restore)
        self._last = RoundRecord(round_no, r_b, f_b, p, decision, len(evict), len(restore), order.seq)
        return order

    # ================================================================ confirmations

    def complete(self, order: MigrationOrder | int) -> None:
        """The worker applied ``order`` (or the order with this ``seq``): book it.

        Victims: ``residency.evict`` and their pages freed to the pool (usable
        by the KV cache from now on); restores: ``residency.admit`` on their
        reserved pages.  Must be the oldest in-flight order.  Everything is
        checked before anything changes (``ValueError``).
        """
        order = self._lookup(order)
        oldest = next(iter(self._in_flight))
        if order.seq != oldest:
            raise ValueError(f"complete(seq={order.seq}): orders complete in seq order; "
                             f"seq={oldest} is still in flight")
        res, owners = self.residency, self.page_pool.expert_page_owners()
        leaving = Counter(m.layer for m in order.evict)
        for layer, n in leaving.items():
            if res.num_offloaded(layer) + n > res.offload_limit:
                raise ValueError(f"complete(seq={order.seq}): layer {layer} would have "
                                 f"{res.num_offloaded(layer) + n} experts offloaded, over the "
                                 f"limit {res.offload_limit}")
        for m in order.evict:
            if res.pages(m.layer, m.expert) != m.pages:
                raise ValueError(f"complete(seq={order.seq}): victim layer {m.layer} expert "
                                 f"{m.expert} is on {res.pages(m.layer, m.expert)}, the order "
                                 f"says {m.pages}")
        for m in order.restore:
            want = expert_owners(m.layer, m.expert)
            if res.is_resident(m.layer, m.expert) or [owners.get(q) for q in m.pages] != want:
                raise ValueError(f"complete(seq={order.seq}): restore of layer {m.layer} expert "
                                 f"{m.expert} onto {m.pages} no longer matches the pool/residency")
        for m in order.evict:
            self.page_pool.free_expert_pages(res.evict(m.layer, m.expert))
        for m in order.restore:
            res.admit(m.layer, m.expert, m.pages)
        self._forget(order)
        self._n["completed_orders"] += 1

    def abort(self, order: MigrationOrder | int) -> None:
        """The worker refused ``order`` and applied none of it: free the reserved
        restore pages and unfreeze its experts; victims simply stay resident."""
        order = self._lookup(order)
        for m in order.restore:
            self.page_pool.free_expert_pages(m.pages)
        self._forget(order)
        self._n["aborted_orders"] += 1

    # ================================================================ queries

    @property
    def in_flight(self) -> tuple[MigrationOrder, ...]:
        """Orders planned and not yet complete or aborted, oldest first."""
        return tuple(self._in_flight.values())

    @property
    def last_round(self) -> RoundRecord | None:
        """What the last ``plan_round`` saw and did (``stats().last`` without the counters)."""
        return self._last

    @property
    def last_price(self) -> EvictionPrice | None:
        """How the last ``plan_round`` priced a prefill shortfall's victims; None where it
        priced none (no cost model or load, a decode shortfall, the low water, no victim)."""
        return self._last_price

    @property
    def last_seq(self) -> int:
        """``seq`` of the last order planned; 0 before the first."""
        return self._seq

    def in_flight_experts(self) -> frozenset[tuple[int, int]]:
        return frozenset(self._frozen)

    def stats(self) -> AdjusterStats:
        n = self._n
        return AdjusterStats(
            rounds=n["rounds"], orders=n["orders"], evictions=n["evictions"],
            restores=n["restores"], unmet_evictions=n["unmet_evictions"],
            unmet_restores=n["unmet_restores"], completed_orders=n["completed_orders"],
            aborted_orders=n["aborted_orders"], in_flight_orders=len(self._in_flight),
            in_flight_victim_pages=self._victim_pages,
            reserved_restore_pages=self._reserved_pages, decisions=dict(self._decisions),
            last=self._last)

    def check_invariants(self) -> None:
        """Recompute the in-flight bookkeeping and check it against the residency and
        the pool (``AssertionError``); also runs ``page_pool.check_invariants()``.
        O(resident experts + pool): for tests."""
        res, pool = self.residency, self.page_pool
        owners = pool.expert_page_owners()
        frozen: dict[tuple[int, int], int] = {}
        leaving: Counter[int] = Counter()
        for seq, order in self._in_flight.items():
            assert seq == order.seq
            for key in order.experts:
                assert key not in frozen, f"{key} in orders {frozen[key]} and {seq}"
                frozen[key] = seq
            for m in order.evict:
                assert res.pages(m.layer, m.expert) == m.pages, f"victim {m} moved"
                leaving[m.layer] += 1
            for m in order.restore:
                assert not res.is_resident(m.layer, m.expert), f"restore {m} already resident"
                assert [owners.get(q) for q in m.pages] == expert_owners(m.layer, m.expert), m
        assert frozen == self._frozen, (frozen, self._frozen)
        ppe = self.policy.pages_per_expert
        assert self._victim_pages == ppe * sum(leaving.values())
        assert self._reserved_pages == ppe * sum(len(o.restore) for o in self._in_flight.values())
        for layer in res.shape.layer_ids:
            assert res.num_offloaded(layer) + leaving[layer] <= res.offload_limit, layer
            for e, pages in res.resident_pages(layer).items():
                assert [owners.get(q) for q in pages] == expert_owners(layer, e), (layer, e)
        pool.check_invariants()

    # ================================================================ internals

    def token_probabilities(self) -> list[float]:
        """Per-token routing probabilities of every expert of every layer, resident or not
        (what a decode step's distinct routed experts are counted from: ``RoutedExperts``)."""
        return [p for l in self.residency.shape.layer_ids for p in self._token_p[l]]

    def offloaded_token_probabilities(self) -> list[float]:
        """Per-token routing probabilities of every expert out of the pool, or on its
        way out (in-flight victims)."""
        return [self._token_p[l][e] for l, e in self._out_keys()]

    def _out_keys(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert out of the pool, then those on their way out."""
        res = self.residency
        out = [(l, e) for l in res.shape.layer_ids for e in res.offloaded(l)]
        out += [(m.layer, m.expert) for o in self._in_flight.values() for m in o.evict]
        return out

    def _pays(self, victims, load: Load, decision: Decision, kv_pages_needed: int, stats) -> bool:
        """``stats``: the pool's counters ``plan_round`` read this round."""
        cost, offloaded = self.cost, self.offloaded_token_probabilities()
        new = [self._token_p[l][e] for l, e in victims]
        if decision.reason == "low_water" and not load.urgent:
            # pre-emptive: only victims so cold that their price is within the margin of a step,
            # and never the move that turns the prefills eager (cost.py)
            if cost.eager_prefill_share > cost.margin and cost.eager([*offloaded, *new]) and not cost.eager(offloaded):
                return False
            return cost.offload_ms(new, load.running) <= cost.margin * cost.step_ms(load.running)
        # the KV sizes that price bringing experts back instead (cost.py: no ratchet)
        kv_per_expert = self._kv_per_expert()
        kv_used = stats.kv_pages_used
        kv_per_request = self._kv_per_request(load, kv_used)
        if load.urgent:
            return cost.keep_beats_retract(load.running, offloaded, new, kv_per_request, kv_per_expert)
        batch, admits = load.running, load.admits
        if load.running == 0 and load.admits > 0:
            # nothing runs (between requests): the head's own pages per request say how
            # many the KV holds without evicting; "pure gain" only if that is none
            kv_per_request = kv_pages_needed / load.admits
        cap = None
        if kv_per_request > 0 and load.waiting > 0:
            # The queue will fill the KV either way: compare the batch today's KV holds
            # with the one it holds with the victims' pages too. (Priced at the batch
            # running now, victims look cheap while it is small - each is touched by few
            # steps - and every expert is read by every step once the freed KV has filled.)
            # While requests run, the requests the victims admit are what their KV buys
            # at the running requests' size, not the head's count: short prompts at the
            # head grow into that size as they decode, and the victims stay out while the
            # queue lasts (restores wait for whole free expert pages). On the H200 a
            # burst's first eviction (6 running, 144 waiting) passed on the head's count.
            cap = kv_used + self.page_pool.kv_capacity_now()
            kv_per_request = self._admission_size(load, cap, kv_per_request, refused=True)
            batch = max(load.running, self._kv_batch(load, cap, kv_per_request))
            after = self._kv_batch(load, cap + len(victims) * kv_per_expert, kv_per_request)
            head = load.admits if load.running == 0 else 0
            admits = max(load.running + head, after) - batch
        # priced once (restored_throughput is the dear part), judged below at two margins
        ref, after = (cost.eviction_price(batch, admits, offloaded, new, kv_per_request, kv_per_expert)
                      if batch > 0 and admits > 0 else (cost.throughput(batch, offloaded), None))
        self._last_price = EvictionPrice(batch, admits, len(new), ref, after, kv_per_request, None)
        if cost.price_pays(batch, admits, ref, after):
            return True  # nothing runs (any request admitted is pure gain), or it pays
        if cap is None:
            return False
        # A queue waits: these victims may be the first step of a move it would carry on.
        # Priced as one: the move that turns the prefills eager (its share is paid once,
        # a shortfall's few victims never win it back), and a step that gains, but less
        # than the margin (at a large batch one request is a small share of a step:
        # cost.py's last paragraph).
        crossing = cost.eager([*offloaded, *new]) and not cost.eager(offloaded)
        if not crossing and not cost.price_pays(batch, admits, ref, after, margin=0.0):
            return False
        larger = self._leaving_pays(load, cap, batch, kv_per_request, kv_per_expert, len(victims),
                                    frozenset(self._out_keys()))
        self._last_price = self._last_price._replace(larger_move=larger)
        return larger

    def _leave_candidates(self, out: frozenset[tuple[int, int]]) -> list[float]:
        """Probabilities, ascending, of the experts a larger move could still send out
        with ``out`` out: each layer's coldest, up to the offload limit less its own out."""
        lim = self.residency.offload_limit
        per_layer = Counter(l for l, _ in out)
        cands = []
        for l, coldest in self._coldest.items():
            room = lim - per_layer[l]
            for e in coldest:
                if room <= 0:
                    break
                if (l, e) not in out:
                    cands.append(self._token_p[l][e])
                    room -= 1
        return sorted(cands)

    def _leaving_pays(self, load: Load, cap: int, batch: int, kv_per_request: float, kv_per_expert: float,
                      n_victims: int, out: frozenset[tuple[int, int]]) -> bool:
        """From the state with ``out`` out, while requests wait: whether some larger move
        (the coldest experts the offload limit still lets go, doubling from
        ``2 * n_victims``) pays, by the model's margin, the eager-prefill share included.
        Asked for a shortfall's victims that turn the prefills eager (the move that does
        pays that share for every later one, which is priced on decode alone; a few
        victims alone could never win it back, even where cold experts would: skewed
        routing) and for victims that gain less than the margin (``_pays``). Up to ~0.7
        ms at 720 candidates: a round that asks as the last one did (a queue standing
        still) reuses its answer."""
        key = (self.cost, batch, load.running, load.waiting, cap, kv_per_request, kv_per_expert, n_victims, out)
        if self._leaving_memo is not None and self._leaving_memo[0] == key:
            return self._leaving_memo[1]
        pays = self._leaving_pays_now(load, cap, batch, kv_per_request, kv_per_expert, n_victims, out)
        self._leaving_memo = (key, pays)
        return pays

    def _leaving_pays_now(self, load: Load, cap: int, batch: int, kv_per_request: float,
                          kv_per_expert: float, n_victims: int, out: frozenset[tuple[int, int]]) -> bool:
        cost, cands = self.cost, self._leave_candidates(out)
        offloaded = [self._token_p[l][e] for l, e in out]
        n = 2 * max(1, n_victims)
        while cands:
            n = min(n, len(cands))
            after = self._kv_batch(load, cap + n * kv_per_expert, kv_per_request)
            if cost.eviction_pays(batch, max(load.running, after) - batch, offloaded, cands[:n],
                                  kv_per_request, kv_per_expert):
                return True
            if n == len(cands):
                return False
            n *= 2
        return False

    def _kv_per_expert(self) -> float:
        """KV pages one expert's pages hold."""
        geo = self.page_pool.geometry
        return self.policy.pages_per_expert * geo.expert_page_bytes / geo.kv_page_bytes

    @staticmethod
    def _kv_batch(load: Load, kv: float, kv_per_request: float) -> int:
        """The batch ``kv`` KV pages hold at ``kv_per_request`` while the queue lasts
        (at most every running and waiting request)."""
        return min(load.running + load.waiting, int(kv // kv_per_request))

    @staticmethod
    def _admission_size(load: Load, cap: int, kv_per_request: float, refused: bool) -> float:
        """KV pages a running request holds as SGLang's admission counts them: the running
        requests' own size, unless SGLang ``refused`` the queue's head although ``cap`` at
        that size holds every waiting request. Its admission also counts the KV the
        running requests will still take (its decode reservation), so at their own size
        no victim ever admitted a request: on one H100 (bench/RESULTS.md, thirtieth
        session) every logged priced-out round of a Qwen3-30B-A3B burst said "admit none"
        at 280-409 KV pages a request, with 6-123 waiting, while its decode log counted 435
        a request. At SGLang's own size its KV holds the running requests and no more:
        ``cap / running``."""
        if refused and load.running > 0 and cap // kv_per_request >= load.running + load.waiting:
            return cap / load.running
        return kv_per_request

    @staticmethod
    def _kv_per_request(load: Load, kv_used: int) -> float:
        """KV pages a running request holds: the used pages less the radix cache's own
        (a cache full of finished requests' prefixes made each request look larger,
        and so an eviction's pages worth fewer requests); 0 with nothing running."""
        if load.running <= 0:
            return 0.0
        return max(0, kv_used - max(0, load.cached)) / load.running

    def _queue_prices_restores(self, load: Load | None) -> bool:
        """Whether the thresholds' restores go through the price (``_restores_that_pay``):
        with a cost model, while requests run and others wait (not a decode shortfall)."""
        return (self.cost is not None and load is not None and not load.urgent
                and load.running > 0 and load.waiting > 0)

    def _restores_that_pay(self, load: Load, free_pages: int, stats, frozen,
                           refused: bool = False) -> list[tuple[int, int]]:
        """The experts to bring back into ``free_pages`` whole free expert pages (less the
        high water) while requests wait: the most (up to the policy's per-round limit,
        most probable first) whose return beats the batch the KV would otherwise hold;
        [] if none.

        The mirror of an eviction's price (``_pays``): a queue fills whatever KV is
        free, so pages a restore takes cost the requests they would have held at
        the running requests' size. Without this the experts an eviction sent out
        stayed out while the queue lasted (restores waited for the high water):
        on the H200 (bench/RESULTS.md) 12 uniform experts stayed out for 80 s of
        a burst with 20-55 whole expert pages free and the head refused.
        ``refused``: SGLang refused the queue's head this round (``_admission_size``).
        """
        ppe = self.policy.pages_per_expert
        # Leave the high water free: the running requests grow into free pages every
        # step, and a restore into their last pages makes the next decode shortfall
        # evict again (on the H200 restores at 3-9 free pages alternated with urgent
        # evictions of one expert, ~20 times in a run).
        n_max = min(self.policy.max_restores_per_round, (free_pages - self.policy.restore_high_water) // ppe)
        if n_max <= 0 or load.urgent or load.running <= 0 or load.waiting <= 0:
            return []
        back = pick_restores(self.residency, self.ranking, n_max, frozen)
        if not back:
            return []
        cost, kv_per_expert = self.cost, self._kv_per_expert()
        kv_used = stats.kv_pages_used
        kv_per_request = self._kv_per_request(load, kv_used)
        if kv_per_request <= 0:
            return []
        cap = kv_used + self.page_pool.kv_capacity_now()
        kv_per_request = self._admission_size(load, cap, kv_per_request, refused)
        batch = max(load.running, self._kv_batch(load, cap, kv_per_request))
        keys = self._out_keys()
        offloaded, out = [self._token_p[l][e] for l, e in keys], frozenset(keys)
        now = cost.throughput(batch, offloaded)
        for n in range(len(back), 0, -1):
            rest = list(offloaded)
            for l, e in back[:n]:
                rest.remove(self._token_p[l][e])
            after = self._kv_batch(load, cap - n * kv_per_expert, kv_per_request)
            if cost.throughput(after, rest) > (1.0 + cost.margin) * now:
                if cost.eager(offloaded) and not cost.eager(rest) and self._leaving_pays(
                        load, cap - n * kv_per_expert, max(load.running, after), kv_per_request,
                        kv_per_expert, n, out - frozenset(back[:n])):
                    continue  # back earns the share, but leaving again would pay: it would flap
                return back[:n]
        return []

    def _lookup(self, order: MigrationOrder | int) -> MigrationOrder:
        seq = order.seq if isinstance(order, MigrationOrder) else order
        stored = self._in_flight.get(seq) if isinstance(seq, int) else None
        if stored is None:
            raise ValueError(f"no migration order seq={seq!r} in flight "
                             f"(in flight: {list(self._in_flight)})")
        if isinstance(order, MigrationOrder) and order != stored:
            raise ValueError(f"order seq={seq} differs from the one planned: {order} vs {stored}")
        return stored

    def _forget(self, order: MigrationOrder) -> None:
        del self._in_flight[order.seq]
        for key in order.experts:
            del self._frozen[key]
        ppe = self.policy.pages_per_expert
        self._victim_pages -= ppe * len(order.evict)
        self._reserved_pages -= ppe * len(order.restore)

    def __repr__(self) -> str:
        return (f"Adjuster(last_seq={self._seq}, in_flight={list(self._in_flight)}, "
                f"victim_pages={self._victim_pages}, reserved_pages={self._reserved_pages})")
