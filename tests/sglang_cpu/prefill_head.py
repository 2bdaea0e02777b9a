"""Run in a child process (it imports SGLang with the CPU stand-in): the prefill-demand
seam against SGLang's own PrefillAdder, Req and RadixCache over the unified pool.

The pool is the adjuster tests' rig (``tests/adjuster/rig.py``): 2 KV tokens per
expert page (page size 1), experts on pages 0..53, free expert pages after.
Each scenario: a cached 8-token prefix (evictable), then the waiting queue

    A  10 tokens                 total 10 + 8 + 1 = 19
    B  20 tokens                 total 29
    C  8 cached + 6 new tokens   total  6 + 8 + 1 = 15; locking its prefix takes
                                 the 8 cached tokens out of "evictable"
    D  16 tokens                 total 25
    E  30 tokens                 beyond max_prefill_tokens 60 (A..D take 52)

(max_new_tokens 8 each), run through the loop of
``Scheduler._get_new_batch_prefill_raw`` (prefix match, ``add_one_req``, stop at
the first result other than CONTINUE or at the request limit).  With 52 free
tokens + 8 evictable, A and B fit (60 - 19 - 29 = 12 left) and C is refused
(15 >= 12).  The head SGLang would take if memory allowed is C and D (with
unlimited KV, E is refused by max_prefill_tokens): C needs 15 < 52 + 0 - 48 + x once its prefix is
locked (x >= 12: a budget formula without the lock would say 4), D then needs
25 < 52 - 48 - 15 + x, so x = 37 and the seam's demand is 52 + 37 = 89 KV tokens.
With x = 37 more free tokens SGLang's loop admits A..D; with 36 it admits A..C.
"""

import sys
import types
from array import array
from pathlib import Path

import torch

from rimuru_patches.bootstrap import bootstrap_process
from rimuru_patches.context import ProcessContext

bootstrap_process(ProcessContext(device="cpu"))

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.runtime_context import get_parallel, publish  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from rimuru_patches import elastic  # noqa: E402
from rimuru_patches.prefill_head import head_demand  # noqa: E402
from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator  # noqa: E402
from sglang_rimuru.adjuster import Adjuster, AdjusterPolicy  # noqa: E402
from sglang_rimuru.models import ensure_model  # noqa: E402
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.adjuster.rig
from tests.adjuster.rig import make_rig  # noqa: E402

# PrefillAdder reads SGLang's published config and parallel state (one CPU rank here)
publish(ServerArgs(model_path=str(ensure_model("tiny-qwen3-moe")), device="cpu"), role="test")
ONE_RANK = get_parallel().override(tp_size=1, attn_tp_size=1, attn_cp_size=1, pp_size=1)
ONE_RANK.__enter__()  # for the whole script (kept referenced: its exit restores)

ADD = PrefillAdder.add_one_req  # SGLang's own, unwrapped
KW = dict(has_chunked_req=False, truncation_align_size=None)
PREFIX = list(range(500, 508))
MAX_PREFILL = 60


def req(rid: str, ids: list[int], ignore_eos: bool = False) -> Req:
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=ignore_eos)
    sp.normalize(None)
    return Req(rid, "", array("q", ids), sp)


def scenario(extra: int, pages: int = 84 + 40, radix: bool = True, ignore_eos: bool = False):
    """The pool, allocator, cache and queue, with ``extra`` more free KV tokens than the base (52)."""
    rig = make_rig(pages=pages, limit=5)
    alloc = PooledTokenToKVPoolAllocator(10_000, dtype=torch.bfloat16, device="cpu", kvcache=None,
                                         need_sort=False, runtime=types.SimpleNamespace(page_pool=rig.pool))
    ballast = 2 * (pages - 84) - extra  # pages beyond 84 give 2 tokens each; all but `extra` held
    if ballast:
        alloc.alloc(ballast)
    cache = RadixCache(CacheInitParams(disable=not radix, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=alloc, page_size=1))
    if radix:
        cache.insert(InsertParams(key=RadixKey(array("q", PREFIX)), value=alloc.alloc(len(PREFIX))))
    queue = [req("A", list(range(100, 110)), ignore_eos), req("B", list(range(200, 220)), ignore_eos),
             req("C", PREFIX + list(range(300, 306)), ignore_eos), req("D", list(range(400, 416)), ignore_eos),
             req("E", list(range(600, 630)), ignore_eos)]
    return types.SimpleNamespace(rig=rig, alloc=alloc, cache=cache, queue=queue)


def run_loop(s, add=ADD, max_requests: int = 16):
    """The request loop of Scheduler._get_new_batch_prefill_raw (plain scheduler)."""
    adder = PrefillAdder(1, s.cache, s.alloc, ScheduleBatch(reqs=[], batch_is_full=False), 0.7,
                         MAX_PREFILL, None, max_running_requests=max_requests)
    last = None
    for r in s.queue:
        if len(adder.can_run_list) >= max_requests:
            break
        r.init_next_round_input(s.cache)
        last = (r, add(adder, r, **KW))
        if last[1] is not AddReqResult.CONTINUE:
            break
    return adder, last


def rids(adder) -> str:
    return "".join(r.rid for r in adder.can_run_list)


# ---- the base scenario: C refused; what the head (C, D) lacks, from SGLang's own add_one_req
s = scenario(0)
assert s.alloc.available_size() == 52 and s.cache.evictable_size() == 8
adder, (refused, result) = run_loop(s)
assert (rids(adder), refused.rid, result) == ("AB", "C", AddReqResult.NO_TOKEN), (rids(adder), refused.rid, result)
before = (dict(vars(adder)), {r.rid: dict(vars(r)) for r in s.queue[:3]}, s.cache.evictable_size(),
          s.cache.protected_size())
head = head_demand(ADD, adder, refused, s.queue, 16, kwargs=KW)
assert (head.extra_tokens, head.requests) == (37, 2), head
# the probes left SGLang's objects as they were (D and E were prefix-matched, as the loop would)
after = (dict(vars(adder)), {r.rid: dict(vars(r)) for r in s.queue[:3]}, s.cache.evictable_size(),
         s.cache.protected_size())
assert after == before
# SGLang's request limit ends the head: with 3 requests at most, only C
assert head_demand(ADD, adder, refused, s.queue, 3, kwargs=KW).extra_tokens == 12

# ---- exactly that much: with 37 more free tokens SGLang admits A..D, with 36 only A..C
s37 = scenario(37)
adder37, last37 = run_loop(s37)
assert (rids(adder37), last37[0].rid, last37[1]) == ("ABCD", "E", AddReqResult.NO_TOKEN), rids(adder37)
# E is refused for KV first, but no amount of KV admits it this round (max_prefill_tokens): no demand
assert head_demand(ADD, adder37, last37[0], s37.queue, 16, kwargs=KW) is None
adder36, last36 = run_loop(scenario(36))
assert (rids(adder36), last36[0].rid, last36[1]) == ("ABC", "D", AddReqResult.NO_TOKEN), rids(adder36)
adder11, _ = run_loop(scenario(11))
assert rids(adder11) == "AB"  # C alone needs 12 (its locked prefix no longer counts as evictable)
assert rids(run_loop(scenario(12))[0]) == "ABC"

# ---- the seam (elastic.py) around SGLang's add_one_req: the demand it gives the adjuster
noted = []
ctl = types.SimpleNamespace(note_demand=lambda kv, requests=1: noted.append(kv), clear_demand=lambda: noted.append(0))
elastic._controller = lambda: ctl
s = scenario(0)
elastic._scheduler = types.SimpleNamespace(waiting_queue=s.queue, get_num_allocatable_reqs=lambda running_bs: 16)
seam = elastic._prefill_shortfall(ADD, None)
adder, _ = run_loop(s, add=seam)
assert noted == [0, 0, 52 + 37], noted  # A and B admitted (no demand), then C's head

# ---- pool and adjuster: that demand evicts enough experts for SGLang to admit the head
rig = s.rig
adj = Adjuster(AdjusterPolicy(), rig.pool, rig.residency, rig.ranking)
assert rig.pool.missing_expert_pages(89) == 19  # 37 tokens = 18.5 expert pages short
order = adj.plan_round(0, 89)
assert len(order.evict) == 7 and order.reason.startswith("kv_short: R_b=19 "), order  # ceil((19 + 1) / 3)
adj.complete(order)
assert s.alloc.available_size() == 52 + 42
adder, last = run_loop(s)
assert (rids(adder), last[0].rid) == ("ABCD", "E"), rids(adder)

# ---- no radix cache, ignore_eos: SGLang's other admission path (add_one_req_ignore_eos, which
# simulates the decode of every running request); the same probes find its exact threshold
s = scenario(0, radix=False, ignore_eos=True)
adder, (refused, result) = run_loop(s)
assert result is AddReqResult.NO_TOKEN
head = head_demand(ADD, adder, refused, s.queue, 16, kwargs=KW)
n = len(adder.can_run_list) + head.requests
for extra, admitted in ((head.extra_tokens, n), (head.extra_tokens - 1, n - 1)):
    got = run_loop(scenario(extra, radix=False, ignore_eos=True))[0]
    assert len(got.can_run_list) == admitted, (extra, rids(got), head)
print(f"ignore_eos path: {rids(adder)} admitted, {refused.rid} refused, head {head}")
print("OK")
