"""GPU time of each forward pass, beside the step record's wall time.

The step record (``--rimuru-adjuster-trace``: ``_StepTiming`` in ``elastic.py``)
times a decode step as the wall time between two decode rounds: under the overlap
scheduler, the longer of the GPU's pass and the CPU's scheduling. On the H200 a
uniform Qwen3-30B-A3B step took 1,043 ms where its in-place reads alone take
~740 ms (bench/RESULTS.md), and the wall time cannot say whether the GPU or the
CPU held the rest. This keeps what the GPU itself spent: two CUDA events around
``ModelRunner.forward`` (graph replay included; never while a graph is being
captured), read once the end event has completed, without waiting. A pass whose
GPU time is well under its round's wall time was held up by the CPU. Prefill
passes (extend, and mixed ones that carry the running decodes:
``mixed_decodes.py``) are timed too, with their kind: decode steps alone no
longer count the tokens a server makes when prefill passes advance the decodes.

GPU memory beside the time (``memory``): the peak the caching allocator handed out
from one pass's start to the next one's (the pass, its sampling and whatever ran
between; the peak is reset at each start) and what it had reserved then, as
``[kind, batch, peak allocated MiB, reserved MiB]``. Why: on the H200 an elastic
Qwen3-30B-A3B server at 32 GB grew from 31.2 to 36.0 GB of process memory while its
running requests went from ~195 to ~277 (decode passes past the largest graph,
eager, and prefill passes carrying them), over the card (bench/RESULTS.md, eleventh
session); nvidia-smi cannot say which passes took it, or whether live tensors or the
allocator's cache hold it.

Written by the ``experts.forward_pass`` seam (the forward thread), read by
``_StepTiming`` (the scheduler's round): deque appends and pops are atomic.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

__all__ = ["CudaMemory", "PassTimer", "current", "timer_for"]

MIB = 1 << 20


class CudaMemory:
    """The caching allocator's peak since the last call, and what it holds reserved
    (bytes); the peak is reset for the next span. Device-wide counters: SGLang reads
    ``max_memory_allocated`` only while it loads weights, before any pass."""

    def __init__(self, torch_cuda) -> None:
        self._cuda = torch_cuda

    def span(self) -> tuple[int, int]:
        peak, reserved = self._cuda.max_memory_allocated(), self._cuda.memory_reserved()
        self._cuda.reset_peak_memory_stats()
        return peak, reserved


class PassTimer:
    """Start and end events of the passes still on the GPU, and their times once done.

    ``new_event()`` makes an event with ``record()``, ``query()`` and
    ``elapsed_time(end)`` (``torch.cuda.Event(enable_timing=True)``; tests pass
    stand-ins). Events are reused. At most ``max_pending`` passes wait to be read:
    beyond that the oldest are dropped (``dropped``), so nothing grows while no
    one reads.
    """

    def __init__(self, new_event: Callable[[], object], max_pending: int = 512, memory=None) -> None:
        self._new_event = new_event
        self._free: list = []
        self._pending: deque = deque()  # (batch, start event, end event), oldest first
        self.max_pending = max_pending
        self.dropped = 0
        self._memory = memory  # a CudaMemory (or a stand-in with ``span()``), or None
        self._last: tuple[str, int] | None = None  # (kind, batch) of the pass whose span is open
        self._mem_rows: deque = deque(maxlen=max_pending)  # [kind, batch, peak MiB, reserved MiB]

    def _event(self):
        try:
            return self._free.pop()
        except IndexError:
            return self._new_event()

    def begin(self, batch: int, kind: str = "decode") -> tuple:
        """Before a pass of ``batch`` requests is enqueued (``kind``: decode, extend or
        mixed): its start event, recorded on the current stream."""
        if self._memory is not None:
            peak, reserved = self._memory.span()  # closes the previous pass's span
            if self._last is not None:
                self._mem_rows.append([*self._last, round(peak / MIB), round(reserved / MIB)])
            self._last = (kind, batch)
        start = self._event()
        start.record()
        return batch, kind, start

    def end(self, token: tuple) -> None:
        """After the pass is enqueued: its end event, after the pass's last kernel."""
        batch, kind, start = token
        end = self._event()
        end.record()
        self._pending.append((batch, kind, start, end))
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1

    def collect(self) -> list[list]:
        """``[batch, GPU ms, kind]`` of the passes finished since the last call, in order (stops
        at the first still running: passes on one stream finish in order)."""
        out = []
        while self._pending:
            batch, kind, start, end = self._pending[0]
            if not end.query():
                break
            self._pending.popleft()
            out.append([batch, round(start.elapsed_time(end), 3), kind])
            self._free += [start, end]
        return out

    def collect_memory(self) -> list[list]:
        """``[kind, batch, peak allocated MiB, reserved MiB]`` of the passes whose span
        closed since the last call (a span closes when the next pass begins), in order."""
        out = list(self._mem_rows)
        self._mem_rows.clear()
        return out


#: the process's timer: made by the first pass of an elastic runtime writing a trace on CUDA
_TIMER: PassTimer | None = None
_CHECKED = False


def timer_for(runtime) -> PassTimer | None:
    """The timer when ``runtime`` is elastic, writes its adjuster trace and runs on CUDA; else None."""
    global _TIMER, _CHECKED
    if not _CHECKED:
        _CHECKED = True
        elastic = getattr(runtime, "elastic", None)
        if elastic is not None and getattr(elastic, "trace_path", None) and runtime.device.type == "cuda":
            import torch

            _TIMER = PassTimer(lambda: torch.cuda.Event(enable_timing=True), memory=CudaMemory(torch.cuda))
    return _TIMER


def current() -> PassTimer | None:
    """The timer, if the forward seam made one (the scheduler's round reads it)."""
    return _TIMER
