"""``OrderApplier``: the TP worker's side of the migration-order protocol (DESIGN §5, safe application).

The worker owns the residency as applied and the page tables (its
``ExpertManager`` and the manager's own ``ExpertResidency``); the scheduler's
adjuster owns the page pool and its own view of the residency.  The two talk
only through the bytes on the link (``WorkerEnd``: orders in, acks out); this
module never sees the adjuster, its residency or the pool.

Per forward pass, driven by the integrator::

    take_orders()   at the start of the pass: every order on the link is decoded
                    and checked: ``OrderSequencer`` (seq order, once each), the
                    worker's shape and pool size, and the worker's own state
                    (each victim resident on exactly the pages the order names;
                    each restore offloaded, onto pages no resident expert or
                    load buffer holds; no expert of an order still pending; the
                    offload limit, counting pending victims).  A refused order
                    is logged with its content and acknowledged ``ok: false``
                    (the scheduler frees its reserved pages); nothing of it is
                    applied, and serving continues.  Accepted orders start their
                    restore copies straight into the reserved pages (on CUDA:
                    the prefetch stream, ahead of the pass's predicted loads; a
                    restoring expert is not predicted again, and a layer that
                    routes to it reads the reserved pages once the copy landed).
                    Victims stay in the page tables: this pass may still read them.
    finish()        after the pass is enqueued: once the restore copies have
                    landed, apply each pending order to the worker's residency
                    (victims ``evict``: their rows go to their host pages;
                    restores ``admit``: their rows go to the reserved pages) and
                    acknowledge it ``ok: true``.  ``block=False`` leaves orders
                    whose copies are still running for a later call, so the
                    scheduler never waits on PCIe.  The page tables follow the
                    residency at the next ``begin_forward`` (between passes, on
                    the pass's stream); the scheduler frees the victims' pages
                    when it reads the ack.

Why freeing victims right after the pass is *enqueued* is safe, also under
SGLang's overlap scheduler (where that pass may still run on the GPU when the
next round is planned): every later use of those pages is a KV write of a
later pass, enqueued on the same stream, so the GPU runs it after every pass
that read the victims (and that later pass's tables no longer point at them:
they are refreshed at its start); restore copies into reserved pages wait for
the end of every pass enqueued so far (``ExpertManager.start_uploads``). So the
integrator may also run ``take_orders(); finish()`` back to back (an idle
round, or a decode round that would otherwise retract requests).

No SGLang import; the standard library only (the manager is duck-typed).
"""

from __future__ import annotations

import json
import logging
from collections import Counter

from .orders import MigrationOrder, OrderError, OrderSequencer, decode

__all__ = ["OrderApplier"]

logger = logging.getLogger(__name__)

_QUOTE = 300  # bytes of a refused order quoted in the log


class OrderApplier:
    """The worker's end: ``manager`` (an ``ExpertManager`` with its own residency)
    and ``link`` (a ``WorkerEnd``: ``recv_orders`` / ``send_ack``)."""

    def __init__(self, manager, link) -> None:
        self.manager = manager
        self.link = link
        self.sequencer = OrderSequencer()
        self._pending: list[MigrationOrder] = []
        self.refused = 0
        self.applied = 0

    def take_orders(self) -> int:
        """Check the orders waiting on the link and start their restore copies; returns how many are pending."""
        for raw in self.link.recv_orders():
            try:
                order = decode(raw)
                self.sequencer.accept(order)
            except OrderError as e:
                self._refuse(_seq_of(raw), str(e), raw)
                continue
            problem = self._problem(order)
            if problem:
                self._refuse(order.seq, f"migration order seq={order.seq} {problem}; refused", raw)
                continue
            self.manager.start_uploads([(m.layer, m.expert, m.pages) for m in order.restore])
            self._pending.append(order)
        return len(self._pending)

    def finish(self, block: bool = True) -> list[MigrationOrder]:
        """The pass that could read the victims is enqueued: apply the pending orders
        to the worker's residency and acknowledge them once their restore copies
        landed (waiting for them unless ``block`` is False, which leaves them
        pending while the copies run)."""
        if not self._pending:
            return []
        if not block and not self.manager.uploads_done():
            return []
        self.manager.wait_uploads()
        done, self._pending = self._pending, []
        res = self.manager.residency
        for order in done:
            # checked at take_orders against this residency and the orders before it
            for m in order.evict:
                res.evict(m.layer, m.expert)
            for m in order.restore:
                res.admit(m.layer, m.expert, m.pages)
            self.link.send_ack(order.seq, True)
        self.applied += len(done)
        return done

    @property
    def pending(self) -> tuple[MigrationOrder, ...]:
        return tuple(self._pending)

    def _problem(self, order: MigrationOrder) -> str | None:
        """Why this worker cannot apply ``order`` after the pending ones, or None."""
        shape = self.manager.shape
        bad = [m for m in order.experts if m[0] not in shape.layer_ids or not 0 <= m[1] < shape.num_experts]
        if bad:
            return (f"names experts {bad} this worker does not have (layers {shape.layer_ids}, "
                    f"{shape.num_experts} experts)")
        n_pages = self.manager.pool_buffer.geometry.num_expert_pages
        beyond = sorted({p for m in order.evict + order.restore for p in m.pages if p >= n_pages})
        if beyond:
            return f"names expert pages {beyond} beyond this worker's pool ({n_pages} expert pages)"
        res = self.manager.residency
        busy = {key: o.seq for o in self._pending for key in o.experts}
        for m in order.evict + order.restore:
            if m.key in busy:
                return (f"moves layer {m.layer} expert {m.expert}, which pending order "
                        f"seq={busy[m.key]} moves")
        for m in order.evict:
            if res.pages(m.layer, m.expert) != m.pages:
                where = res.pages(m.layer, m.expert)
                return (f"evicts layer {m.layer} expert {m.expert} from pages {list(m.pages)}, but "
                        + (f"it is on {list(where)} here" if where else "it is not resident here"))
        leaving = Counter(m.layer for o in self._pending + [order] for m in o.evict)
        for layer, n in sorted(leaving.items()):
            if res.num_offloaded(layer) + n > res.offload_limit:
                return (f"would leave layer {layer} with {res.num_offloaded(layer) + n} experts "
                        f"offloaded, over the limit {res.offload_limit}")
        buffers = set(self.manager.load_buffers.all_pages())
        for m in order.restore:
            if res.is_resident(m.layer, m.expert):
                return f"restores layer {m.layer} expert {m.expert}, which is resident here"
            for p in m.pages:
                holder = res.holder(p)
                if holder is not None or p in buffers:
                    what = "a load buffer" if holder is None else f"layer {holder[0]} expert {holder[1]}"
                    return (f"restores layer {m.layer} expert {m.expert} onto page {p}, which holds "
                            f"{what} here")
        restoring = {p for o in self._pending for m in o.restore for p in m.pages}
        clash = sorted(restoring.intersection(p for m in order.restore for p in m.pages))
        if clash:
            return f"restores onto pages {clash} that a pending order restores onto"
        return None

    def _refuse(self, seq: int | None, problem: str, raw: bytes) -> None:
        self.refused += 1
        logger.error("sglang-rimuru worker: refused a migration order: %s; received %r", problem,
                     raw[:_QUOTE] + (b"..." if len(raw) > _QUOTE else b""))
        self.link.send_ack(seq, False, problem)


def _seq_of(raw: bytes) -> int | None:
    """The ``seq`` of an order that failed its checks, if one can be read (for the ack)."""
    try:
        seq = json.loads(raw).get("seq")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None
