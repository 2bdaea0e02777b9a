"""Randomized alloc/free against an independent byte-level shadow model.

The shadow knows nothing of the pool's data structures: it marks the bytes of
every page handed out (from the byte formulas alone) and so catches any byte
handed out twice, including a KV page overlapping an expert or SSM page.  From
the same bytes it recomputes F_b, the KV capacity and the SSM capacity, and
checks that an allocation fails exactly when the shadow says it must.
``check_invariants()`` runs after every step.  At the end everything is freed
and the pool must be all whole huge pages again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from sglang_rimuru.pool import ExpertKey, PoolGeometry, UnifiedPagePool, load_buffer_owner

GEOMETRIES = {
    "divides": PoolGeometry(total_bytes=6 * 12 + 5, expert_page_bytes=12, kv_page_bytes=4),
    "holes": PoolGeometry(total_bytes=6 * 12, expert_page_bytes=12, kv_page_bytes=5),
    "qwen15_ratio": PoolGeometry(total_bytes=5 * 88, expert_page_bytes=88, kv_page_bytes=3),
    "hybrid": PoolGeometry(total_bytes=4 * 24, expert_page_bytes=12, kv_page_bytes=4,
                           ssm_page_bytes=8),
    "hybrid_one_kv": PoolGeometry(total_bytes=5 * 20 + 3, expert_page_bytes=10, kv_page_bytes=10,
                                  ssm_page_bytes=4),
}
STEPS = 3000


@dataclass
class Shadow:
    g: PoolGeometry
    used: bytearray = field(init=False)
    experts: dict[int, object] = field(default_factory=dict)
    kv: dict[int, str] = field(default_factory=dict)
    ssm: dict[int, str] = field(default_factory=dict)
    expert_like_live: list[int] = field(init=False)  # per huge page: expert + KV pages held
    ssm_live: list[int] = field(init=False)
    kv_ids_of: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        g = self.g
        self.used = bytearray(g.pool_bytes)
        self.expert_like_live = [0] * g.num_huge_pages
        self.ssm_live = [0] * g.num_huge_pages
        e, k = g.expert_page_bytes, g.kv_page_bytes
        self.kv_ids_of = [[i for i in range(g.num_kv_page_ids)
                           if i * k >= j * e and (i + 1) * k <= (j + 1) * e]
                          for j in range(g.num_expert_pages)]

    def _span(self, kind: str, i: int) -> tuple[int, int]:
        size = {"e": self.g.expert_page_bytes, "k": self.g.kv_page_bytes,
                "s": self.g.ssm_page_bytes}[kind]
        assert size is not None
        return i * size, (i + 1) * size

    def take(self, kind: str, i: int) -> None:
        a, b = self._span(kind, i)
        assert b <= self.g.pool_bytes, f"{kind}{i} past the buffer"
        assert not any(self.used[a:b]), f"{kind}{i} bytes [{a},{b}) handed out twice"
        self.used[a:b] = b"\x01" * (b - a)
        self._count(kind, a, +1)

    def give(self, kind: str, i: int) -> None:
        a, b = self._span(kind, i)
        assert all(self.used[a:b]), f"{kind}{i} freed but not fully held"
        self.used[a:b] = bytes(b - a)
        self._count(kind, a, -1)

    def _count(self, kind: str, byte: int, d: int) -> None:
        h = byte // self.g.huge_page_bytes
        (self.ssm_live if kind == "s" else self.expert_like_live)[h] += d

    def _free(self, kind: str, i: int) -> bool:
        a, b = self._span(kind, i)
        return not any(self.used[a:b])

    def free_expert_pages(self) -> int:
        epH = self.g.expert_pages_per_huge_page
        return sum(1 for j in range(self.g.num_expert_pages)
                   if self.ssm_live[j // epH] == 0 and self._free("e", j))

    def kv_capacity(self) -> int:
        epH = self.g.expert_pages_per_huge_page
        return sum(1 for j in range(self.g.num_expert_pages) if self.ssm_live[j // epH] == 0
                   for i in self.kv_ids_of[j] if self._free("k", i))

    def ssm_capacity(self) -> int:
        spH = self.g.ssm_pages_per_huge_page
        return sum(1 for s in range(self.g.num_ssm_pages)
                   if self.expert_like_live[s // spH] == 0 and self._free("s", s))


def _random_owner(rng: random.Random) -> object:
    if rng.random() < 0.8:
        return ExpertKey(rng.randrange(4), rng.randrange(8), rng.choice(("w1", "w3", "w2")))
    return load_buffer_owner(rng.randrange(4))


def _step(rng: random.Random, p: UnifiedPagePool, sh: Shadow) -> None:
    g = p.geometry
    ops = ["kv", "kv", "kv_runs", "kv_free", "kv_free_req", "expert", "expert_free"]
    if g.has_ssm:
        ops += ["ssm", "ssm_free"]
    op = rng.choice(ops)
    if op == "kv":
        n = rng.choice([1, 1, 1, 2, 3, 5, 8, 13])
        req = f"r{rng.randrange(6)}"
        mine = [k for k, o in sh.kv.items() if o == req]
        near = rng.choice(mine) if mine and rng.random() < 0.7 else None
        if near is None and rng.random() < 0.1:
            near = rng.randrange(g.num_kv_page_ids)  # any id, maybe a hole or a free page
        cap = sh.kv_capacity()
        assert p.kv_capacity_now() == cap
        got = p.alloc_kv_pages(n, req, near=near)
        assert (got is None) == (n > cap)
        for k in got or ():
            sh.take("k", k)
            sh.kv[k] = req
        if got:
            assert len(set(got)) == n
    elif op == "kv_runs":  # one batch: some requests take pages near their last, others stay live
        reqs = [f"r{i}" for i in range(6)]
        last = {r: max(k for k, o in sh.kv.items() if o == r) for r in set(sh.kv.values())}
        batch = rng.sample(reqs, rng.randint(1, 4))
        counts = [rng.choice([0, 1, 1, 2, 5]) for _ in batch]
        near = [last.get(r) for r in batch]
        tails = [k for r, k in last.items() if r not in batch and rng.random() < 0.8]
        cap = sh.kv_capacity()
        got = p.alloc_kv_runs(counts, near, "runs", tails=tails)
        assert (got is None) == (sum(counts) > cap)
        at = 0
        for r, c in zip(batch, counts):
            for k in (got or [])[at:at + c]:
                sh.take("k", k)
                sh.kv[k] = r
            at += c
        if got is not None:
            assert len(got) == sum(counts) == len(set(got))
    elif op == "kv_free" and sh.kv:
        ids = rng.sample(sorted(sh.kv), rng.randint(1, min(4, len(sh.kv))))
        p.free_kv_pages(ids)
        for k in ids:
            sh.give("k", k)
            del sh.kv[k]
    elif op == "kv_free_req" and sh.kv:
        req = rng.choice(sorted(set(sh.kv.values())))
        ids = [k for k, o in sh.kv.items() if o == req]
        p.free_kv_pages(ids)
        for k in ids:
            sh.give("k", k)
            del sh.kv[k]
    elif op == "expert":
        n = rng.choice([1, 1, 2, 3])
        owners = [_random_owner(rng) for _ in range(n)]
        fb = sh.free_expert_pages()
        assert p.free_expert_page_count() == p.stats().free_expert_pages == fb
        got = p.alloc_expert_pages(n, owners)
        assert (got is None) == (n > fb)
        for j, o in zip(got or (), owners):
            sh.take("e", j)
            sh.experts[j] = o
            assert p.expert_page_owner(j) == o
    elif op == "expert_free" and sh.experts:
        ids = rng.sample(sorted(sh.experts), rng.randint(1, min(3, len(sh.experts))))
        p.free_expert_pages(ids)
        for j in ids:
            sh.give("e", j)
            del sh.experts[j]
    elif op == "ssm":
        n = rng.choice([1, 1, 2, 4])
        cap = sh.ssm_capacity()
        got = p.alloc_ssm_pages(n, [f"s{rng.randrange(9)}"] * n)
        assert (got is None) == (n > cap)
        for s in got or ():
            sh.take("s", s)
            sh.ssm[s] = "x"
    elif op == "ssm_free" and sh.ssm:
        ids = rng.sample(sorted(sh.ssm), rng.randint(1, min(3, len(sh.ssm))))
        p.free_ssm_pages(ids)
        for s in ids:
            sh.give("s", s)
            del sh.ssm[s]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_random_alloc_free_matches_shadow(name: str, seed: int) -> None:
    g = GEOMETRIES[name]
    rng = random.Random(f"{name}-{seed}")
    p = UnifiedPagePool(g)
    sh = Shadow(g)
    for _ in range(STEPS):
        _step(rng, p, sh)
        p.check_invariants()
        s = p.stats()
        assert s.kv_pages_used == len(sh.kv)
        assert s.expert_pages + s.other_expert_pages == len(sh.experts)
        assert s.ssm_pages_used == len(sh.ssm)
    # Free everything in random order, one kind at a time interleaved.
    rest = [("k", k) for k in sh.kv] + [("e", j) for j in sh.experts] + [("s", s) for s in sh.ssm]
    rng.shuffle(rest)
    for kind, i in rest:
        {"k": p.free_kv_pages, "e": p.free_expert_pages, "s": p.free_ssm_pages}[kind]([i])
        sh.give(kind, i)
    p.check_invariants()
    assert not any(sh.used)
    s = p.stats()
    assert s.whole_huge_pages == g.num_huge_pages
    assert (s.expert_split_huge_pages, s.ssm_split_huge_pages, s.trapped_kv_pages) == (0, 0, 0)
    assert s.free_expert_pages == g.num_expert_pages
    assert p.kv_capacity_now() == g.num_usable_kv_pages
    assert p.missing_expert_pages(g.num_usable_kv_pages) == 0
    assert p.missing_expert_pages(g.num_usable_kv_pages + 1) == 1


def test_serving_scale_pool_single_page_churn() -> None:
    """Qwen1.5-MoE sizes, 140 GB pool (26k expert pages, 765k KV ids): single-page
    alloc/free with affinity, as SGLang's decode loop does.  Any O(pool) scan per
    call would make this take minutes; with heaps it is well under a second."""
    g = PoolGeometry(total_bytes=140 * 2**30, expert_page_bytes=5_767_168, kv_page_bytes=196_608)
    p = UnifiedPagePool(g)
    keys = [ExpertKey(i // 180, (i // 3) % 60, ("w1", "w3", "w2")[i % 3]) for i in range(12_000)]
    assert p.alloc_expert_pages(len(keys), keys) == list(range(12_000))
    rng = random.Random(0)
    held: dict[int, list[int]] = {}
    for _ in range(30_000):
        r = rng.randrange(300)
        if rng.random() < 0.55 or not held.get(r):
            got = p.alloc_kv_pages(1, r, near=held[r][-1] if held.get(r) else None)
            assert got is not None
            held.setdefault(r, []).extend(got)
        else:
            p.free_kv_pages(held.pop(r))
    p.check_invariants()
    s = p.stats()
    used = sum(map(len, held.values()))
    assert s.kv_pages_used == used
    # Affinity keeps KV packed: split expert pages are barely more than the minimum.
    assert s.kv_split_expert_pages <= -(-used // 28) + len(held)


def test_serving_scale_decode_batches_with_runs() -> None:
    """The same pool, decode steps as SGLang allocates them (one slot per running
    request, one call), with requests ending and new ones prefilled: each step
    costs O(log n) per request, and every request keeps to its own expert pages."""
    g = PoolGeometry(total_bytes=140 * 2**30, expert_page_bytes=5_767_168, kv_page_bytes=196_608)
    p = UnifiedPagePool(g)
    assert p.alloc_expert_pages(12_000, [f"e{i}" for i in range(12_000)]) is not None
    rng = random.Random(1)
    held: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        new = [next_id + i for i in range(rng.randint(0, 3))]  # a prefill batch
        next_id += len(new)
        lens = [rng.randint(1, 200) for _ in new]
        got = p.alloc_kv_runs(lens, tails=[ids[-1] for ids in held.values()])
        for r, n in zip(new, lens):
            held[r], got = got[:n], got[n:]
        rows = list(held)
        got = p.alloc_kv_runs([1] * len(rows), near=[held[r][-1] for r in rows])  # a decode step
        for r, k in zip(rows, got):
            held[r].append(k)
        for r in rows:
            if rng.random() < 0.02:
                p.free_kv_pages(held.pop(r))
    p.check_invariants()
    e_of = g.expert_page_of_kv_page
    pages = [{e_of(k) for k in ids} for ids in held.values()]
    # No two requests share an expert page, and each spans the fewest its length allows
    # (in the plain order, these 77 requests share 39,911 page pairs).
    assert sum(len(a & b) for i, a in enumerate(pages) for b in pages[i + 1:]) == 0
    for ids, mine in zip(held.values(), pages):
        assert len(mine) <= -(-len(ids) // 28)
    # trapped space is the unfilled end of each request's last page
    assert p.stats().trapped_kv_pages < 28 * len(held)
