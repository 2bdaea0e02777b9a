"""The ZMQ link between the scheduler's adjuster and the TP worker: two ends, bytes only.

Migration orders go scheduler -> worker (``orders.encode``), acknowledgements
(``{"seq": 7, "ok": true}``, JSON) come back.  Messages are bytes, never
pickles, so the receiving side can refuse garbage without running it.  Each
side holds only its own end (``SchedulerEnd``: the controller; ``WorkerEnd``:
the ``OrderApplier``); the two ends share nothing but the two addresses.

In SGLang 0.5.17 the TP worker runs in its scheduler's process and thread, so
``OrderLink`` builds both ends in one process over ``inproc://`` addresses
(one ZMQ context per process).  Every TP rank has its own scheduler, adjuster
and link; they plan identical orders because they see identical batches.  A
worker in another process would build its ``WorkerEnd`` there on ``ipc://``
or ``tcp://`` addresses: the scheduler end binds, the worker end connects.

No SGLang import.
"""

from __future__ import annotations

import itertools
import json
import os

import zmq

__all__ = ["OrderLink", "SchedulerEnd", "WorkerEnd"]

_ids = itertools.count()


class SchedulerEnd:
    """Sends orders, receives acks. Binds both addresses."""

    def __init__(self, orders_address: str, acks_address: str) -> None:
        ctx = zmq.Context.instance()
        self.orders_address, self.acks_address = orders_address, acks_address
        self._orders = ctx.socket(zmq.PUSH)
        self._orders.bind(orders_address)
        self._acks = ctx.socket(zmq.PULL)
        self._acks.bind(acks_address)

    def send_order(self, data: bytes) -> None:
        self._orders.send(data, zmq.NOBLOCK)

    def recv_acks(self) -> list[dict]:
        return [json.loads(raw) for raw in _drain(self._acks)]

    def close(self) -> None:
        for s in (self._orders, self._acks):
            s.close(linger=0)


class WorkerEnd:
    """Receives orders, sends acks. Connects to both addresses."""

    def __init__(self, orders_address: str, acks_address: str) -> None:
        ctx = zmq.Context.instance()
        self._orders = ctx.socket(zmq.PULL)
        self._orders.connect(orders_address)
        self._acks = ctx.socket(zmq.PUSH)
        self._acks.connect(acks_address)

    def recv_orders(self) -> list[bytes]:
        return _drain(self._orders)

    def send_ack(self, seq: int | None, ok: bool, error: str | None = None) -> None:
        msg = {"seq": seq, "ok": ok}
        if error is not None:
            msg["error"] = error
        self._acks.send(json.dumps(msg).encode(), zmq.NOBLOCK)

    def close(self) -> None:
        for s in (self._orders, self._acks):
            s.close(linger=0)


class OrderLink:
    """Both ends of one link in this process (``inproc://``): ``scheduler`` and ``worker``."""

    def __init__(self, name: str | None = None) -> None:
        tag = name or f"{os.getpid()}-{next(_ids)}"
        self.orders_address = f"inproc://sglang-rimuru-orders-{tag}"
        self.acks_address = f"inproc://sglang-rimuru-acks-{tag}"
        self.scheduler = SchedulerEnd(self.orders_address, self.acks_address)
        self.worker = WorkerEnd(self.orders_address, self.acks_address)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def _drain(sock) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out
