"""What an offloaded expert costs per decode step, and when offloading pays (DESIGN §8).

Plain arithmetic, no state beyond the numbers given. At decode an offloaded
expert is read in place from pinned host memory by every step that routes at
least one token to it (``ExpertManager``'s home table), so with a batch of
``B`` requests and a per-token routing probability ``p`` (an expert in a
token's top-k with probability ``p``; the ``p`` of a layer sum to ``top_k``)
it costs, per step::

    touched(p, B) = 1 - (1 - p) ** B                      probability a step routes to it
    cost(p, B)    = touched(p, B) * expert_bytes / pcie    expected PCIe time per step

The reads of different experts serialize on PCIe and barely hide behind the
layer's compute at decode sizes (bench/RESULTS.md: 0-25 % hidden), so costs
add. A decode step with ``B`` requests takes ``step(B) = base + per_request * B``
(all experts resident; an affine fit of measured steps) plus the costs of the
offloaded experts. Throughput is ``B / step``.

Offloading ``n`` more experts frees their pages for KV and lets ``admit`` more
requests run; it pays when::

    (B + admit) / (step(B + admit) + C + c_new(B + admit))  >  (1 + margin) * B / (step(B) + C(B))

with ``C`` the offloaded experts' cost now (at the new batch size on the left)
and ``c_new`` the new victims'. With a waiting queue and nobody running (B = 0)
admitting is always worth it. Restoring an offloaded expert never hurts a step;
it costs KV pages, which matter only while requests wait (then the adjuster
prices a restore with the same ``throughput``, mirrored: ``restore_pays``).

That test alone is a ratchet (measured on the H200, bench/RESULTS.md): it asks
only whether one more step of offloading beats the state now. Once many experts
are out a step is dominated by their PCIe time, more requests per step look
nearly free, and every further eviction passes, down to the offload limit, at a
third of plain SGLang's throughput under uniform routing. So an eviction must
also beat the states that bring experts *back* into the KV pages of fewer
requests (``restored_throughput``): with ``j`` experts back a step runs
``batch - ceil(j * kv_per_expert / kv_per_request)`` requests. From every
expert resident that reference is plain SGLang's operating point, and the pool
never leaves it unless offloading beats it.

Leaving that point has a price of its own (``eager_prefill_share``): while an
expert is out that a long prefill pass would route more than a block of tokens
to, those passes run eagerly instead of replaying SGLang's captured prefill
graphs (a replay would re-read it in place per block of tokens:
``RimuruRuntime.prefill_graph_may_replay``, ``sglang_rimuru/experts/in_place.py``).
On the H200 (bench/RESULTS.md, elastic32) eager prefills cost elastic about a
fifth of its throughput at equal decode steps: 811 against 1,037 tok/s. So every
state with such an expert out (per-token probability above ``replay_max_p``:
under uniform routing, any) runs at ``(1 - eager_prefill_share)`` of its decode
throughput; the first such eviction must win that back (an eviction priced
+1.7 % sent 22 uniform experts out for 10 s and turned the prefills eager), and
bringing those experts back earns it. Cold experts under ``replay_max_p`` (skewed
routing) go out without it: the largest prefill pass still replays.

The margin guards a decision against the estimates' error, but while a queue
waits one shortfall's victims are a step of a longer move: at a large batch one
request is a small share of a step (one of 261 is 0.38 %), so each shortfall's
own move gains less than the margin however clearly it pays, and the queue waits
for running requests to finish. On one H100 (bench/RESULTS.md, Qwen3-30B-A3B at
32 GB, uniform) elastic priced out 149 rounds with 10-118 waiting and 230-280
running, where 11 victims for 2 more requests gained +0.5 % and twice as many
+1.3 %. So a step that gains at all (``margin=0``) is priced by the adjuster as
the first step of the larger moves the queue would fill (``Adjuster._leaving_pays``);
the margin then applies to the whole move.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

__all__ = ["CostModel", "RoutedExperts", "StepClock", "step_record_path", "touched"]


def touched(p: float, batch: int) -> float:
    """Probability that a decode step of ``batch`` tokens routes at least one to an
    expert each token picks with probability ``p``."""
    if batch <= 0 or p <= 0.0:
        return 0.0
    return 1.0 - (1.0 - min(p, 1.0)) ** batch


def _groups(desc: list[float]) -> list[tuple[float, int]]:
    """``desc`` (sorted high to low) as (mean, count) runs whose values lie within ~5 % of
    the run's first: a ranking of 1,440 experts sums as a few dozen terms."""
    out: list[tuple[float, int]] = []
    total, count, first = 0.0, 0, None
    for p in desc:
        if first is not None and p < first * 0.95:
            out.append((total / count, count))
            total, count, first = 0.0, 0, None
        if first is None:
            first = p
        total += p
        count += 1
    if count:
        out.append((total / count, count))
    return out


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step time and PCIe price of one model on one GPU (all times in ms).

    ``expert_ms``: one expert's bytes / the in-place read rate over PCIe.
    ``base_ms`` + ``per_request_ms * B``: a decode step with every expert resident.
    ``margin``: the relative gain an eviction must promise (the estimates are rough;
    never offload on a coin flip).
    ``eager_prefill_share``: the share of throughput lost while an expert is out
    that makes prefill passes run eagerly (module docstring; 0 where prefill runs
    eagerly anyway: CPU, CUDA graphs off).
    ``replay_max_p``: the per-token probability up to which an offloaded expert
    leaves the largest prefill pass replaying (``in_place.replay_max_probability``);
    0 (the default): every expert that is ever routed makes prefills eager.
    """

    expert_ms: float
    base_ms: float
    per_request_ms: float
    margin: float = 0.01
    eager_prefill_share: float = 0.0
    replay_max_p: float = 0.0

    #: restored_throughput tries every j experts back up to EXACT_J, then SPREAD_J more
    EXACT_J = 16
    SPREAD_J = 16

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"CostModel.{f.name} must be a number >= 0, got {v!r}")
        if self.base_ms + self.per_request_ms <= 0:
            raise ValueError("CostModel: a decode step must take some time (base_ms + per_request_ms > 0)")
        if self.eager_prefill_share >= 1:
            raise ValueError(f"CostModel.eager_prefill_share must be < 1, got {self.eager_prefill_share!r}")

    @classmethod
    def for_expert(cls, expert_bytes: int, pcie_gbps: float, base_ms: float, per_request_ms: float,
                   margin: float = 0.01, eager_prefill_share: float = 0.0,
                   replay_max_p: float = 0.0) -> "CostModel":
        if pcie_gbps <= 0:
            raise ValueError(f"pcie_gbps must be > 0, got {pcie_gbps!r}")
        return cls(expert_ms=expert_bytes / (pcie_gbps * 1e6), base_ms=base_ms,
                   per_request_ms=per_request_ms, margin=margin, eager_prefill_share=eager_prefill_share,
                   replay_max_p=replay_max_p)

    def eager(self, offloaded: Iterable[float]) -> bool:
        """Whether a state with ``offloaded`` experts' probabilities out pays
        ``eager_prefill_share``: one of them is above ``replay_max_p``."""
        return self.eager_prefill_share > 0 and any(p > self.replay_max_p for p in offloaded)

    def step_ms(self, batch: int) -> float:
        """A decode step of ``batch`` requests with every expert resident."""
        return self.base_ms + self.per_request_ms * max(0, batch)

    @staticmethod
    def expected_reads(probabilities: Iterable[float], batch: int) -> float:
        """Offloaded experts (with these probabilities) a step of ``batch`` reads, expected."""
        return sum(touched(p, batch) for p in probabilities)

    def offload_ms(self, probabilities: Iterable[float], batch: int) -> float:
        """Expected PCIe time per step of the offloaded experts with these probabilities."""
        return self.expected_reads(probabilities, batch) * self.expert_ms

    def throughput(self, batch: int, offloaded: Iterable[float]) -> float:
        """Decode tokens per ms at ``batch`` with ``offloaded`` experts' probabilities
        (less ``eager_prefill_share`` when they make prefills eager: ``eager``)."""
        if batch <= 0:
            return 0.0
        offloaded = offloaded if isinstance(offloaded, (list, tuple)) else list(offloaded)
        tp = batch / (self.step_ms(batch) + self.offload_ms(offloaded, batch))
        return tp * (1.0 - self.eager_prefill_share) if self.eager(offloaded) else tp

    def restored_throughput(self, batch: int, offloaded: list[float], kv_per_request: float,
                            kv_per_expert: float) -> float:
        """The best decode throughput among the states that bring offloaded experts back
        into the KV pages of requests not run instead (the most touched come back
        first); 0 when no such state runs a request. KV in any unit, the same for both.

        With ``j`` experts back the batch is ``batch - ceil(j * kv_per_expert /
        kv_per_request)`` (for a fixed set out, throughput grows with the batch, so
        that largest batch is the one to price). Every ``j`` up to ``EXACT_J`` is
        tried, then ``SPREAD_J`` more spread to all of them; the experts still out
        are summed in groups of probabilities within ~5 % of each other (a round
        may price this often: plain Python stays well under a millisecond).
        """
        if batch <= 1 or not offloaded or kv_per_request <= 0 or kv_per_expert <= 0:
            return 0.0
        desc = sorted(offloaded, reverse=True)
        groups = _groups(desc)
        n = len(offloaded)
        js = sorted(set(range(1, min(n, self.EXACT_J) + 1))
                    | {max(1, n * k // self.SPREAD_J) for k in range(1, self.SPREAD_J + 1)})
        best = 0.0
        for j in js:
            b = batch - math.ceil(j * kv_per_expert / kv_per_request - 1e-9)
            if b < 1:
                break
            reads, skip = 0.0, j
            for p, count in groups:  # the j most probable are back: skip them
                left = count - min(skip, count)
                skip -= count - left
                if left:
                    reads += left * touched(p, b)
            tp = b / (self.step_ms(b) + reads * self.expert_ms)
            # the j most probable back: the rest's hottest (desc[j]) says whether prefills stay eager
            best = max(best, tp * (1.0 - self.eager_prefill_share) if j < n and self.eager(desc[j:j + 1]) else tp)
        return best

    def eviction_pays(self, batch: int, admit: int, offloaded: list[float], victims: list[float],
                      kv_per_request: float = 0.0, kv_per_expert: float = 0.0,
                      margin: float | None = None) -> bool:
        """Whether offloading ``victims`` to run ``admit`` more requests beats not doing it,
        and (given the KV sizes) beats bringing offloaded experts back instead, by
        ``margin`` (default: the model's; 0 asks only whether it gains at all)."""
        ref, after = (self.eviction_price(batch, admit, offloaded, victims, kv_per_request, kv_per_expert)
                      if batch > 0 and admit > 0 else (0.0, 0.0))
        return self.price_pays(batch, admit, ref, after, margin)

    def price_pays(self, batch: int, admit: int, reference: float, after: float | None,
                   margin: float | None = None) -> bool:
        """``eviction_pays``'s verdict on a price already taken (``eviction_price``'s pair,
        which it reads only where ``batch`` and ``admit`` are both positive): no admitted
        request never pays, any while nothing runs always does, else ``after`` must beat
        ``reference`` by ``margin``."""
        if admit <= 0:
            return False
        if batch <= 0:
            return True  # nothing runs: any request admitted is pure gain
        return self.beats(reference, after, margin)

    def beats(self, reference: float, after: float, margin: float | None = None) -> bool:
        """Whether ``after`` beats ``reference`` by ``margin`` (default: the model's)."""
        return after > (1.0 + (self.margin if margin is None else margin)) * reference

    def eviction_price(self, batch: int, admit: int, offloaded: list[float], victims: list[float],
                       kv_per_request: float = 0.0, kv_per_expert: float = 0.0) -> tuple[float, float]:
        """``(reference, after)`` in decode tokens per ms, as ``eviction_pays`` weighs them:
        today's (or the best state that brings experts back, given the KV sizes) and the
        one with ``victims`` out and ``admit`` more requests running."""
        now = self.throughput(batch, offloaded)
        ref = max(now, self.restored_throughput(batch, offloaded, kv_per_request, kv_per_expert))
        return ref, self.throughput(batch + admit, [*offloaded, *victims])

    def keep_beats_retract(self, batch: int, offloaded: list[float], victims: list[float],
                           kv_per_request: float = 0.0, kv_per_expert: float = 0.0) -> bool:
        """Decode is short of KV: offload ``victims`` and keep all ``batch`` requests, or
        let SGLang retract one (which also redoes its prefill later: not counted, so
        this leans towards retracting) and, given the KV sizes, maybe bring experts back."""
        if batch <= 1:
            return True
        keep = self.throughput(batch, [*offloaded, *victims])
        retract = self.throughput(batch - 1, offloaded)
        ref = max(retract, self.restored_throughput(batch - 1, offloaded, kv_per_request, kv_per_expert))
        return keep > (1.0 + self.margin) * ref


class RoutedExperts:
    """The experts, over every layer, that a decode step of ``B`` tokens is expected to
    route to (``sum(touched(p, B))`` over every expert, resident or not), and its slope
    in ``B``: what a decode step's MoE weight reads grow with (``StepClock``).

    Each layer's experts are summed in groups of probabilities within ~5 % of each other
    (``restored_throughput``'s grouping; ~1 % off at most) and each batch size's count is
    kept: a fit over a window of steps asks the same few dozen sizes again and again.
    """

    def __init__(self, probabilities: Iterable[float]) -> None:
        self._groups = _groups(sorted((min(max(p, 0.0), 1.0) for p in probabilities), reverse=True))
        self._count: dict[int, float] = {}

    def __call__(self, batch: int) -> float:
        got = self._count.get(batch)
        if got is None:
            got = self._count[batch] = sum(n * touched(p, batch) for p, n in self._groups)
        return got

    def slope(self, batch: float) -> float:
        """d/dB of the count at ``batch``: ``sum(-(1 - p) ** B * ln(1 - p))`` (0 for an
        expert every token picks)."""
        return sum(-n * (1.0 - p) ** batch * math.log1p(-p) for p, n in self._groups if 0.0 < p < 1.0)


def step_record_path(trace_path: str) -> str:
    """Where a server writing its adjuster trace to ``trace_path`` records the decode steps
    its ``StepClock`` timed (the integrator writes it, bench/serving/run_one.py reads it)."""
    return trace_path.removesuffix(".jsonl") + ".steps.jsonl"


class StepClock:
    """Decode step times, fitted as ``base_ms + per_request_ms * B + expert_ms * R``.

    The integrator records, per decode step, the time between two consecutive
    decode rounds, the batch size ``B`` and ``R``: the offloaded experts the step
    was expected to read (``sum(touched(p, B))`` over the experts out then).
    Without ``R`` the offloaded experts' PCIe time would land in the per-request
    slope, and a pool with many experts out would price a request far above an
    expert: the ratchet ``CostModel`` guards against.

    ``fit`` works in two stages, because under load ``R`` follows ``B`` (every
    offloaded expert is read by every step once the batch is large) and one joint
    least-squares fit cannot tell them apart: on the H200 (bench/RESULTS.md,
    elastic32 of 2026-12-01) such a fit kept the prior's ``expert_ms`` and put the
    rest of a 350 ms PCIe-bound step into ``base_ms``, after which one more request
    looked nearly free and every eviction paid.

    1. The resident line ``base + per * B`` from the last ``window`` steps that
       read nothing (``R == 0``), kept apart from the reading steps: the line is
       a property of the GPU and the model, and a burst with experts out for
       minutes must not push it out of the window (the H200 run of ``3a91dd2``
       fell back to the prior that way and priced reads against a line 25 %
       off). Least squares once ``min_samples`` of them span ``MIN_SPAN``
       batch sizes; with fewer, or a narrower span (a burst's first steps at
       batch 1-6 fitted a flat line there: one more request looked free), the
       prior's slope through their mean; with none, the prior's line. Negative
       terms clamp to 0; a line that leaves no time at batch 1 is never
       returned (the prior's is).
    2. ``expert_ms`` from the last ``window`` steps that read offloaded experts,
       once ``min_samples`` of them exist: what they took beyond the resident
       line, per expected read (least squares through the origin); the prior's
       while fewer. Never below ``(1 - MAX_HIDDEN) * prior``: the prior is the
       expert's bytes over the measured PCIe rate, and at most ``MAX_HIDDEN``
       of a read hides behind compute (bench/RESULTS.md: 0-25 %). With a few
       experts out the reads are a small part of a step and the line's error
       decides the fit: the H200 run of ``3a91dd2`` fitted 0.092 ms against a
       measured 0.34 with 5 experts out, and then evicted 133 more. With the CPU split
       the GPU reads only its share of the offloaded experts (the host computes the
       rest beside it), so the floor scales by that share (``fit(floor_scale)``):
       otherwise a split that makes reads ~0.65x as dear (thirty-ninth session's
       balance at 24 GB) would still be priced at 0.75x, and keep experts in that
       its KV would pay for.

    Whatever the resident line misses lands in ``expert_ms``: a line too fast
    for this GPU (the prior on a slower card) makes reads look dearer, so the
    error leans towards keeping experts resident. Deterministic.

    **The resident step is not a line in B.** At decode sizes a step is bound by
    reading the routed experts' weights from HBM, so it grows with the distinct
    experts the batch routes to (``RoutedExperts``), which saturate: on one H100
    (bench/RESULTS.md, forty-fourth session, Qwen1.5 at 32 GB, skewed) the
    resident steps of the burst's ramp (batch 1-24) fitted a line of 0.255 ms a
    request, which put a resident step at batch 60 at 19.2 ms where the whole step,
    15.5 offloaded reads included, took 17.9 (plain SGLang's at 28 running: 8.3
    against the line's 11.1). The reads' price then fell to its floor (0.259 ms,
    where that machine's reads cost ~0.5) and one more request looked ~4x dearer
    than it was at the batches the adjuster priced (0.255 against ~0.06 ms at 40). Given ``routed`` (the count's
    function), stage 1 fits ``base + h * routed(B)`` to the resident steps, stage 2
    prices the reads against that curve, and ``fit(at_batch=B)`` returns the curve's
    tangent at ``B``, the batch the adjuster prices moves around: ``CostModel``
    keeps its line, and near ``B`` the line is the curve. (A concave curve lies
    under its tangent: farther off, the line prices a step dear, which leans an
    eviction's larger batch towards keeping and a restore's smaller one towards
    evicting; over the few requests one round moves, by little.) Replayed on
    recorded runs by ``bench/serving/step_fit.py``.
    """

    MIN_STEP_MS = 1e-3  # a resident step's line must leave at least 1 us at batch 1
    MIN_SPAN = 8  # a fitted slope needs resident steps at batch sizes this far apart
    MAX_HIDDEN = 0.25  # the most of an offloaded read that compute hides (bench/RESULTS.md)
    PRIOR_SPAN = 32  # the prior line's batch range (the probe's: runtime.STEP_PRIOR_MS), its curve's

    def __init__(self, prior: tuple[float, float, float], window: int = 512, min_samples: int = 32,
                 routed: RoutedExperts | None = None) -> None:
        """``routed``: a ``RoutedExperts`` (the resident step's curve, class docstring);
        without it the resident step is fitted as a line in B."""
        if window < 2 or min_samples < 2:
            raise ValueError("StepClock: window and min_samples must be >= 2")
        if len(prior) != 3:
            raise ValueError(f"StepClock: prior is (base_ms, per_request_ms, expert_ms), got {prior!r}")
        self.prior = tuple(float(v) for v in prior)
        self.window = window
        self.min_samples = min_samples
        self.routed = routed
        self.tangent_at: int | None = None  # the batch the last fit's line is the curve's tangent at
        self._resident: list[tuple[int, float]] = []  # (B, ms) of steps that read nothing
        self._reading: list[tuple[int, float, float]] = []  # (B, ms, R) of the others

    def record(self, batch: int, ms: float, reads: float = 0.0) -> None:
        if batch <= 0 or not ms > 0 or not reads >= 0:
            return
        if reads > 0:
            samples, row = self._reading, (int(batch), float(ms), float(reads))
        else:
            samples, row = self._resident, (int(batch), float(ms))
        samples.append(row)
        if len(samples) > self.window:
            del samples[: len(samples) - self.window]

    def __len__(self) -> int:
        return len(self._resident) + len(self._reading)

    def samples(self) -> list[tuple[int, float, float]]:
        """The kept ``(B, ms, R)`` records: the resident ones, then the reading ones."""
        return [(b, t, 0.0) for b, t in self._resident] + list(self._reading)

    def fit(self, floor_scale: float = 1.0, at_batch: int | None = None) -> tuple[float, float, float]:
        """``(base_ms, per_request_ms, expert_ms)``; ``floor_scale`` (0, 1]: the share of
        the offloaded experts the GPU itself reads (the CPU split's; 1 without it).
        ``at_batch``: the batch the line is for, its tangent to the resident step's curve
        there (with ``routed``, once the resident steps fit one: class docstring); else
        the line fitted in B."""
        if not 0.0 < floor_scale <= 1.0:
            raise ValueError(f"StepClock.fit: floor_scale {floor_scale} is a share, in (0, 1]")
        curve = self._resident_curve() if at_batch is not None and at_batch > 0 else None
        self.tangent_at = at_batch if curve is not None else None  # what the last fit's line is
        if curve is not None:
            base_r, h = curve
            resident = lambda b: base_r + h * self.routed(b)  # noqa: E731
            per = h * self.routed.slope(at_batch)
            base = resident(at_batch) - per * at_batch
        else:
            base, per = self._resident_line()
            resident = lambda b: base + per * b  # noqa: E731
        exp = self.prior[2]
        reading = self._reading
        if len(reading) >= self.min_samples:
            srr = sum(r * r for _, _, r in reading)
            exp = sum((t - resident(b)) * r for b, t, r in reading) / srr
        return base, per, max(exp, (1.0 - self.MAX_HIDDEN) * self.prior[2] * floor_scale)

    def _resident_curve(self) -> tuple[float, float] | None:
        """``(base, h)`` of ``base + h * routed(B)`` fitted to the resident steps
        (``_resident_fit``), the prior's curve being the one that takes the prior line's
        time at batch 1 and at ``PRIOR_SPAN`` (an all-at-once burst evicts before its batch
        spans ``MIN_SPAN``). None without ``routed``, for a routing in which no batch adds
        an expert, or where the curve leaves no time at batch 1."""
        r = self.routed
        if r is None or r(self.PRIOR_SPAN) <= r(1):
            return None
        per0 = self.prior[1]
        return self._resident_fit(r, per0 * (self.PRIOR_SPAN - 1) / (r(self.PRIOR_SPAN) - r(1)))

    def _resident_line(self) -> tuple[float, float]:
        base0, per0, _ = self.prior
        if not self._resident:
            return base0, per0
        return self._resident_fit(lambda b: b, per0) or (base0, per0)

    def _resident_fit(self, x: Callable[[int], float], slope0: float) -> tuple[float, float] | None:
        """``(base, slope)`` of ``base + slope * x(B)`` over the resident steps: least
        squares once ``min_samples`` of them span ``MIN_SPAN`` batch sizes; with fewer,
        or a narrower span, ``slope0`` through their mean; with none, the prior's time
        at batch 1 with ``slope0``. Negative terms clamp to 0; None where the fit leaves
        no time at batch 1 (class docstring: why each)."""
        base0, per0, _ = self.prior
        slope, base = slope0, base0 + per0 - slope0 * x(1)
        pts = self._resident
        n = len(pts)
        if n:
            xs = [x(b) for b, _ in pts]
            mx, my = sum(xs) / n, sum(t for _, t in pts) / n
            span = max(b for b, _ in pts) - min(b for b, _ in pts)
            sxx = sum((v - mx) ** 2 for v in xs)
            if n >= self.min_samples and span >= self.MIN_SPAN and sxx > 0:
                slope = max(0.0, sum((v - mx) * (t - my) for v, (_, t) in zip(xs, pts)) / sxx)
            base = my - slope * mx
        base = max(0.0, base)
        return (base, slope) if base + slope * x(1) > self.MIN_STEP_MS else None
