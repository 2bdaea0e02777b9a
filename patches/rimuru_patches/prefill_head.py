"""The KV the head of SGLang's waiting queue lacks, asked of SGLang's own ``PrefillAdder``.

When ``PrefillAdder.add_one_req`` returns ``NO_TOKEN`` SGLang's prefill loop
(``Scheduler._get_new_batch_prefill_raw``) stops: the refused request and every
request behind it wait.  The adjuster needs to know how many more free KV
tokens would have let this round admit the requests SGLang would take if
memory allowed -- the queue's *head* -- not only the first refused one: a burst
of requests is then answered in one order instead of one request per round.

Nothing of SGLang's budget arithmetic is restated here.  ``head_demand`` runs
SGLang's own (unwrapped) ``add_one_req`` on *probes*: shallow copies of the
adder (its lists and dicts copied) whose allocator reports ``x`` more free
tokens (``available_size() + x``; every other method is the real allocator's).
A probe continues the loop where SGLang stopped, in queue order, as the loop
does: it stops at SGLang's request limit (``get_num_allocatable_reqs``, the
loop's ``batch_is_full`` rule) and at the first result other than
``CONTINUE``.  The head is what a probe with unlimited memory admits; its
limits are SGLang's own (``max_prefill_tokens``, chunked prefill,
``prefill_max_requests``, running requests, request slots).  The demand is the
least ``x`` whose probe admits the whole head (exponential, then binary
search; admission only grows with free memory), so with ``x - 1`` more free
tokens SGLang would admit fewer (``tests/sglang_cpu/prefill_head.py`` checks
both against SGLang's real loop over the unified pool).  Cost: about
2 log2(x) probes of at most the head's length each, only in rounds where
SGLang refuses a prefill for KV (a 15-request head lacking 725 tokens: 22
probes, 2.3 ms on the 2-core development machine).

What a probe may touch, and how it is undone:

* the adder: only the probe (a copy; ``prefill_delayer_single_pass`` is set to
  None, since the delayer negotiates with other ranks and does not weigh
  memory);
* each probed request's attributes (``set_extend_range``, ...): restored from a
  snapshot after each call;
* the radix tree: ``add_one_req`` locks the admitted request's prefix
  (``_req_inc_lock_ref``), which later requests' budgets see; a probe takes
  that lock through SGLang's own ``_lock_node`` context instead and releases
  every lock when the probe ends;
* requests SGLang did not reach this round get ``init_next_round_input``
  (SGLang's own prefix match, what the loop would run on them); it refreshes
  their prefix and touches the radix tree's LRU times, nothing else.

Outside the plain loop this is not exact: LoRA admission checks, priority
preemption, HiCache storage prefetch and PD-disaggregation's prefill limits
are not in the probe's loop (the head may be longer than SGLang would take); a
request that would load KV back from host memory (``needs_host_load_back``)
ends the head, because probing it would start the copy.  The project runs
none of these in elastic mode.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

__all__ = ["HeadDemand", "head_demand"]

#: "memory allowed": more free KV tokens than any pool has
_UNLIMITED = 1 << 40


@dataclass(frozen=True)
class HeadDemand:
    #: free KV tokens beyond the allocator's ``available_size()`` that admit the head
    extra_tokens: int
    #: requests in the head
    requests: int
    #: probes run (the cost: each calls ``add_one_req`` up to ``requests`` times)
    probes: int


class _MoreFree:
    """The allocator, reporting ``extra`` more free tokens."""

    def __init__(self, allocator, extra: int) -> None:
        self._allocator = allocator
        self._extra = extra

    def available_size(self, *args, **kwargs):
        return self._allocator.available_size(*args, **kwargs) + self._extra

    def __getattr__(self, name):
        return getattr(self._allocator, name)


def head_demand(add_one_req, adder, refused, queue, max_requests, args=(), kwargs=None) -> HeadDemand | None:
    """What the waiting queue's head lacks, after ``add_one_req(adder, refused)`` returned ``NO_TOKEN``.

    ``add_one_req``: SGLang's own (unwrapped) ``PrefillAdder.add_one_req``;
    ``args`` / ``kwargs``: the loop's arguments to it. ``queue``: the waiting
    queue in the order SGLang visits it (``refused`` in it; requests before it
    were admitted). ``max_requests``: ``get_num_allocatable_reqs(running_bs)``
    (None: no limit). None when more memory would admit nothing (the queue
    ends, or SGLang's other limits are reached).
    """
    from sglang.srt.managers.schedule_policy import AddReqResult

    kwargs = kwargs or {}
    at = next((i for i, r in enumerate(queue) if r is refused), None)
    if at is None:
        queue, at = [refused], 0
    # NO_TOKEN also comes from the budget left *after* admitting the request
    admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is refused
    head = list(queue[at + 1:] if admitted else queue[at:])
    first_unprepared = 0 if admitted else 1  # SGLang ran init_next_round_input on `refused` only
    probes = 0

    def admits(extra: int, prepare: bool = False) -> int:
        nonlocal probes
        probes += 1
        probe = copy.copy(adder)
        for name, value in list(vars(probe).items()):
            if isinstance(value, (list, dict, set)):
                setattr(probe, name, copy.copy(value))
        probe.token_to_kv_pool_allocator = _MoreFree(adder.token_to_kv_pool_allocator, extra)
        probe.prefill_delayer_single_pass = None
        n = 0
        with contextlib.ExitStack() as held:
            probe._req_inc_lock_ref = lambda r: held.enter_context(probe._lock_node(r.last_node))
            for i, req in enumerate(head):
                if max_requests is not None and len(probe.can_run_list) >= max_requests:
                    break
                if prepare and i >= first_unprepared:
                    req.init_next_round_input(adder.tree_cache)
                if req.needs_host_load_back():
                    break
                saved = dict(vars(req))
                try:
                    result = add_one_req(probe, req, *args, **kwargs)
                finally:
                    state = vars(req)
                    state.clear()
                    state.update(saved)
                if probe.can_run_list and probe.can_run_list[-1] is req:
                    n += 1
                if result is not AddReqResult.CONTINUE:
                    break
        return n

    # the unlimited probe reaches every request a smaller one reaches: it prepares them
    whole = admits(_UNLIMITED, prepare=True)
    if whole == 0:
        return None
    lo, hi = -1, 0
    while admits(hi) < whole:
        lo, hi = hi, max(1, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if admits(mid) < whole:
            lo = mid
        else:
            hi = mid
    return HeadDemand(extra_tokens=hi, requests=whole, probes=probes)
