"""The CPU split: part of each layer's offloaded experts computed by the host's CPUs.

Why: a decode step with experts offloaded is bound by their bytes over PCIe (the
GPU reads them in place at 41-52 GB/s). The host's CPUs read the same weights from
DRAM at about that rate *at the same time* (``bench/device/cpu_experts.py``: 54 GB/s
of expert matmuls beside 50 GB/s of copies on the H200's host), and for them only
the layer's hidden states and routing cross PCIe (KTransformers, Fiddler). In one
48-layer Qwen3-30B-A3B graph the host taking 21 of 84 offloaded experts a layer made
the step 1.30x faster (745 -> 575 ms; ``bench/device/cpu_split_step.py``,
bench/RESULTS.md "The CPU split on the aligned store"); more than ~a quarter made it
slower (the host's fixed ~5 ms a layer and its lower rate at the margin).

How, per layer of a pass of ``min_tokens``..``max_tokens`` tokens (the decode graphs)::

    split table   the home table with the host's experts' rows -1 (the paged kernel
                  then skips them); rewritten with the home table (``update_layer``)
    gate[pos]     the least token count at which the layer splits (``NEVER`` where it
                  has no host experts): a pass below it runs the home table on the GPU
                  and its handshake launches do nothing (five empty launches a layer)
    the pass      pack_request (which also picks the GPU's table: split or home),
                  post_request, the GPU's share (paged kernel), await_reply, add_reply
                  (``rimuru_kernels.handshake``)
    host thread   sees the request, reads which experts are its own from the table
                  column the pass packed (so it computes exactly what the table the
                  GPU ran skipped, whatever moved since), computes them from the host
                  store in place (``CpuExperts``), writes the reply

Which experts: the ones most often routed by the ranking (ties: ranking order), so the
host carries reads the GPU would otherwise make; how many: ``share`` of each layer's
offloaded experts (rounded), or with ``share=None`` (``--rimuru-cpu-experts auto``) the
count that balances the two sides at the batch the split serves (``balance_count``): the
host's measured line ``a + b x experts`` against the GPU's reads of the offloaded experts
left to it. Why (bench/RESULTS.md, thirty-ninth session): on an H100's host the forked
engine took ~4-6 ms fixed and ~0.33 ms an expert more, about what the GPU takes to read one
in place (0.34 ms), so the best count is near half of a layer's offloaded experts less the
host's fixed time, not a share fixed by hand: with 48 out, ~17-18 (0.25 gives 12). Until
the line is measured (and after each reprobe) every layer starts at ``AUTO_START_SHARE``.

At which batch sizes (the gates): a layer split at ``T`` tokens takes
``max(the GPU's share, the host's time)`` instead of the GPU's whole layer, so it pays
iff the host's time ``h`` is below what the GPU would take for the layer alone. That is
at least its offloaded reads: ``expert_ms * sum over the layer's offloaded experts of
(1 - (1 - p) ** T)`` (``p`` a token's probability of routing to it; cost.py's
``touched``), so a layer splits from the least ``T`` where that exceeds
``(1 + GATE_MARGIN) * h``. ``h`` is the host's time at ``T`` by its line (``host_line``,
fitted to its last ``HOST_SAMPLES`` requests: their routed experts and times), or the
median of those times where no line is fitted; until it has them (and again every
``REPROBE_S`` without a request, so a gate set high does not keep its own evidence from
changing) every layer with host experts splits from ``min_tokens``. Why (bench/RESULTS.md, thirty-eighth session): on
an H100 the host took ~9-10 ms a layer request almost whatever its experts, and every
split step of batch 9-40 took 187-232 ms, the host's floor, where elastic alone took
118 ms at 9-16; at full batch the same split made steps 1.29-1.41x faster. Without
``expert_ms`` every layer with host experts splits from ``min_tokens`` (the gates
of the first server runs). Outputs are not bit-equal to the GPU's (other matmul units, and
the two shares are summed in fp32 and rounded once): a ``fast``-kind choice.

The host store holds every expert of every layer, whatever is resident, so the host
may compute any expert at any time: nothing here waits for a residency change.

Plain torch and ``rimuru_kernels``; no SGLang.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..adjuster.cost import touched
from .cpu_experts import CpuExperts, store_weights
from .host_store import HostExpertStore, pinned_empty
from .shapes import MoEShape

logger = logging.getLogger(__name__)

__all__ = ["CpuSplit", "CpuSplitFailed", "balance_count", "choose_host_experts", "host_line"]

#: ~20-40 s of PCIe polls before the device gives up on a reply: a dead host thread
#: is a reported error (``CpuSplit.check``), not a hung server
MAX_SPINS = 20_000_000
#: the interpreter's scheduler switch interval while a split serves: the host thread
#: needs the GIL within a layer's time, not the default 5 ms (a Python thread that
#: holds it keeps it that long before a waiting one runs)
SWITCH_INTERVAL_S = 0.0002
#: the host's time a request is the median of this many of its last requests
HOST_SAMPLES = 32
#: a layer splits where its offloaded reads take this much longer than the host
GATE_MARGIN = 0.1
#: without a host request for this long, the gates open again to measure the host anew
REPROBE_S = 60.0
#: the gates are set again when the host's time moves by more than this share
REGATE_SHARE = 0.1
#: ``share=None`` (auto): each layer's share until the host's line is measured
AUTO_START_SHARE = 0.25
#: the host's line fits its slope only where its requests' expert counts spread this much
#: (variance); else the slope is the GPU's read time of an expert (the host reads DRAM at
#: about the link's rate: bench/RESULTS.md, thirty-ninth session)
MIN_SPREAD = 0.5


def _moved(now: tuple, last: tuple) -> bool:
    """Whether (host ms, design tokens) moved enough to set the gates again: the time by
    more than ``REGATE_SHARE``, or to or from unmeasured; the tokens by more than a quarter."""
    (h, t), (h0, t0) = now, last
    if (h is None) != (h0 is None):
        return True
    if h is not None and abs(h - h0) > REGATE_SHARE * h0:
        return True
    return abs(t - t0) > 0.25 * t0


class CpuSplitFailed(RuntimeError):
    """The host side of the CPU split failed, or the device timed out waiting for it."""


def _most_routed(offloaded: Sequence[int], token_p: Sequence[float]) -> list[int]:
    """``offloaded`` most often routed first (ties keep their order)."""
    order = sorted(range(len(offloaded)), key=lambda i: (-token_p[offloaded[i]], i))
    return [offloaded[i] for i in order]


def choose_host_experts(offloaded: Sequence[int], token_p: Sequence[float], share: float | None = None,
                        count: int | None = None) -> list[int]:
    """The host's experts of one layer: ``round(share * len(offloaded))`` (or ``count``) of
    the offloaded experts, the most often routed first (``token_p``: each expert's
    probability of a token's routing; ties keep the order of ``offloaded``), sorted."""
    if (share is None) == (count is None):
        raise ValueError("give share or count")
    n = int(share * len(offloaded) + 0.5) if count is None else count
    return sorted(_most_routed(offloaded, token_p)[:n])


def host_line(samples: Sequence[tuple[float, float]], prior_slope: float) -> tuple[float, float]:
    """The host's time a request as ``(a, b)``: ``a + b * experts`` ms over ``samples`` of
    (routed experts it computed, ms). ``b`` is the least-squares slope, held within 1/4 to 4x
    ``prior_slope`` (a few noisy requests must not hand the host every expert), or
    ``prior_slope`` itself where the counts spread less than ``MIN_SPREAD`` (variance);
    ``a`` the median of ``ms - b * experts`` (one slow request moves it little), never < 0."""
    if not samples:
        raise ValueError("no samples")
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples) / n
    b = sum((x - mx) * (y - my) for x, y in samples) / n / var if var >= MIN_SPREAD else prior_slope
    b = min(max(b, prior_slope / 4), prior_slope * 4)
    a = sorted(y - b * x for x, y in samples)[n // 2]
    return max(0.0, a), b


def balance_count(ps: Sequence[float], tokens: int, expert_ms: float, line: tuple[float, float]) -> int:
    """How many of a layer's offloaded experts the host takes (``ps``: their token
    probabilities, the host taking them in this order) so that a pass of ``tokens`` tokens
    waits least: ``max(host, GPU)``, the host's line over the routed experts it takes
    against ``expert_ms`` for each routed one the GPU still reads (its resident experts'
    compute left out: it only ever favours the host less). 0 where no count beats the GPU
    reading them all."""
    a, b = line
    t = [touched(p, tokens) for p in ps]
    gpu = expert_ms * sum(t)
    best_n, best = 0, gpu
    host = 0.0
    for n, tn in enumerate(t, start=1):
        host += tn
        cost = max(a + b * host, gpu - expert_ms * host)
        if cost < best:
            best_n, best = n, cost
    return best_n


class CpuSplit:
    """One TP rank's CPU split: split tables, the mailbox, and the host thread."""

    def __init__(self, shape: MoEShape, host_store: HostExpertStore, device: torch.device | str, *,
                 share: float | None, min_tokens: int, max_tokens: int, threads: int,
                 max_spins: int = MAX_SPINS, expert_ms: float | None = None, engine: str = "threads"):
        """``expert_ms``: the GPU's time to read one offloaded expert in place (its bytes
        over the measured rate), from which the gates are set; None: split every pass of
        ``min_tokens``..``max_tokens`` tokens in every layer with host experts. ``engine``:
        how the host runs its experts (``CpuExperts``). ``share``: of each layer's offloaded
        experts, on the host; None: the count that balances host and GPU (``balance_count``,
        which needs ``expert_ms``)."""
        from rimuru_kernels.handshake import NEVER, HostMailbox  # lazy: triton only where it runs

        if share is not None and not 0 < share < 1:
            raise ValueError(f"share {share}: a fraction of each layer's offloaded experts, in (0, 1)")
        if share is None and expert_ms is None:
            raise ValueError("share None (balance host and GPU) needs expert_ms, the GPU's read time of an expert")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"tokens {min_tokens}..{max_tokens}: need 1 <= min <= max")
        if expert_ms is not None and not expert_ms > 0:
            raise ValueError(f"expert_ms {expert_ms}: the GPU's read time of one expert, > 0")
        if host_store.layer_tensor(shape.layer_ids[0]).shape[2] != shape.inter * shape.hidden:
            raise ValueError("the host store's pages are padded; the host reads unpadded [E, 3, I*H] layers")
        self.shape, self.share = shape, share
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.device = torch.device(device)
        self.max_spins = max_spins
        e = shape.num_experts
        self.mailbox = HostMailbox(max_tokens=max_tokens, hidden=shape.hidden, top_k=shape.top_k, num_experts=e,
                                   dtype=shape.dtype, device=self.device, pin=pinned_empty)
        self._split = {l: torch.full((e, 3), -1, dtype=torch.int32, device=self.device) for l in shape.layer_ids}
        #: the table the GPU's share ran on in the layer's last pass (pack_request writes it)
        self._used = {l: torch.full((e, 3), -1, dtype=torch.int32, device=self.device) for l in shape.layer_ids}
        #: the copy path's split table: its working table with the host's rows -1 (``forward_copied``)
        self._copied = {l: torch.full((e, 3), -1, dtype=torch.int32, device=self.device) for l in shape.layer_ids}
        #: the home tables (the manager's, persistent), given by ``update_layer``
        self._home: dict[int, torch.Tensor] = {}
        self._never = NEVER
        self.expert_ms = expert_ms
        self._gate = torch.full((len(shape.layer_ids),), NEVER, dtype=torch.int32, device=self.device)
        self._gates = [NEVER] * len(shape.layer_ids)  # the host's copy of _gate
        #: each layer's home rows, offloaded experts and token probabilities as last given
        #: (``update_layer``), from which the host's experts are chosen again as the line moves
        self._given: dict[int, tuple[list, list[int], list[float]]] = {}
        #: the host's recent requests (routed experts computed, tokens, ms; the host thread
        #: appends), their median time, and the line fitted to them (``regate``)
        self._samples: list[tuple[int, int, float]] = []
        self.host_ms: float | None = None
        self.line: tuple[float, float] | None = None
        #: the batch the counts balance at (``share=None``): the median tokens of those requests
        self.design_tokens = max_tokens
        self._gated_with: tuple | None = None  # (host_ms, design_tokens) the gates were last set from
        self._last_request_at = time.monotonic()
        self._flag_words = self.mailbox.flags.numpy()  # the same memory (serve_once polls it)
        self._host_experts: dict[int, list[int]] = {l: [] for l in shape.layer_ids}
        self._weights = {l: store_weights(host_store.layer_tensor(l), shape.inter, shape.hidden)
                         for l in shape.layer_ids}
        self._experts = CpuExperts(threads, engine=engine)
        self._n = dict(requests=0, host_ms=0.0, host_experts=0)
        #: forward passes by their tokens against min_tokens..max_tokens (``note_pass``)
        self._passes = dict(shorter=0, within=0, longer=0)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._last = 0
        self._switch_interval = sys.getswitchinterval()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ tables

    def update_layer(self, layer: int, home_rows: Sequence[tuple[int, int, int]], offloaded: Sequence[int],
                     token_p: Sequence[float], home: torch.Tensor) -> list[int]:
        """Rewrite ``layer``'s split table from its home rows, and its gate (called where
        the home table is rewritten, so both reach the device in the same stream order);
        return the host's experts. ``home``: the layer's home table on the device (the
        persistent tensor the GPU's share runs on when the layer does not split)."""
        # (device types only: a table made on "cuda" lives on "cuda:0", which is not equal to "cuda")
        if home.shape != self._split[layer].shape or home.dtype != torch.int32 or home.device.type != self.device.type:
            raise ValueError(f"layer {layer}: home table {tuple(home.shape)} {home.dtype} on {home.device}, "
                             f"expected {tuple(self._split[layer].shape)} int32 on {self.device}")
        self._home[layer] = home
        self._given[layer] = ([tuple(r) for r in home_rows], list(offloaded), [float(p) for p in token_p])
        mine = self._choose(layer)
        self._write_split(layer, mine)
        self._set_gates([layer])
        return mine

    def _choose(self, layer: int) -> list[int]:
        """The host's experts of ``layer`` now: its share, or the balancing count."""
        _, offloaded, token_p = self._given[layer]
        if self.share is not None:
            return choose_host_experts(offloaded, token_p, self.share)
        if self.line is None:
            return choose_host_experts(offloaded, token_p, AUTO_START_SHARE)
        ps = [token_p[x] for x in _most_routed(offloaded, token_p)]
        n = balance_count(ps, self.design_tokens, self.expert_ms, self.line)
        return choose_host_experts(offloaded, token_p, count=n)

    def _write_split(self, layer: int, mine: list[int]) -> None:
        """``layer``'s split table: its home rows with ``mine``'s rows -1 (stream order)."""
        home_rows = self._given[layer][0]
        own = set(mine)
        rows = [(-1, -1, -1) if x in own else tuple(r) for x, r in enumerate(home_rows)]
        if any(-1 in r for x, r in enumerate(rows) if x not in own):
            raise ValueError(f"layer {layer}: home rows with -1 outside the host's experts (no host reads?)")
        src = torch.tensor(rows, dtype=torch.int32)
        if self._cuda:  # pinned + async: a pageable copy would wait for the running pass
            src = src.pin_memory()
        self._split[layer].copy_(src, non_blocking=self._cuda)
        self._host_experts[layer] = mine

    # ------------------------------------------------------------------ the gates

    @property
    def threads(self) -> int:
        """The host's threads on the experts (the forked engine's: torch's inter-op pool)."""
        return self._experts.threads

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def gate_for(self, layer: int) -> int:
        """The least token count at which ``layer`` splits now (``NEVER``: it does not),
        from its host experts, its offloaded experts' probabilities and the host's time
        (its line over the experts it would compute, else ``host_ms``)."""
        if not self._host_experts[layer]:
            return self._never
        if self.expert_ms is None or self.host_ms is None:
            return self.min_tokens
        _, offloaded, token_p = self._given[layer]
        ps, mine = [token_p[x] for x in offloaded], [token_p[x] for x in self._host_experts[layer]]

        def host(t: int) -> float:
            if self.line is None:
                return self.host_ms
            return self.line[0] + self.line[1] * sum(touched(p, t) for p in mine)

        def pays(t: int) -> bool:
            return self.expert_ms * sum(touched(p, t) for p in ps) > (1.0 + GATE_MARGIN) * host(t)

        lo, hi = self.min_tokens, self.max_tokens
        if not pays(hi):
            return self._never
        while lo < hi:  # the reads grow with t (faster than the host's share of them): the least t that pays
            mid = (lo + hi) // 2
            if pays(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def gates(self) -> list[int]:
        """Each layer's gate (forward order), as last written to the device."""
        return list(self._gates)

    def open_gates(self) -> list[int]:
        """The gates that open within the split's passes (forward order): the layers that
        split at some batch it serves (the log line's and the gauges' count)."""
        return [g for g in self._gates if g <= self.max_tokens]

    def _set_gates(self, layers: Sequence[int]) -> None:
        """Write the gates of ``layers`` (stream order: before the next pass)."""
        changed = False
        for l in layers:
            g = self.gate_for(l)
            pos = self.shape.position(l)
            changed |= g != self._gates[pos]
            self._gates[pos] = g
        if changed:
            src = torch.tensor(self._gates, dtype=torch.int32)
            if self._cuda:
                src = src.pin_memory()
            self._gate.copy_(src, non_blocking=self._cuda)

    def regate(self) -> None:
        """Before a pass (the scheduler's thread): where the host's time or the batch it
        serves moved, fit its line again, choose each layer's experts again (``share=None``)
        and set the gates; open them to measure the host anew when no request came for
        ``REPROBE_S`` (the balancing counts go back to ``AUTO_START_SHARE`` for it)."""
        if self.expert_ms is None or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return  # (a copy inside a capture would replay its stale source)
        if (self.host_ms is not None and time.monotonic() - self._last_request_at > REPROBE_S
                and (self.share is None or any(self._host_experts.values()))):
            self._samples, self.host_ms, self.line = [], None, None  # the host thread refills them
            self._last_request_at = time.monotonic()
        samples, h = self._samples, self.host_ms
        tokens = sorted(t for _, t, _ in samples)[len(samples) // 2] if samples else self.max_tokens
        if self._gated_with is not None and not _moved((h, tokens), self._gated_with):
            return
        self._gated_with = (h, tokens)
        if h is not None and len(samples) >= HOST_SAMPLES:
            self.line = host_line([(n, ms) for n, _, ms in samples], self.expert_ms)
            self.design_tokens = tokens
        elif h is None:
            self.line = None
        if self.share is None:
            for l in self._given:
                mine = self._choose(l)
                if mine != self._host_experts[l]:
                    self._write_split(l, mine)
        self._set_gates(self.shape.layer_ids)

    def split_table(self, layer: int) -> torch.Tensor:
        return self._split[layer]

    def host_experts(self, layer: int) -> list[int]:
        """The host's experts of ``layer`` as of its last table rewrite."""
        return list(self._host_experts[layer])

    def gpu_read_share(self) -> float:
        """The share of the offloaded experts (all layers, as the tables stand) the GPU
        still reads where the layers split; 1.0 with none offloaded. The cost-aware
        adjuster's floor on a read's price scales by it (``StepClock.fit``)."""
        out = sum(len(offloaded) for _, offloaded, _ in self._given.values())
        host = sum(len(self._host_experts[l]) for l in self.shape.layer_ids)
        return 1.0 if out == 0 else (out - host) / out

    def host_counts(self) -> list[int]:
        """How many experts the host has in each layer (forward order), for the logs."""
        return [len(self._host_experts[l]) for l in self.shape.layer_ids]

    # ------------------------------------------------------------------ the pass

    def note_pass(self, tokens: int) -> None:
        """Count one forward pass of ``tokens`` tokens as shorter than, within or longer than
        the split's range (the scheduler's thread, each pass, replayed graphs too). Why: the
        host's requests say what the split served, not what it could not: a Qwen3-30B-A3B
        server whose passes were all 2,048-token mixed passes or decode batches of ~300
        served none in its traffic, and said so nowhere (bench/RESULTS.md, forty-second
        session)."""
        self._passes["within" if self.applies(tokens) else "shorter" if tokens < self.min_tokens
                     else "longer"] += 1

    def applies(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens splits (a graph captured for it keeps
        the handshake; layers with no host experts then skip it on the device)."""
        return self.min_tokens <= tokens <= self.max_tokens

    def host_experts_at(self, layer: int, tokens: int) -> list[int]:
        """The host's experts of ``layer`` in an eager pass of ``tokens`` tokens: all of
        them where the layer splits at that count (the split's range and the layer's gate,
        the host's copy of it), else none. The copy path leaves these uncopied
        (``ExpertManager.forward_copy_path``)."""
        if not self.applies(tokens) or tokens < self._gates[self.shape.position(layer)]:
            return []
        return self._host_experts[layer]

    def forward(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                gpu_compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's routed-expert output: ``gpu_compute(split_table)`` (the paged
        kernel over resident experts and the GPU's offloaded ones) plus the host's
        share. Enqueues only (no sync): CUDA-graph safe once the host thread runs."""
        self._check_ready(layer)
        return self._split_pass(layer, x, topk_weights, topk_ids, self._split[layer], self._home[layer], gpu_compute)

    def forward_copied(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       table: torch.Tensor, gpu_compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward`` for an eager pass that copies its offloaded experts (the copy path):
        ``table`` is the layer's working table as ``prepare_layer`` left it (load-buffer
        rows for what it copied, home rows for the host's experts, which it did not copy).
        The GPU's share runs on it with the host's rows -1; where the device's gate does
        not open (it agrees with ``host_experts_at``, which the caller asked), on ``table``
        whole: the host's experts then read in place, still right."""
        self._check_ready(layer)
        split = self._split[layer]  # -1 exactly on the host's rows (_write_split), in stream order
        masked = torch.where(split == -1, split, table, out=self._copied[layer])
        return self._split_pass(layer, x, topk_weights, topk_ids, masked, table, gpu_compute)

    def _check_ready(self, layer: int) -> None:
        if self._thread is None:
            raise CpuSplitFailed("the CPU split's host thread is not running (call start())")
        if layer not in self._home:
            raise CpuSplitFailed(f"layer {layer} has no home table yet (attach the split to the manager)")

    def _split_pass(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    split: torch.Tensor, home: torch.Tensor,
                    gpu_compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Post the host's request (where the layer's gate opens at x's rows), run the
        GPU's share on ``split`` (``home`` where the gate stays shut), add the reply."""
        from rimuru_kernels.handshake import add_reply, await_reply, pack_request, post_request

        pos, used, T = self.shape.position(layer), self._used[layer], x.shape[0]
        mb = self.mailbox
        pack_request(mb, x, topk_ids, topk_weights, split, home, used, self._gate, pos)
        post_request(mb, self._gate, pos, layer, T)
        gpu = gpu_compute(used)
        await_reply(mb, self._gate, pos, T, self.max_spins)
        return add_reply(mb, gpu, self._gate, pos)

    # ------------------------------------------------------------------ the host side

    def start(self) -> "CpuSplit":
        if self._thread is None:
            self._last = int(self.mailbox.flags[0])
            sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._run, name="rimuru-cpu-split", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            sys.setswitchinterval(self._switch_interval)
        self._experts.close()

    def serve_once(self) -> bool:
        """Serve the pending request, if any; True if there was one."""
        from rimuru_kernels.handshake import META, REPLY, REQUEST

        # a numpy view of the flags: the idle poll reads one word in ~0.1 us, where a torch
        # index takes a few us of the GIL the scheduler's thread waits for
        f = self._flag_words
        n = int(f[REQUEST])
        if n == self._last:
            return False
        meta = int(f[META])
        layer, T = meta >> 16, meta & 0xFFFF
        t0 = time.perf_counter()
        mb = self.mailbox
        mine = torch.nonzero(mb.table == -1).reshape(-1)
        self._experts(mb.x[:T], mb.ids[:T], mb.weights[:T], self._weights[layer], mine, out=mb.part[:T])
        ms = (time.perf_counter() - t0) * 1e3
        # the experts it computed: those of its own the pass routed to (for the line; counted
        # before the reply, since the next request overwrites the mailbox: ~10 us)
        hits = torch.bincount(mb.ids[:T].reshape(-1).long(), minlength=self.shape.num_experts)
        routed = int((hits[mine] > 0).sum())
        self._n["host_ms"] += ms
        self._n["requests"] += 1
        self._samples = (self._samples + [(routed, T, ms)])[-HOST_SAMPLES:]  # a new list: the scheduler reads it
        if len(self._samples) == HOST_SAMPLES:
            self.host_ms = sorted(ms for _, _, ms in self._samples)[HOST_SAMPLES // 2]
        self._last_request_at = time.monotonic()
        self._n["host_experts"] += routed
        f[REPLY] = n  # after the part's stores (x86 keeps store order); the device then reads it
        self._last = n
        return True

    def _run(self) -> None:
        from rimuru_kernels.handshake import REPLY, REQUEST

        try:
            while not self._stop.is_set():
                if not self.serve_once():
                    time.sleep(0)  # yield the GIL: the scheduler's thread needs it between launches
        except BaseException as exc:  # noqa: BLE001 -- reported by check() on the scheduler's thread
            self.error = exc
            logger.exception("sglang-rimuru: the CPU split's host thread failed")
            # answer every later request at once (with whatever part holds) so the device never
            # spins out its max_spins; check() stops the server at its next pass
            f = self.mailbox.flags
            while not self._stop.is_set():
                f[REPLY] = int(f[REQUEST])
                time.sleep(0.001)

    def check(self) -> None:
        """Raise ``CpuSplitFailed`` if the host thread failed or the device gave up waiting."""
        from rimuru_kernels.handshake import ERROR

        if self.error is not None:
            raise CpuSplitFailed(f"the CPU split's host thread failed: {self.error!r}") from self.error
        lost = int(self.mailbox.flags[ERROR])
        if lost:
            raise CpuSplitFailed(f"the device gave up waiting for the host's reply to request {lost} "
                                 f"after {self.max_spins} polls (host thread stalled?)")

    def stats(self) -> dict[str, float]:
        """Requests served (one per layer of a split pass whose layer had host experts),
        the host's mean ms and routed experts a request, the median and line the gates use
        (None until measured), the batch the balancing counts are for (None with a
        fixed share), and the forward passes shorter than, within and longer than its range
        (``note_pass``)."""
        n = dict(self._n)
        r = max(1, n["requests"])
        return dict(requests=n["requests"], host_ms_per_request=n["host_ms"] / r,
                    host_experts_per_request=n["host_experts"] / r, host_ms=self.host_ms,
                    line=self.line, design_tokens=self.design_tokens if self.share is None else None,
                    passes_shorter=self._passes["shorter"], passes_within=self._passes["within"],
                    passes_longer=self._passes["longer"])
