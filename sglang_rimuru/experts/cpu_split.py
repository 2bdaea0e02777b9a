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
    active[pos]   1 where the layer has host experts, else 0: the handshake's launches
                  do nothing then, and the pass costs five empty launches a layer
    the pass      pack_request, post_request, the GPU's share (paged kernel, split
                  table), await_reply, add_reply (``rimuru_kernels.handshake``)
    host thread   sees the request, reads which experts are its own from the table
                  column the pass packed (so it computes exactly what the table the
                  GPU ran skipped, whatever moved since), computes them from the host
                  store in place (``CpuExperts``), writes the reply

Which experts: ``share`` of each layer's offloaded experts (rounded), the ones most
often routed by the ranking (ties: ranking order), so the host carries reads the GPU
would otherwise make. Outputs are not bit-equal to the GPU's (other matmul units, and
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

from .cpu_experts import CpuExperts, store_weights
from .host_store import HostExpertStore, pinned_empty
from .shapes import MoEShape

logger = logging.getLogger(__name__)

__all__ = ["CpuSplit", "CpuSplitFailed", "choose_host_experts"]

#: ~20-40 s of PCIe polls before the device gives up on a reply: a dead host thread
#: is a reported error (``CpuSplit.check``), not a hung server
MAX_SPINS = 20_000_000
#: the interpreter's scheduler switch interval while a split serves: the host thread
#: needs the GIL within a layer's time, not the default 5 ms (a Python thread that
#: holds it keeps it that long before a waiting one runs)
SWITCH_INTERVAL_S = 0.0002


class CpuSplitFailed(RuntimeError):
    """The host side of the CPU split failed, or the device timed out waiting for it."""


def choose_host_experts(offloaded: Sequence[int], token_p: Sequence[float], share: float) -> list[int]:
    """The host's experts of one layer: ``round(share * len(offloaded))`` of the
    offloaded experts, the most often routed first (``token_p``: each expert's
    probability of a token's routing; ties keep the order of ``offloaded``), sorted."""
    n = int(share * len(offloaded) + 0.5)
    order = sorted(range(len(offloaded)), key=lambda i: (-token_p[offloaded[i]], i))
    return sorted(offloaded[i] for i in order[:n])


class CpuSplit:
    """One TP rank's CPU split: split tables, the mailbox, and the host thread."""

    def __init__(self, shape: MoEShape, host_store: HostExpertStore, device: torch.device | str, *,
                 share: float, min_tokens: int, max_tokens: int, threads: int,
                 max_spins: int = MAX_SPINS):
        from rimuru_kernels.handshake import HostMailbox  # lazy: triton only where it runs

        if not 0 < share < 1:
            raise ValueError(f"share {share}: a fraction of each layer's offloaded experts, in (0, 1)")
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"tokens {min_tokens}..{max_tokens}: need 1 <= min <= max")
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
        self._active = torch.zeros(len(shape.layer_ids), dtype=torch.int32, device=self.device)
        self._host_experts: dict[int, list[int]] = {l: [] for l in shape.layer_ids}
        self._weights = {l: store_weights(host_store.layer_tensor(l), shape.inter, shape.hidden)
                         for l in shape.layer_ids}
        self._experts = CpuExperts(threads)
        self._n = dict(requests=0, host_ms=0.0, host_experts=0)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._last = 0
        self._switch_interval = sys.getswitchinterval()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ tables

    def update_layer(self, layer: int, home_rows: Sequence[tuple[int, int, int]], offloaded: Sequence[int],
                     token_p: Sequence[float]) -> list[int]:
        """Rewrite ``layer``'s split table from its home rows (called where the home table
        is rewritten, so both reach the device in the same stream order); return the
        host's experts."""
        mine = choose_host_experts(offloaded, token_p, self.share)
        own = set(mine)
        rows = [(-1, -1, -1) if x in own else tuple(r) for x, r in enumerate(home_rows)]
        if any(-1 in r for x, r in enumerate(rows) if x not in own):
            raise ValueError(f"layer {layer}: home rows with -1 outside the host's experts (no host reads?)")
        pos = self.shape.position(layer)
        src = torch.tensor(rows, dtype=torch.int32)
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        cuda = self.device.type == "cuda"
        if cuda:  # pinned + async: a pageable copy would wait for the running pass
            src, flag = src.pin_memory(), flag.pin_memory()
        self._split[layer].copy_(src, non_blocking=cuda)
        self._active[pos:pos + 1].copy_(flag, non_blocking=cuda)
        self._host_experts[layer] = mine
        return mine

    def split_table(self, layer: int) -> torch.Tensor:
        return self._split[layer]

    def host_experts(self, layer: int) -> list[int]:
        """The host's experts of ``layer`` as of its last table rewrite."""
        return list(self._host_experts[layer])

    def host_counts(self) -> list[int]:
        """How many experts the host has in each layer (forward order), for the logs."""
        return [len(self._host_experts[l]) for l in self.shape.layer_ids]

    # ------------------------------------------------------------------ the pass

    def applies(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens splits (a graph captured for it keeps
        the handshake; layers with no host experts then skip it on the device)."""
        return self.min_tokens <= tokens <= self.max_tokens

    def forward(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                gpu_compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's routed-expert output: ``gpu_compute(split_table)`` (the paged
        kernel over resident experts and the GPU's offloaded ones) plus the host's
        share. Enqueues only (no sync): CUDA-graph safe once the host thread runs."""
        from rimuru_kernels.handshake import add_reply, await_reply, pack_request, post_request

        if self._thread is None:
            raise CpuSplitFailed("the CPU split's host thread is not running (call start())")
        pos, table, T = self.shape.position(layer), self._split[layer], x.shape[0]
        mb = self.mailbox
        pack_request(mb, x, topk_ids, topk_weights, table, self._active, pos)
        post_request(mb, self._active, pos, layer, T)
        gpu = gpu_compute(table)
        await_reply(mb, self._active, pos, self.max_spins)
        return add_reply(mb, gpu, self._active, pos)

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

        f = self.mailbox.flags
        n = int(f[REQUEST])
        if n == self._last:
            return False
        meta = int(f[META])
        layer, T = meta >> 16, meta & 0xFFFF
        t0 = time.perf_counter()
        mb = self.mailbox
        mine = torch.nonzero(mb.table == -1).reshape(-1)
        self._experts(mb.x[:T], mb.ids[:T], mb.weights[:T], self._weights[layer], mine, out=mb.part[:T])
        self._n["host_ms"] += (time.perf_counter() - t0) * 1e3
        self._n["requests"] += 1
        self._n["host_experts"] += int(mine.numel())
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
        the host's mean ms and experts a request."""
        n = dict(self._n)
        r = max(1, n["requests"])
        return dict(requests=n["requests"], host_ms_per_request=n["host_ms"] / r,
                    host_experts_per_request=n["host_experts"] / r)
