"""``OrderApplier``: the TP worker's side of a migration order (DESIGN §5, safe application).

Per forward pass, driven by the integrator::

    take_orders()   at the start of the pass: every order on the link is decoded
                    and checked (``OrderSequencer``: seq order, once each); a
                    refused order is logged with its content and acknowledged
                    ``ok: false`` (the scheduler frees its reserved pages), and
                    serving continues.  Accepted orders start their restore
                    copies straight into the reserved pages (on CUDA: the
                    prefetch stream, ahead of the pass's predicted loads; a
                    restoring expert is not predicted again, and a layer that
                    routes to it reads the reserved pages once the copy landed).
                    Victims stay in the page tables: this pass may still read them.
    finish()        after the pass is enqueued: once the restore copies have
                    landed, acknowledge ``ok: true`` (``block=False`` leaves
                    orders whose copies are still running for a later call,
                    so the scheduler never waits on PCIe). The scheduler then
                    completes the order (victims' pages freed, restores
                    admitted); the tables change at the next pass.

Why freeing victims right after the pass is *enqueued* is safe, also under
SGLang's overlap scheduler (where that pass may still run on the GPU when the
next round is planned): every later use of those pages is a KV write of a
later pass, enqueued on the same stream, so the GPU runs it after every pass
that read the victims; restore copies into reserved pages wait for the end of
every pass enqueued so far (``ExpertManager.start_uploads``). So the
integrator may also run ``take_orders(); finish()`` back to back (an idle
round, or a decode round that would otherwise retract requests).

No SGLang import.
"""

from __future__ import annotations

import json
import logging

from .orders import MigrationOrder, OrderError, OrderSequencer, decode

__all__ = ["OrderApplier"]

logger = logging.getLogger(__name__)

_QUOTE = 300  # bytes of a refused order quoted in the log


class OrderApplier:
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
            shape = self.manager.shape
            bad = [m for m in order.experts if m[0] not in shape.layer_ids or not 0 <= m[1] < shape.num_experts]
            if bad:
                self._refuse(order.seq, f"migration order seq={order.seq} names experts {bad} this "
                                        f"worker does not have (layers {shape.layer_ids}, "
                                        f"{shape.num_experts} experts); refused", raw)
                continue
            n_pages = self.manager.pool_buffer.geometry.num_expert_pages
            beyond = sorted({p for m in order.evict + order.restore for p in m.pages if p >= n_pages})
            if beyond:
                self._refuse(order.seq, f"migration order seq={order.seq} names expert pages {beyond} "
                                        f"beyond this worker's pool ({n_pages} expert pages); refused", raw)
                continue
            self.manager.start_uploads([(m.layer, m.expert, m.pages) for m in order.restore])
            self._pending.append(order)
        return len(self._pending)

    def finish(self, block: bool = True) -> list[MigrationOrder]:
        """The pass that could read the victims is enqueued: acknowledge the pending
        orders once their restore copies landed (waiting for them unless ``block`` is
        False, which leaves them pending while the copies run)."""
        if not self._pending:
            return []
        if not block and not self.manager.uploads_done():
            return []
        self.manager.wait_uploads()
        done, self._pending = self._pending, []
        for order in done:
            self.link.send_ack(order.seq, True)
        self.applied += len(done)
        return done

    @property
    def pending(self) -> tuple[MigrationOrder, ...]:
        return tuple(self._pending)

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
