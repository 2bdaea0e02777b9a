"""``TPAgreement``: each round's orders compared across TP ranks; a mismatch is one loud line.

First with a scripted ``gather`` (the other rank's row given), then with two
processes over a real gloo group: each runs the real ``ElasticController`` on
the rig (``rig.py``) with the production gather (``rimuru_patches.elastic.tp_agreement``),
and rank 1 is fed a different KV demand, as a desynced rank would compute it.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import queue
import re
import traceback
import types

import pytest

from sglang_rimuru.adjuster import ExpertMove, MigrationOrder, encode
from sglang_rimuru.adjuster.agreement import RanksDisagree, TPAgreement, describe

ORDER = MigrationOrder(version=1, seq=1, round=3, evict=(ExpertMove(0, 2, (15, 16, 17)),), restore=(), reason="x")
OTHER = MigrationOrder(version=1, seq=1, round=3, evict=(ExpertMove(1, 2, (33, 34, 35)),), restore=(), reason="x")


@pytest.fixture
def elastic_ctl():
    from sglang_rimuru.adjuster import Adjuster, AdjusterPolicy
    from sglang_rimuru.adjuster.applier import OrderApplier
    from sglang_rimuru.adjuster.controller import ElasticController
    from sglang_rimuru.adjuster.link import OrderLink

    from .rig import make_rig, make_worker

    rig = make_rig(pages=84)
    link = OrderLink()
    yield ElasticController(Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking), link.scheduler,
                            OrderApplier(make_worker(rig).manager, link.worker), check_invariants=True)
    link.close()


def scripted(other_rows: list[tuple[int, int, int]]):
    """A gather for rank 0 of two: its own row, then the next scripted row of rank 1."""
    sent = []

    def gather(row):
        sent.append(row)
        return [row, other_rows.pop(0)]

    return gather, sent


def test_equal_rows_pass_and_the_digest_covers_only_orders_since_the_last_check() -> None:
    gather, sent = scripted([(0, 0, 0), (1, 0, 0), (3, 1, 0)])
    a = TPAgreement(gather, rank=0)
    a.planned(0, None, None)
    a.check()
    a.planned(1, None, None)
    a.check()
    # an order: a nonzero digest, the same on every rank that planned the same bytes
    a.planned(2, None, None)
    a.planned(3, ORDER, encode(ORDER))
    round_, seq, digest = a.row()
    assert (round_, seq) == (3, 1) and digest != 0
    b = TPAgreement(gather, rank=1)
    b.planned(3, ORDER, encode(ORDER))
    assert b.row() == a.row()
    c = TPAgreement(gather, rank=1)
    c.planned(3, OTHER, encode(OTHER))
    assert c.row()[2] != digest
    # no order since the last check: digest 0 again
    with pytest.raises(RanksDisagree):  # rank 1 (scripted) saw no order in round 3
        a.check()
    assert a.row() == (3, 1, 0)
    assert sent == [(0, 0, 0), (1, 0, 0), (3, 1, digest)]


def test_an_order_on_one_rank_only_is_one_error_line_naming_round_seq_and_ranks(caplog) -> None:
    a = TPAgreement(lambda row: [row, (7, 2, 0x1234)], rank=0)
    a.planned(7, None, None)
    caplog.set_level(logging.ERROR, logger="sglang_rimuru.adjuster.agreement")
    with pytest.raises(RanksDisagree) as exc:
        a.check()
    expected = ("sglang-rimuru: TP ranks planned different migration orders in round 7 "
                "(rank 0: round 7 seq 0 digest 0x0000000000000000; "
                "rank 1: round 7 seq 2 digest 0x0000000000001234; ranks [0] vs ranks [1] disagree); "
                "TP rank 0 stops rather than serve with an expert/KV split the other ranks do not have")
    assert str(exc.value) == expected
    assert [r.getMessage() for r in caplog.records] == [expected]
    assert "\n" not in expected


def test_a_different_number_of_planned_rounds_is_a_mismatch_too() -> None:
    # rank 1 planned one more round (an urgent eviction that found nothing to evict)
    rows = [(5, 1, 0), (6, 1, 0), (5, 1, 0)]
    assert describe(rows, 2) == (
        "sglang-rimuru: TP ranks planned different migration orders in rounds 5/6 "
        "(rank 0: round 5 seq 1 digest 0x0000000000000000; rank 1: round 6 seq 1 digest 0x0000000000000000; "
        "rank 2: round 5 seq 1 digest 0x0000000000000000; ranks [0, 2] vs ranks [1] disagree); "
        "TP rank 2 stops rather than serve with an expert/KV split the other ranks do not have")
    a = TPAgreement(lambda row: [row, (6, 1, 0)], rank=0)
    a.planned(5, None, None)
    with pytest.raises(RanksDisagree, match=r"in rounds 5/6 "):
        a.check()


def test_idle_rounds_are_not_compared_and_their_orders_join_the_next_check(elastic_ctl) -> None:
    # the controller over the rig; rank 0 of two, rank 1 scripted to agree
    rows = []
    ctl = elastic_ctl
    ctl.agreement = TPAgreement(lambda row: rows.append(row) or [row, row], rank=0)
    ctl.note_demand(26)
    evict = ctl.round(forward_follows=False)  # round 0, busy: a request waits; compared
    ctl.clear_demand()
    restore = ctl.round(forward_follows=False, busy=False)  # round 1, quiet: F_b 15, restores; not compared
    assert evict.evict and restore.restore and restore.seq == 2 and len(rows) == 1
    assert ctl.round(forward_follows=True) is None  # round 2, busy: F_b 9, hold; compared
    first, both = TPAgreement(None, 0), TPAgreement(None, 0)
    first.planned(0, evict, encode(evict))
    both.planned(1, restore, encode(restore))
    both.planned(2, None, None)
    assert rows == [first.row(), both.row()] and both.row()[:2] == (2, 2) and both.row()[2] != 0


def test_a_negative_digest_prints_as_its_unsigned_64_bit_value() -> None:
    assert "digest 0xffffffffffffffff" in describe([(0, 1, -1), (0, 1, 0)], 0)


# ---------------------------------------------------------------- two ranks over gloo


def _rank(rank: int, store: str, out) -> None:
    try:
        out.put((rank, _run_rank(rank, store)))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        out.put((rank, traceback.format_exc()))


def _run_rank(rank: int, store: str) -> list:
    """One TP rank: the real controller on the rig, the production gather over gloo."""
    import torch.distributed as dist

    from rimuru_patches.elastic import tp_agreement
    from sglang_rimuru.adjuster import Adjuster, AdjusterPolicy
    from sglang_rimuru.adjuster.applier import OrderApplier
    from sglang_rimuru.adjuster.controller import ElasticController
    from sglang_rimuru.adjuster.link import OrderLink
    from tests.adjuster.rig import make_rig, make_worker

    # a hang becomes an error after a minute (gloo's default is 30)
    limit = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=limit)
    group = dist.new_group([0, 1], backend="gloo", timeout=limit)
    rig = make_rig(pages=84)
    worker = make_worker(rig)
    link = OrderLink()
    ctl = ElasticController(Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking), link.scheduler,
                            OrderApplier(worker.manager, link.worker), check_invariants=True)
    ctl.agreement = tp_agreement(types.SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=group))
    log = []
    try:
        log.append(ctl.round(forward_follows=False) is None)  # round 0: F_b 6, hold on both
        for _ in range(3):  # idle rounds (no request held): not compared, nothing gathered
            ctl.round(forward_follows=False, busy=False)
        ctl.note_demand(26)  # round 4: the same shortfall on both ranks: the same order
        log.append(ctl.round(forward_follows=False).seq)
        # round 5: the request still waits (26 KV pages now fit: hold); rank 1 computes
        # a demand rank 0 does not have and plans an order where rank 0 plans none
        ctl.note_demand(60 if rank == 1 else 26)
        ctl.round(forward_follows=False)
        log.append("no error")
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        log.append(f"{type(e).__name__}: {e}")
        log.append(len(ctl.adjuster.in_flight))
    dist.destroy_process_group()
    return log


def test_two_gloo_ranks_stop_with_the_same_line_when_one_plans_a_different_order(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            try:
                rank, log = out.get(timeout=120)
            except queue.Empty:
                raise AssertionError(f"a rank did not report within 120 s (a hang?); reported: {results}, "
                                     f"alive: {[p.is_alive() for p in procs]}") from None
            results[rank] = log
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        assert isinstance(results[rank], list), results[rank]
        ok0, seq1, error, in_flight = results[rank]
        assert (ok0, seq1) == (True, 1)
        m = re.fullmatch(
            r"RanksDisagree: sglang-rimuru: TP ranks planned different migration orders in round 5 "
            r"\(rank 0: round 5 seq 1 digest 0x0{16}; rank 1: round 5 seq 2 digest 0x([0-9a-f]{16}); "
            r"ranks \[0\] vs ranks \[1\] disagree\); TP rank (\d) stops .*", error)
        assert m and m.group(1) != "0" * 16 and m.group(2) == str(rank), error
        # rank 1's divergent order was planned but never applied (the check comes first)
        assert in_flight == rank
