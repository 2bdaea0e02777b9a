"""The migration-order protocol shares no mutable object across the scheduler/worker line.

Scheduler side: ``ElasticController`` (its ``Adjuster``: the page pool and the
adjuster's own ``ExpertResidency``; the link's ``SchedulerEnd``). Worker side:
``OrderApplier`` (its ``ExpertManager``: the worker's own ``ExpertResidency``,
page tables, pool bytes; the link's ``WorkerEnd``). The controller reaches the
worker only to give it its turns (``worker.take_orders`` / ``worker.finish``):
in SGLang 0.5.17 the worker runs in the scheduler's thread.

* every object reachable from one side that is also reachable from the other is
  immutable shared data (the shape, the ranking, the geometry) or the ZMQ
  context both ends' sockets live in: checked by walking both object graphs of
  the production wiring (``RimuruRuntime._build_elastic``), and shown to catch
  the old wiring (one residency for both);
* the two residencies agree after every batch of acks the scheduler reads
  (seeded random rounds of the controller's ``Sim``);
* static: ``applier.py`` names nothing of the scheduler side; the controller
  calls nothing on the worker but its turns; the manager never sees the pool.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import random
import types
from pathlib import Path

import pytest
import torch
import zmq

from sglang_rimuru.config import RimuruConfig
from sglang_rimuru.experts import ExpertManager, ExpertRanking, MoEShape
from sglang_rimuru.pool import PoolGeometry

from .rig import make_rig, make_worker
from .test_controller import Elastic, Sim, views_agree

ROOT = Path(__file__).resolve().parents[2]
#: immutable values both sides may hold (built once from the model and the ranking
#: file); and the process's ZMQ context, which only carries the link's bytes
SHARED_BY_VALUE = (MoEShape, ExpertRanking, PoolGeometry, torch.dtype, torch.device, zmq.Context)
_ATOMS = (int, float, complex, str, bytes, bool, type(None), range, type, types.ModuleType,
          types.BuiltinFunctionType, types.CodeType)


def reachable(root, stop=()) -> tuple[dict[int, object], set[int]]:
    """Objects reachable from ``root`` (by id) through attributes, slots, containers,
    bound methods and closures, never entering ``stop``; and the data pointers of
    the tensor storages among them."""
    stop = {id(s) for s in stop}
    seen: dict[int, object] = {}
    storages: set[int] = set()
    todo = [root]
    while todo:
        o = todo.pop()
        if isinstance(o, _ATOMS) or id(o) in seen or id(o) in stop:
            continue
        seen[id(o)] = o
        if isinstance(o, SHARED_BY_VALUE):
            continue
        if isinstance(o, torch.Tensor):
            storages.add(o.untyped_storage().data_ptr())
            continue
        if isinstance(o, dict):
            todo += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            todo += list(o)
        elif isinstance(o, types.MethodType):
            todo.append(o.__self__)
        elif isinstance(o, types.FunctionType):
            todo += [c.cell_contents for c in o.__closure__ or ()]
        else:
            todo += list(getattr(o, "__dict__", {}).values())
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(o, name):
                        todo.append(getattr(o, name))
    return seen, storages


def _immutable(o) -> bool:
    """Shared by value: allow-listed types, tuples / frozensets (their contents are walked
    too) and frozen dataclasses (an ``ExpertKey``, a ``MigrationOrder``)."""
    return (isinstance(o, SHARED_BY_VALUE + (tuple, frozenset))
            or (dataclasses.is_dataclass(o) and type(o).__dataclass_params__.frozen))


def shared_state(scheduler_root, worker_root, stop=()):
    """Mutable objects reachable from both sides; the tensor storages of each side."""
    sched, sched_storages = reachable(scheduler_root, stop)
    work, work_storages = reachable(worker_root)
    shared = [sched[i] for i in sched.keys() & work.keys() if not _immutable(sched[i])]
    return shared, sched_storages, work_storages


def production_wiring(rig, worker):
    """The controller and applier as the server builds them (``RimuruRuntime._build_elastic``)."""
    from rimuru_patches.unified_pool.runtime import RimuruRuntime

    ctl = RimuruRuntime._build_elastic(RimuruConfig(mode="elastic"), rig.pool, rig.residency, rig.ranking,
                                       worker.manager, tp_rank=0)
    return ctl, ctl.worker


def test_the_two_sides_share_no_mutable_object() -> None:
    rig = make_rig(pages=100)
    worker = make_worker(rig)
    ctl, applier = production_wiring(rig, worker)
    try:
        # a few real rounds first, so that orders, acks and counters exist on both sides
        e = Elastic(rig, worker, None, applier, ctl)
        log = []
        sim = Sim(e, random.Random(3))
        for _ in range(40):
            sim.step(log)
        assert ctl.snapshot()["orders_completed"] > 3
        shared, sched_storages, work_storages = shared_state(ctl, applier, stop=[ctl.worker])
        assert shared == []
        assert sched_storages == set()  # the scheduler side holds no tensor at all
        assert work_storages  # the worker's tables and pool bytes
        # the scheduler end and the worker end of the link are different sockets
        assert ctl.link is not applier.link
        assert applier.manager.residency is not ctl.adjuster.residency
    finally:
        ctl.link.close()
        applier.link.close()


def test_the_walk_finds_a_shared_residency() -> None:
    # the wiring before the protocol: the worker's manager over the scheduler's residency
    rig = make_rig(pages=84)
    worker = make_worker(rig)
    shared_manager = ExpertManager(rig.shape, worker.buffer, rig.residency, worker.host, worker.buffers,
                                   None, "cpu")
    ctl, applier = production_wiring(rig, worker)
    try:
        applier.manager = shared_manager
        shared, _, _ = shared_state(ctl, applier, stop=[ctl.worker])
        assert any(o is rig.residency for o in shared)
    finally:
        ctl.link.close()
        applier.link.close()


@pytest.mark.parametrize("seed", [4, 5])
def test_views_agree_after_every_ack(seed) -> None:
    """Separately built residencies, reconciled only by acks: after the scheduler has
    read the acks (``_collect``), its view is exactly the worker's residency."""
    rig = make_rig(pages=100)
    worker = make_worker(rig)
    ctl, applier = production_wiring(rig, worker)
    try:
        e = Elastic(rig, worker, None, applier, ctl)
        assert e.res is not worker.residency
        collect, checked = ctl._collect, []

        def checking_collect():
            done = collect()
            assert views_agree(e), (ctl.adjuster.residency.placement(), worker.residency.placement())
            checked.append(len(done))
            return done

        ctl._collect = checking_collect
        sim, log = Sim(e, random.Random(seed)), []
        for _ in range(200):
            sim.step(log)
        s = ctl.snapshot()
        assert sum(checked) == s["orders_completed"] > 20
        assert s["evictions"] > 10 and s["restores"] > 10
    finally:
        ctl.link.close()
        applier.link.close()


# ---------------------------------------------------------------- static


def _names(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.name for a in node.names)
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
    return out


def test_the_applier_names_nothing_of_the_scheduler_side() -> None:
    names = _names("sglang_rimuru/adjuster/applier.py")
    scheduler_side = {"adjuster", "Adjuster", "controller", "ElasticController", "page_pool", "UnifiedPagePool",
                      "complete", "abort", "plan_round", "SchedulerEnd", "send_order", "recv_acks", "pool"}
    assert not names & scheduler_side


def test_the_controller_only_gives_the_worker_its_turns() -> None:
    tree = ast.parse((ROOT / "sglang_rimuru/adjuster/controller.py").read_text())
    uses = []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "worker" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            up = parents[node]
            if isinstance(up, ast.Attribute):
                uses.append(up.attr)
            elif isinstance(up, ast.Assign) and node in up.targets:
                uses.append("=")
            else:
                uses.append(type(up).__name__)
    assert set(uses) == {"take_orders", "finish", "="} and uses.count("=") == 1, uses
    assert not _names("sglang_rimuru/adjuster/controller.py") & {"applier", "OrderApplier", "manager",
                                                                 "WorkerEnd", "recv_orders", "send_ack"}


def test_the_worker_side_never_sees_the_pool() -> None:
    for path in ("sglang_rimuru/experts/manager.py", "sglang_rimuru/adjuster/applier.py"):
        assert not _names(path) & {"page_pool", "UnifiedPagePool", "free_expert_pages", "alloc_expert_pages"}, path
