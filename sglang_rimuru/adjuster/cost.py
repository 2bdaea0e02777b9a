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
it costs KV pages, which matter only while requests wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["CostModel", "StepClock", "touched"]


def touched(p: float, batch: int) -> float:
    """Probability that a decode step of ``batch`` tokens routes at least one to an
    expert each token picks with probability ``p``."""
    if batch <= 0 or p <= 0.0:
        return 0.0
    return 1.0 - (1.0 - min(p, 1.0)) ** batch


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Step time and PCIe price of one model on one GPU (all times in ms).

    ``expert_ms``: one expert's bytes / the in-place read rate over PCIe.
    ``base_ms`` + ``per_request_ms * B``: a decode step with every expert resident.
    ``margin``: the relative gain an eviction must promise (the estimates are rough;
    never offload on a coin flip).
    """

    expert_ms: float
    base_ms: float
    per_request_ms: float
    margin: float = 0.01

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"CostModel.{f.name} must be a number >= 0, got {v!r}")
        if self.base_ms + self.per_request_ms <= 0:
            raise ValueError("CostModel: a decode step must take some time (base_ms + per_request_ms > 0)")

    @classmethod
    def for_expert(cls, expert_bytes: int, pcie_gbps: float, base_ms: float, per_request_ms: float,
                   margin: float = 0.01) -> "CostModel":
        if pcie_gbps <= 0:
            raise ValueError(f"pcie_gbps must be > 0, got {pcie_gbps!r}")
        return cls(expert_ms=expert_bytes / (pcie_gbps * 1e6), base_ms=base_ms,
                   per_request_ms=per_request_ms, margin=margin)

    def step_ms(self, batch: int) -> float:
        """A decode step of ``batch`` requests with every expert resident."""
        return self.base_ms + self.per_request_ms * max(0, batch)

    def offload_ms(self, probabilities: Iterable[float], batch: int) -> float:
        """Expected PCIe time per step of the offloaded experts with these probabilities."""
        return sum(touched(p, batch) for p in probabilities) * self.expert_ms

    def throughput(self, batch: int, offloaded: Iterable[float]) -> float:
        """Decode tokens per ms at ``batch`` with ``offloaded`` experts' probabilities."""
        if batch <= 0:
            return 0.0
        return batch / (self.step_ms(batch) + self.offload_ms(offloaded, batch))

    def eviction_pays(self, batch: int, admit: int, offloaded: list[float], victims: list[float]) -> bool:
        """Whether offloading ``victims`` to run ``admit`` more requests beats not doing it."""
        if admit <= 0:
            return False
        if batch <= 0:
            return True  # nothing runs: any request admitted is pure gain
        now = self.throughput(batch, offloaded)
        after = self.throughput(batch + admit, [*offloaded, *victims])
        return after > (1.0 + self.margin) * now

    def keep_beats_retract(self, batch: int, offloaded: list[float], victims: list[float]) -> bool:
        """Decode is short of KV: offload ``victims`` and keep all ``batch`` requests, or
        let SGLang retract one (which also redoes its prefill later: not counted, so
        this leans towards retracting)."""
        if batch <= 1:
            return True
        keep = self.throughput(batch, [*offloaded, *victims])
        retract = self.throughput(batch - 1, offloaded)
        return keep > (1.0 + self.margin) * retract


class StepClock:
    """Decode step times by batch size, fitted as ``base_ms + per_request_ms * B``.

    The integrator records the time between two consecutive decode rounds and the
    batch size; ``fit`` is a least-squares line over the last ``window`` records
    (clamped to non-negative terms), or ``prior`` while fewer than ``min_samples``
    records span at least two batch sizes (then the prior's slope with the mean's
    intercept, once there is any record). Deterministic given the same records.
    """

    def __init__(self, prior: tuple[float, float], window: int = 512, min_samples: int = 32) -> None:
        if window < 2 or min_samples < 2:
            raise ValueError("StepClock: window and min_samples must be >= 2")
        self.prior = (float(prior[0]), float(prior[1]))
        self.window = window
        self.min_samples = min_samples
        self._samples: list[tuple[int, float]] = []

    def record(self, batch: int, ms: float) -> None:
        if batch <= 0 or not ms > 0:
            return
        self._samples.append((int(batch), float(ms)))
        if len(self._samples) > self.window:
            del self._samples[: len(self._samples) - self.window]

    def __len__(self) -> int:
        return len(self._samples)

    def fit(self) -> tuple[float, float]:
        """``(base_ms, per_request_ms)``."""
        xs = [b for b, _ in self._samples]
        ys = [t for _, t in self._samples]
        n = len(xs)
        base0, per0 = self.prior
        if n == 0:
            return self.prior
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if n < self.min_samples or sxx == 0:
            return max(0.0, my - per0 * mx), per0
        per = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
        return max(0.0, my - per * mx), per
