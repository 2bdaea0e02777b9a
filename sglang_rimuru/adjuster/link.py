"""``OrderLink``: the ZMQ link between the scheduler's adjuster and the TP worker.

In SGLang 0.5.17 the TP worker runs in its scheduler's process and thread, so
the link is a pair of in-process ZMQ ``PUSH``/``PULL`` sockets (``inproc://``,
one context): migration orders go scheduler -> worker, acknowledgements
(``{"seq": 7, "ok": true}``) come back.  Every TP rank has its own scheduler,
adjuster and link; they plan identical orders because they see identical
batches.  Messages are bytes (orders: ``orders.encode``; acks: JSON), never
pickles, so the receiving side can refuse garbage without running it.

No SGLang import.
"""

from __future__ import annotations

import itertools
import json
import os

import zmq

__all__ = ["OrderLink"]

_ids = itertools.count()


class OrderLink:
    def __init__(self, name: str | None = None) -> None:
        ctx = zmq.Context.instance()
        tag = name or f"{os.getpid()}-{next(_ids)}"
        self.orders_address = f"inproc://sglang-rimuru-orders-{tag}"
        self.acks_address = f"inproc://sglang-rimuru-acks-{tag}"
        self._orders_out = ctx.socket(zmq.PUSH)
        self._orders_out.bind(self.orders_address)
        self._orders_in = ctx.socket(zmq.PULL)
        self._orders_in.connect(self.orders_address)
        self._acks_out = ctx.socket(zmq.PUSH)
        self._acks_out.bind(self.acks_address)
        self._acks_in = ctx.socket(zmq.PULL)
        self._acks_in.connect(self.acks_address)

    # scheduler side -------------------------------------------------------

    def send_order(self, data: bytes) -> None:
        self._orders_out.send(data, zmq.NOBLOCK)

    def recv_acks(self) -> list[dict]:
        return [json.loads(raw) for raw in _drain(self._acks_in)]

    # worker side ----------------------------------------------------------

    def recv_orders(self) -> list[bytes]:
        return _drain(self._orders_in)

    def send_ack(self, seq: int | None, ok: bool, error: str | None = None) -> None:
        msg = {"seq": seq, "ok": ok}
        if error is not None:
            msg["error"] = error
        self._acks_out.send(json.dumps(msg).encode(), zmq.NOBLOCK)

    def close(self) -> None:
        for s in (self._orders_out, self._orders_in, self._acks_out, self._acks_in):
            s.close(linger=0)


def _drain(sock) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out
