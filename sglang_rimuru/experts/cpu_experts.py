"""Routed experts computed by the host's CPUs, from the host store, in place.

Why: a decode step with experts offloaded is bound by the bytes of the offloaded
experts it routes to. The GPU reads them over PCIe (in place, ~41-52 GB/s on the
H200); the host's CPUs can read the same weights from DRAM at about that rate *at the
same time* (``bench/device/cpu_experts.py``: 54 GB/s of expert matmuls beside 50 GB/s
of pinned copies on the H200's 16-core host). Splitting a layer's offloaded experts
between the two moves its cold bytes up to ~2x as fast; only the layer's hidden
states and routing cross PCIe for the CPU's share (KTransformers, Fiddler).

``CpuExperts`` computes one MoE layer's contribution from a given set of experts:

    out[t] = sum over j with topk_ids[t, j] in experts:
             topk_weights[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t))

reading each expert's matrices where they lie (``weights(e)`` returns views; the host
store's ``[E, 3, inter*hidden]`` layer tensor gives them without a copy). The math is
SGLang's ``moe_forward_native``, op for op: per expert ``F.linear`` to gate/up, SiLU
times up, ``F.linear`` down, in the activations' dtype; then every slot's output in the
routing weights' dtype, times its weight, summed over the top-k, rounded once. Given
every routed expert it equals ``moe_forward_native`` bit for bit (the tests check it); a
subset gives the same sum without the other experts' slots. It is not bit-equal to the
GPU kernels (other matmul units), so serving with it is a ``fast``-kind choice.

Engines. ``forked`` (the server's default): one TorchScript task an expert, forked onto
torch's inter-op pool (``torch.jit.fork``; the pool sized to ``threads`` where torch still
allows it), so the experts' matmuls and the glue between them run without the GIL. Why:
a Python thread needs the GIL back after each of the dozen torch calls an expert makes,
and in the server it shares the GIL with fourteen such threads, the host thread and the
scheduler's; on this project's 2-core machine (``bench/device/cpu_split_host.py``) a
Python thread that holds the GIL whenever it can (at the server's 0.2 ms switch interval)
made Qwen1.5 requests of 4 and 8 experts at 128 tokens 6x and 5x slower on threads (7.6 ->
45-47 ms, 13.8 -> 70) and 2x on forks (7.4 -> 14.7 ms, 14.3 -> 25.7: three threads on two
cores), with the routing and combine inside the one TorchScript call. On the device's
16-core host the server's host took ~9-10 ms a request whatever its experts
(bench/RESULTS.md, thirty-eighth session).
Same ops, same bits as ``threads``. Row pieces (below) are there too, off by default
on this engine until measured on the device's host.

``threads``: experts are dealt round-robin to ``threads`` Python threads, each running
its matmuls (torch releases the GIL inside them). With fewer experts than threads
each expert is cut into row pieces so every thread works (``_pieces``): gate/up by
ranges of the intermediate rows (W1's and W3's same rows, so SiLU times up stays
within a piece), then, once every piece's activations are in, down by ranges of
W2's output rows; each output element is still one dot product over the whole
row, and the server's CPU split, which gives the host a few experts a layer on
a 16-core host (4 of 16 on the first Qwen1.5 runs: 3.8 ms a layer, one core an
expert, 10 cores idle), needs all its cores on them. With more than one, set torch's own
intra-op threads to 1 (``torch.set_num_threads(1)``: process-wide, so the caller's
choice), or every matmul starts an OpenMP team from every thread. One expert's matmul at
decode sizes (a few tokens, ~9 MiB of weights) is too small for torch's own OpenMP team:
its fork and join each call halved the rate on the H200's host (``loop`` rows against
``bmm``). The combine runs on the calling thread after all experts, so the result does
not depend on the thread count.

Plain torch; no SGLang, no CUDA (tensors on the CPU).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable, Sequence
from typing import List, Tuple

import torch
from torch.nn import functional as F

__all__ = ["CpuExperts", "store_weights"]

#: (W13 [2I, H] = cat(W1, W3), W2 [H, I]) of one expert, as views of host memory.
Weights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class StoreWeights:
    """``weights(e)`` over a host store layer tensor ``[E, 3, inter*hidden]`` (W1, W3, W2 of
    each expert adjacent, ``sglang_rimuru/experts/host_store.py``): W13 is the expert's first
    two matrices as one ``[2I, H]`` view, W2 its third as ``[H, I]``. No copy. The forked
    engine reads ``layer``, ``inter`` and ``hidden`` itself (the whole request in TorchScript)."""

    def __init__(self, layer: torch.Tensor, inter: int, hidden: int):
        if layer.dim() != 3 or layer.shape[1] != 3 or layer.shape[2] != inter * hidden:
            raise ValueError(f"store layer of shape {tuple(layer.shape)}: expected [E, 3, {inter * hidden}]")
        self.layer, self.inter, self.hidden = layer, inter, hidden

    def __call__(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer[e, 0:2].view(2 * self.inter, self.hidden), self.layer[e, 2].view(self.hidden, self.inter)


def store_weights(layer: torch.Tensor, inter: int, hidden: int) -> StoreWeights:
    """``StoreWeights`` over a host store layer tensor."""
    return StoreWeights(layer, inter, hidden)


logger = logging.getLogger(__name__)

#: CpuExperts' engines (``--rimuru-cpu-engine``)
ENGINES = ("forked", "threads")


def _one_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's output rows: SiLU(x W1^T) * (x W3^T), then W2 (``moe_forward_native``'s ops)."""
    inter = w2.shape[1]
    gate_up = F.linear(x, w13)
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)


def _experts_forked(xs: List[torch.Tensor], w13s: List[torch.Tensor],
                    w2s: List[torch.Tensor]) -> List[torch.Tensor]:
    futures = [torch.jit.fork(_one_expert, xs[i], w13s[i], w2s[i]) for i in range(len(xs))]
    return [torch.jit.wait(f) for f in futures]


def _route(topk_ids: torch.Tensor, experts: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The experts of ``experts`` that some token routes to (ascending) and, for each,
    the flat slots (``t * k + j``) routed to it (``CpuExperts.routed``; TorchScript too)."""
    flat = topk_ids.reshape(-1).long()
    slots = torch.nonzero(torch.isin(flat, experts.long())).reshape(-1)
    ids = flat[slots]
    order = torch.argsort(ids, stable=True)
    slots, ids = slots[order], ids[order]
    uniq, counts = torch.unique_consecutive(ids, return_counts=True)
    sizes: List[int] = counts.tolist()
    return uniq, list(torch.split(slots, sizes))


def _combine_into(acc: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    """``acc`` += each slot's output row ``y`` times its routing weight, k by k in slot
    order (``CpuExperts._combine``; TorchScript too)."""
    k = topk_weights.shape[1]
    w = topk_weights.reshape(-1)
    for j in range(k):
        sel = torch.nonzero(slots % k == j).reshape(-1)
        if sel.numel() > 0:
            at = slots[sel]
            acc.index_add_(0, at // k, y[sel].to(acc.dtype).mul_(w[at].unsqueeze(-1)))


def _cuts(rows: int, n: int) -> List[Tuple[int, int]]:
    """``rows`` in ``n`` ranges of whole 16-row blocks (fewer where they run out)."""
    step = (rows + n - 1) // n
    step = (step + 15) // 16 * 16
    out: List[Tuple[int, int]] = []
    for a in range(0, rows, step):
        out.append((a, min(rows, a + step)))
    return out


def _up_piece(x: torch.Tensor, w13: torch.Tensor, a: int, b: int, inter: int) -> torch.Tensor:
    """Rows a..b of one expert's SiLU(gate) * up (W1's and W3's same rows)."""
    return F.silu(F.linear(x, w13[a:b])) * F.linear(x, w13[inter + a:inter + b])


def _down_piece(act: torch.Tensor, w2: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return F.linear(act, w2[a:b])


def _experts_in_pieces(xs: List[torch.Tensor], w13s: List[torch.Tensor], w2s: List[torch.Tensor],
                       n: int, inter: int, hidden: int) -> List[torch.Tensor]:
    """``CpuExperts._pieces`` as forks: every expert's gate/up in ``n`` row pieces, then,
    with each expert's activations whole, its down in ``n`` pieces of W2's rows."""
    up_cuts, down_cuts = _cuts(inter, n), _cuts(hidden, n)
    ups: List[torch.jit.Future[torch.Tensor]] = []
    for i in range(len(xs)):
        for c in up_cuts:
            ups.append(torch.jit.fork(_up_piece, xs[i], w13s[i], c[0], c[1], inter))
    acts: List[torch.Tensor] = []
    for i in range(len(xs)):
        acts.append(torch.cat([torch.jit.wait(ups[i * len(up_cuts) + j]) for j in range(len(up_cuts))], dim=1))
    downs: List[torch.jit.Future[torch.Tensor]] = []
    for i in range(len(xs)):
        for c in down_cuts:
            downs.append(torch.jit.fork(_down_piece, acts[i], w2s[i], c[0], c[1]))
    ys: List[torch.Tensor] = []
    for i in range(len(xs)):
        ys.append(torch.cat([torch.jit.wait(downs[i * len(down_cuts) + j]) for j in range(len(down_cuts))],
                            dim=1))
    return ys


def _layer_forked(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: torch.Tensor,
                  experts: torch.Tensor, inter: int, hidden: int, threads: int, pieces: bool) -> torch.Tensor:
    """A whole request from a store layer tensor: ``CpuExperts.routed``, one forked task an
    expert (with ``pieces`` and fewer routed experts than ``threads``: row pieces, as
    ``CpuExperts._pieces``), and ``CpuExperts._combine``, op for op, so one call holds the
    GIL once."""
    T, k = topk_ids.shape[0], topk_ids.shape[1]
    acc = torch.zeros(T, x.shape[1], dtype=topk_weights.dtype)
    uniq, parts = _route(topk_ids, experts)
    if len(parts) == 0:
        return acc
    xs: List[torch.Tensor] = []
    w13s: List[torch.Tensor] = []
    w2s: List[torch.Tensor] = []
    for i in range(len(parts)):
        e = int(uniq[i])
        xs.append(x[parts[i] // k])
        w13s.append(layer[e, 0:2].view(2 * inter, hidden))
        w2s.append(layer[e, 2].view(hidden, inter))
    if pieces and len(xs) < threads:
        ys = _experts_in_pieces(xs, w13s, w2s, (threads + len(xs) - 1) // len(xs), inter, hidden)
    else:
        ys = _experts_forked(xs, w13s, w2s)
    _combine_into(acc, topk_weights, torch.cat(parts), torch.cat(ys))
    return acc


_SCRIPTED: dict = {}


def _scripted(fn):
    """``fn`` as TorchScript (compiled once, on first use: ~0.1 s). TorchScript
    is deprecated (torch 2.11, the pinned torch, warns) but present; nothing else in
    torch forks work off the GIL. Where it goes, the ``threads`` engine stays."""
    if fn not in _SCRIPTED:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _SCRIPTED[fn] = torch.jit.script(fn)
    return _SCRIPTED[fn]


def _size_interop_pool(threads: int) -> int:
    """Size torch's inter-op pool to ``threads`` if nothing has used it yet (torch allows
    that once, before the pool starts); return its size."""
    if torch.get_num_interop_threads() != threads:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError as e:  # the pool already runs: keep it, say so
            logger.warning("sglang-rimuru CPU experts: torch's inter-op pool keeps %d threads, not %d (%s)",
                           torch.get_num_interop_threads(), threads, e)
    return torch.get_num_interop_threads()


class CpuExperts:
    """One MoE layer's contribution from a set of experts, on the host's CPUs."""

    def __init__(self, threads: int = 1, pieces: bool | None = None, engine: str = "threads"):
        """``engine``: ``threads`` (Python threads) or ``forked`` (TorchScript forks on
        torch's inter-op pool, sized to ``threads``). ``pieces``: cut experts into row
        pieces when there are fewer than threads (``_pieces``); False: one expert a task
        whatever the count; None: the engine's default (threads: on, as measured in
        serving; forked: off, until ``bench/device/cpu_split_host.py`` says otherwise)."""
        if threads < 1:
            raise ValueError(f"threads={threads}: at least one")
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
        self.threads = threads
        self.pieces = (engine == "threads") if pieces is None else pieces
        self.engine = engine
        if engine == "forked":
            self.threads = _size_interop_pool(threads)
            _scripted(_experts_forked), _scripted(_layer_forked)
        self._pool = (cf.ThreadPoolExecutor(threads, thread_name_prefix="rimuru-cpu-expert")
                      if threads > 1 and engine == "threads" else None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @staticmethod
    def routed(topk_ids: torch.Tensor, experts: Sequence[int] | torch.Tensor) -> dict[int, torch.Tensor]:
        """Expert -> the flat slots (``t * k + j``) routed to it, for each of ``experts``
        that some token routes to, in expert-id order."""
        uniq, parts = _route(topk_ids, torch.as_tensor(experts, dtype=torch.long).reshape(-1))
        return dict(zip(uniq.tolist(), parts))

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 weights: Weights, experts: Sequence[int] | torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` ([T, H], x's dtype): the experts' contribution (zero where none routes)."""
        if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                             f"topk_weights {tuple(topk_weights.shape)}: expected [T, H], [T, k], [T, k]")
        k = topk_ids.shape[1]
        if self.engine == "forked" and isinstance(weights, StoreWeights):
            # the whole request in one TorchScript call: the GIL taken once, not per op
            acc = _scripted(_layer_forked)(x, topk_ids, topk_weights, weights.layer,
                                           torch.as_tensor(experts, dtype=torch.long).reshape(-1),
                                           weights.inter, weights.hidden, self.threads, self.pieces)
            return acc.type(x.dtype) if out is None else out.copy_(acc)
        work = self.routed(topk_ids, experts)

        def one(item: tuple[int, torch.Tensor]) -> torch.Tensor:
            e, slots = item
            w13, w2 = weights(e)
            return _one_expert(x[slots // k], w13, w2)

        items = list(work.items())
        if self.engine == "forked" and items:
            mats = [weights(e) for e, _ in items]
            ys = _scripted(_experts_forked)([x[slots // k] for _, slots in items], [m[0] for m in mats],
                                            [m[1] for m in mats])
        elif self._pool is None or not items:
            ys = [one(it) for it in items]
        elif len(items) < self.threads and self.pieces:
            ys = self._pieces(x, k, items, weights)
        else:
            # round-robin deal: thread i takes items i, i + n, ... (one task each, no queue churn)
            n = min(self.threads, len(items))
            parts = list(self._pool.map(lambda i: [one(it) for it in items[i::n]], range(n)))
            ys = [parts[j % n][j // n] for j in range(len(items))]
        return self._combine(x, topk_weights, items, ys, out)

    def _pieces(self, x: torch.Tensor, k: int, items: list[tuple[int, torch.Tensor]],
                weights: Weights) -> list[torch.Tensor]:
        """Each expert's output, computed in row pieces by all threads (two rounds)."""
        n = -(-self.threads // len(items))  # pieces an expert
        xs = [x[slots // k] for _, slots in items]
        mats = [weights(e) for e, _ in items]
        inter, hidden = mats[0][1].shape[1], mats[0][1].shape[0]
        acts = [torch.empty(xe.shape[0], inter, dtype=x.dtype) for xe in xs]
        ys = [torch.empty(xe.shape[0], hidden, dtype=x.dtype) for xe in xs]

        def up(task: tuple[int, int, int]) -> None:
            i, a, b = task
            acts[i][:, a:b] = _up_piece(xs[i], mats[i][0], a, b, inter)

        def down(task: tuple[int, int, int]) -> None:
            i, a, b = task
            ys[i][:, a:b] = _down_piece(acts[i], mats[i][1], a, b)

        list(self._pool.map(up, [(i, a, b) for i in range(len(items)) for a, b in _cuts(inter, n)]))
        list(self._pool.map(down, [(i, a, b) for i in range(len(items)) for a, b in _cuts(hidden, n)]))
        return ys

    @staticmethod
    def _combine(x: torch.Tensor, topk_weights: torch.Tensor, items: list[tuple[int, torch.Tensor]],
                 ys: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        """SGLang's combine (per-slot outputs in the routing weights' dtype, times them,
        summed over the top-k in slot order, rounded once to x's dtype) over only the
        slots of these experts. SGLang sums a ``[T, k, H]`` tensor in which every other
        slot holds zeros; adding the present slots in the same order k by k gives the
        same values (x + 0 == x), without making, converting and summing the T x k x H
        tensor, single-threaded whatever the number of experts: the likely bulk of the
        5.6 ms a layer that the H200 run's host times fit as their fixed part (0.31 ms
        an expert beside it; bench/RESULTS.md, tenth session; inferred from that fit,
        not timed apart). Each slot index ``t * k + j`` appears once, so for one j the
        rows added are distinct and ``index_add_`` adds each exactly once."""
        acc = torch.zeros(topk_weights.shape[0], x.shape[1], dtype=topk_weights.dtype)
        if items:
            _combine_into(acc, topk_weights, torch.cat([s for _, s in items]), torch.cat(ys))
        if out is None:
            return acc.type(x.dtype)
        return out.copy_(acc)
