"""``OrderLink`` (in-process ZMQ, two ends) and ``OrderApplier`` (the worker's side)
on the rig's real pool and the worker's own residency and ``ExpertManager`` (see
rig.py for the page map: ``make_rig(pages=84)`` + ``make_worker``: free pages
78..83).  Here the test plays the scheduler: it reserves pages in the pool and
sends orders on the scheduler end; nobody completes them, so the scheduler's
residency (``rig.residency``) never changes."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sglang_rimuru.adjuster import ExpertMove, MigrationOrder, encode
from sglang_rimuru.adjuster.applier import OrderApplier
from sglang_rimuru.adjuster.link import OrderLink, SchedulerEnd, WorkerEnd
from sglang_rimuru.experts import expert_owners

from .rig import expert_page_holds, make_rig, make_worker

APPLIER_LOG = "sglang_rimuru.adjuster.applier"


@pytest.fixture
def link():
    made = []

    def new(name: str | None = None) -> OrderLink:
        made.append(OrderLink(name))
        return made[-1]

    yield new
    for lk in made:
        lk.close()


def order(seq: int, evict=(), restore=(), round: int = 5) -> MigrationOrder:
    return MigrationOrder(version=1, seq=seq, round=round, evict=tuple(evict),
                          restore=tuple(restore), reason="test")


# ---------------------------------------------------------------- the link


def test_orders_arrive_in_order_and_empty_recv_is_empty(link) -> None:
    lk = link()
    sched, worker = lk.scheduler, lk.worker
    assert worker.recv_orders() == [] and sched.recv_acks() == []
    msgs = [f"order {i}".encode() for i in range(500)]
    for m in msgs[:3]:
        sched.send_order(m)
    assert worker.recv_orders() == msgs[:3]
    assert worker.recv_orders() == []
    for m in msgs[3:]:
        sched.send_order(m)
    assert worker.recv_orders() == msgs[3:]
    assert worker.recv_orders() == [] and sched.recv_acks() == []  # orders never show up as acks


def test_acks_round_trip(link) -> None:
    lk = link()
    lk.worker.send_ack(7, True)
    lk.worker.send_ack(None, False, "bad migration order: not UTF-8 JSON")
    lk.worker.send_ack(8, False, "seq gap")
    assert lk.scheduler.recv_acks() == [
        {"seq": 7, "ok": True},
        {"seq": None, "ok": False, "error": "bad migration order: not UTF-8 JSON"},
        {"seq": 8, "ok": False, "error": "seq gap"},
    ]
    assert lk.scheduler.recv_acks() == [] and lk.worker.recv_orders() == []


def test_each_end_has_only_its_own_half() -> None:
    # the scheduler's end cannot receive orders or send acks, the worker's the reverse
    assert {"send_order", "recv_acks"} <= set(dir(SchedulerEnd))
    assert not {"recv_orders", "send_ack"} & set(dir(SchedulerEnd))
    assert {"recv_orders", "send_ack"} <= set(dir(WorkerEnd))
    assert not {"send_order", "recv_acks"} & set(dir(WorkerEnd))


def test_ends_built_apart_talk_through_the_addresses_alone() -> None:
    # what a worker in another process would do: its own end, on the addresses only
    sched = SchedulerEnd("inproc://sglang-rimuru-test-orders", "inproc://sglang-rimuru-test-acks")
    worker = WorkerEnd(sched.orders_address, sched.acks_address)
    try:
        sched.send_order(b"order 1")
        assert worker.recv_orders() == [b"order 1"]
        worker.send_ack(1, True)
        assert sched.recv_acks() == [{"seq": 1, "ok": True}]
    finally:
        sched.close()
        worker.close()


def test_two_links_in_one_process_do_not_cross(link) -> None:
    a, b = link(), link()
    named = link("rank-1")
    assert len({a.orders_address, b.orders_address, named.orders_address,
                a.acks_address, b.acks_address, named.acks_address}) == 6
    assert named.orders_address == "inproc://sglang-rimuru-orders-rank-1"
    a.scheduler.send_order(b"to a")
    b.scheduler.send_order(b"to b 1")
    b.scheduler.send_order(b"to b 2")
    a.worker.send_ack(1, True)
    named.worker.send_ack(2, False)
    assert b.worker.recv_orders() == [b"to b 1", b"to b 2"]
    assert a.worker.recv_orders() == [b"to a"]
    assert named.worker.recv_orders() == [] and b.scheduler.recv_acks() == []
    assert a.scheduler.recv_acks() == [{"seq": 1, "ok": True}]
    assert named.scheduler.recv_acks() == [{"seq": 2, "ok": False}]


# ---------------------------------------------------------------- the applier


@pytest.fixture
def worker(link):
    """(rig, worker, scheduler end, applier); the rig's free pages are 78..83."""
    rig = make_rig(pages=84)
    w = make_worker(rig)
    lk = link()
    return rig, w, lk.scheduler, OrderApplier(w.manager, lk.worker)


def reserve(rig, layer: int, expert: int) -> tuple[int, int, int]:
    """What the adjuster does at plan time: 3 pages owned by the expert, not resident."""
    return tuple(rig.pool.alloc_expert_pages(3, expert_owners(layer, expert)))


def holds(rig, w, layer, expert, pages) -> bool:
    return all(expert_page_holds(rig, w, p, layer, expert, m) for m, p in enumerate(pages))


def test_valid_order_restores_into_reserved_pages_and_acks_after_finish(worker) -> None:
    rig, w, lk, ap = worker
    pages = reserve(rig, 0, 7)
    assert pages == (78, 79, 80)
    assert not holds(rig, w, 0, 7, pages)  # zeroed pool
    victim = ExpertMove(0, 2, rig.residency.pages(0, 2))
    assert victim.pages == (15, 16, 17)
    o = order(1, evict=[victim], restore=[ExpertMove(0, 7, pages)])
    lk.send_order(encode(o))

    assert ap.take_orders() == 1
    assert ap.pending == (o,)
    assert lk.recv_acks() == []  # no ack before the pass is over
    # taken, not applied: this pass may still read the victim; the restore is not resident
    assert w.residency.is_resident(0, 2) and holds(rig, w, 0, 2, (15, 16, 17))
    assert not w.residency.is_resident(0, 7)
    assert w.manager.table(0)[2].tolist() == [15, 16, 17]

    assert ap.finish() == [o]
    assert holds(rig, w, 0, 7, (78, 79, 80))
    assert holds(rig, w, 0, 2, (15, 16, 17))  # evicting copies nothing
    # applied to the worker's own residency, then acknowledged
    assert w.residency.pages(0, 2) is None and w.residency.pages(0, 7) == (78, 79, 80)
    assert lk.recv_acks() == [{"seq": 1, "ok": True}]
    assert (ap.applied, ap.refused, ap.pending, ap.sequencer.last_seq) == (1, 0, (), 1)
    assert w.manager.stats().restored == 1 and w.manager.stats().bytes_copied == 3 * 64
    assert ap.finish() == [] and lk.recv_acks() == []  # nothing pending: nothing sent
    # the tables follow at the next pass's start: the victim read from its host pages
    assert w.manager.table(0)[2].tolist() == [15, 16, 17]
    w.manager.begin_forward()
    assert w.manager.table(0)[2].tolist() == [-8, -9, -10]
    assert w.manager.table(0)[7].tolist() == [78, 79, 80]
    w.manager.end_forward()
    # the scheduler's view is the scheduler's: only its acks (never read here) change it
    assert rig.residency.pages(0, 2) == (15, 16, 17) and not rig.residency.is_resident(0, 7)


def test_several_orders_in_one_take(worker) -> None:
    rig, w, lk, ap = worker
    a = order(1, restore=[ExpertMove(0, 7, reserve(rig, 0, 7))])
    b = order(2, restore=[ExpertMove(1, 1, reserve(rig, 1, 1))], round=6)
    lk.send_order(encode(a))
    lk.send_order(encode(b))
    assert ap.take_orders() == 2 and ap.pending == (a, b)
    assert ap.finish() == [a, b]
    assert lk.recv_acks() == [{"seq": 1, "ok": True}, {"seq": 2, "ok": True}]
    assert holds(rig, w, 0, 7, (78, 79, 80)) and holds(rig, w, 1, 1, (81, 82, 83))


def _wrong_type(seq: int) -> bytes:
    m = json.loads(encode(order(seq)))
    m["type"] = "rimuru.something_else"
    return json.dumps(m).encode()


# (name, bad message given the next expected seq, seq in the ack, does the sequencer move on,
#  what the error says)
BAD = [
    ("garbage", lambda seq: b"\x80\x81 not an order", None, False, "not UTF-8 JSON"),
    ("wrong_type", _wrong_type, "next", False, "type is 'rimuru.something_else'"),
    ("duplicate", lambda seq: encode(order(seq - 1)), "prev", False, "repeats or is older"),
    ("gap", lambda seq: encode(order(seq + 1)), "gap", False, "out of sequence"),
    ("unknown_layer", lambda seq: encode(order(seq, restore=[ExpertMove(5, 1, (81, 82, 83))])),
     "next", True, "names experts [(5, 1)] this worker does not have (layers (0, 1, 2), 8 experts)"),
    ("unknown_expert", lambda seq: encode(order(seq, evict=[ExpertMove(0, 8, (15, 16, 17))])),
     "next", True, "names experts [(0, 8)] this worker does not have"),
    ("page_beyond_pool", lambda seq: encode(order(seq, restore=[ExpertMove(0, 7, (82, 83, 84))])),
     "next", True, "names expert pages [84] beyond this worker's pool (84 expert pages)"),
    # against the worker's own residency (after `first`: (0, 7) resident on 78..80)
    ("victim_elsewhere", lambda seq: encode(order(seq, evict=[ExpertMove(0, 2, (15, 16, 81))])),
     "next", True, "evicts layer 0 expert 2 from pages [15, 16, 81], but it is on [15, 16, 17] here"),
    ("victim_offloaded", lambda seq: encode(order(seq, evict=[ExpertMove(0, 6, (81, 82, 83))])),
     "next", True, "evicts layer 0 expert 6 from pages [81, 82, 83], but it is not resident here"),
    ("over_the_limit", lambda seq: encode(order(seq, evict=[
        ExpertMove(0, e, (3 * i, 3 * i + 1, 3 * i + 2)) for e, i in ((2, 5), (5, 4), (0, 3), (4, 2))])),
     "next", True, "would leave layer 0 with 5 experts offloaded, over the limit 4"),
    ("restore_resident", lambda seq: encode(order(seq, restore=[ExpertMove(0, 7, (81, 82, 83))])),
     "next", True, "restores layer 0 expert 7, which is resident here"),
    ("restore_onto_an_expert", lambda seq: encode(order(seq, restore=[ExpertMove(1, 1, (81, 82, 0))])),
     "next", True, "restores layer 1 expert 1 onto page 0, which holds layer 0 expert 3 here"),
    ("restore_onto_a_load_buffer", lambda seq: encode(order(seq, restore=[ExpertMove(1, 1, (81, 54, 82))])),
     "next", True, "restores layer 1 expert 1 onto page 54, which holds a load buffer here"),
]


@pytest.mark.parametrize("name,bad,ack_seq,advances,says", BAD, ids=[b[0] for b in BAD])
def test_bad_order_is_refused_and_serving_continues(worker, caplog, name, bad, ack_seq,
                                                    advances, says) -> None:
    rig, w, lk, ap = worker
    first = order(1, restore=[ExpertMove(0, 7, reserve(rig, 0, 7))])
    lk.send_order(encode(first))
    assert ap.take_orders() == 1 and ap.finish() == [first]
    assert lk.recv_acks() == [{"seq": 1, "ok": True}]
    before = w.buffer.data.clone()
    placed = w.residency.placement()

    raw = bad(2)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger=APPLIER_LOG):
        lk.send_order(raw)
        assert ap.take_orders() == 0
    assert ap.refused == 1 and ap.pending == ()
    [rec] = [r for r in caplog.records if r.name == APPLIER_LOG]
    assert rec.levelno == logging.ERROR
    msg = rec.getMessage()
    assert msg.startswith("sglang-rimuru worker: refused a migration order: ")
    assert says in msg
    assert msg.endswith(f"; received {raw!r}")
    [ack] = lk.recv_acks()
    want_seq = {None: None, "next": 2, "prev": 1, "gap": 3}[ack_seq]
    assert ack["seq"] == want_seq and ack["ok"] is False and says in ack["error"]
    assert ap.finish() == [] and lk.recv_acks() == []
    assert torch.equal(w.buffer.data, before)  # nothing copied anywhere
    assert w.residency.placement() == placed  # nothing applied
    assert ap.sequencer.last_seq == (2 if advances else 1)

    # the next correct order is still accepted (the refused one's seq is spent only
    # when it passed the sequencer: the scheduler aborts it and numbers on)
    nxt = 3 if advances else 2
    good = order(nxt, restore=[ExpertMove(1, 1, reserve(rig, 1, 1))])
    lk.send_order(encode(good))
    assert ap.take_orders() == 1 and ap.finish() == [good]
    assert lk.recv_acks() == [{"seq": nxt, "ok": True}]
    assert holds(rig, w, 1, 1, (81, 82, 83))
    assert (ap.applied, ap.refused) == (2, 1)


def test_refused_between_good_orders_of_one_take(worker, caplog) -> None:
    """A bad message between two good ones: both good ones are applied, in order."""
    rig, w, lk, ap = worker
    a = order(1, restore=[ExpertMove(0, 7, reserve(rig, 0, 7))])
    b = order(2, restore=[ExpertMove(1, 1, reserve(rig, 1, 1))])
    lk.send_order(encode(a))
    lk.send_order(encode(a))  # a repeat
    lk.send_order(encode(b))
    with caplog.at_level(logging.ERROR, logger=APPLIER_LOG):
        assert ap.take_orders() == 2
    assert lk.recv_acks() == [{"seq": 1, "ok": False, "error": (
        "migration order seq=1 (round 5) repeats or is older than the last accepted seq=1; refused")}]
    assert ap.finish() == [a, b]
    assert lk.recv_acks() == [{"seq": 1, "ok": True}, {"seq": 2, "ok": True}]
    assert (ap.applied, ap.refused) == (2, 1)
    assert holds(rig, w, 0, 7, (78, 79, 80)) and holds(rig, w, 1, 1, (81, 82, 83))


def test_orders_taken_together_are_checked_against_the_ones_before_them(worker, caplog) -> None:
    """Orders pending in one pass are applied in seq order: a later one is checked
    against the residency as the earlier ones will leave it."""
    rig, w, lk, ap = worker
    a = order(1, evict=[ExpertMove(0, 2, (15, 16, 17))], restore=[ExpertMove(0, 7, (78, 79, 80))])
    b = order(2, evict=[ExpertMove(0, 7, (78, 79, 80))])  # a's restore, still pending
    c = order(3, restore=[ExpertMove(1, 1, (80, 81, 82))])  # onto a's reserved page 80
    d = order(4, evict=[ExpertMove(0, 5, (12, 13, 14)), ExpertMove(0, 0, (9, 10, 11))])  # 2 + 1 + 2 > 4
    e = order(5, evict=[ExpertMove(0, 5, (12, 13, 14))])  # 2 + 1 + 1: fine
    for o in (a, b, c, d, e):
        lk.send_order(encode(o))
    with caplog.at_level(logging.ERROR, logger=APPLIER_LOG):
        assert ap.take_orders() == 2
    assert [(x["seq"], x["ok"], x["error"]) for x in lk.recv_acks()] == [
        (2, False, "migration order seq=2 moves layer 0 expert 7, which pending order seq=1 moves; refused"),
        (3, False, "migration order seq=3 restores onto pages [80] that a pending order restores onto; refused"),
        (4, False, "migration order seq=4 would leave layer 0 with 5 experts offloaded, over the limit 4; "
                   "refused")]
    assert ap.finish() == [a, e]
    assert lk.recv_acks() == [{"seq": 1, "ok": True}, {"seq": 5, "ok": True}]
    assert w.residency.offloaded(0) == [5, 2, 6] and w.residency.pages(0, 7) == (78, 79, 80)


def test_long_refused_message_is_quoted_truncated(worker, caplog) -> None:
    _, _, lk, ap = worker
    raw = b"\xff" * 1000
    with caplog.at_level(logging.ERROR, logger=APPLIER_LOG):
        lk.send_order(raw)
        ap.take_orders()
    [rec] = [r for r in caplog.records if r.name == APPLIER_LOG]
    quoted = repr(b"\xff" * 300 + b"...")
    assert rec.getMessage().endswith(f"; received {quoted}")
    assert lk.recv_acks()[0]["seq"] is None


def test_finish_without_blocking_leaves_orders_whose_copies_still_run(worker, monkeypatch) -> None:
    # Under the overlap scheduler the scheduler never waits on PCIe: after a pass an
    # order whose restore copies are still running stays pending and is acknowledged
    # by a later finish; a blocking finish (idle round, urgent eviction) waits for it.
    rig, w, lk, ap = worker
    pages = reserve(rig, 0, 7)
    o = order(1, restore=[ExpertMove(0, 7, pages)])
    lk.send_order(encode(o))
    assert ap.take_orders() == 1
    landed = {"done": False}
    monkeypatch.setattr(w.manager, "uploads_done", lambda: landed["done"])
    assert ap.finish(block=False) == [] and ap.pending == (o,) and lk.recv_acks() == []
    landed["done"] = True
    assert ap.finish(block=False) == [o] and lk.recv_acks() == [{"seq": 1, "ok": True}]
    # blocking: acknowledged whatever uploads_done says (it waits for the copies)
    pages = reserve(rig, 1, 1)
    lk.send_order(encode(order(2, restore=[ExpertMove(1, 1, pages)])))
    landed["done"] = False
    ap.take_orders()
    assert [x.seq for x in ap.finish()] == [2]
