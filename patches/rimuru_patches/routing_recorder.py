"""Recording each MoE layer's routing, for the hot-expert ranking (``--rimuru-record-routing``).

Active in any mode when the flag is given. Every forward pass adds, per MoE
layer, how many tokens routed to each expert (top-k selections, from the
``topk_ids`` SGLang's router produced) on the device, without a host sync;
after the pass, TP rank 0 writes the ranking file (experts by selection
frequency, most frequent first; ``sglang_rimuru/experts/README.md`` has the
format) atomically. Writing after every pass costs one small device-to-host
copy per pass, which is fine for an offline profiling run: the file is final
by the time a client has its last response. ``python -m sglang_rimuru.rank``
drives such a run.
"""

from __future__ import annotations

import logging

import torch

from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, register

logger = logging.getLogger(__name__)


class RoutingRecorder:
    def __init__(self, path: str):
        self.path = path
        self.counts: dict[int, torch.Tensor] = {}  # layer id -> int64 [E] on the device
        self.tokens: dict[int, int] = {}
        self.dirty = False

    def record(self, layer_id: int, num_experts: int, topk_ids: torch.Tensor) -> None:
        counts = self.counts.get(layer_id)
        if counts is None:
            counts = self.counts[layer_id] = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
            self.tokens[layer_id] = 0
        ids = topk_ids.reshape(-1).long()
        ids = ids[(ids >= 0) & (ids < num_experts)]  # padding / EP-masked ids carry no routing
        counts.index_add_(0, ids, torch.ones_like(ids))
        self.tokens[layer_id] += topk_ids.shape[0]
        self.dirty = True

    def write(self, model: str) -> None:
        from sglang_rimuru.experts import ExpertRanking, save_ranking

        orders, probabilities = {}, {}
        for layer_id, counts in sorted(self.counts.items()):
            freq = (counts.double().cpu() / max(1, self.tokens[layer_id])).tolist()
            order = sorted(range(len(freq)), key=lambda e: (-freq[e], e))
            orders[layer_id] = order
            probabilities[layer_id] = [freq[e] for e in order]
        ranking = ExpertRanking(len(next(iter(self.counts.values()))), orders, probabilities)
        save_ranking(self.path, ranking, model=f"{model} ({min(self.tokens.values())} tokens)")
        self.dirty = False


_RECORDER: RoutingRecorder | None = None


def _on(ctx: ProcessContext) -> bool:
    return bool(ctx.rimuru.get("record_routing"))


def _record(orig, ctx):
    def run_moe_core(self, dispatch_output):
        global _RECORDER
        if _RECORDER is None:
            _RECORDER = RoutingRecorder(ctx.rimuru["record_routing"])
        _RECORDER.record(self.layer_id, self.num_experts, dispatch_output.topk_output.topk_ids)
        return orig(self, dispatch_output)

    return run_moe_core


def _write_after_pass(orig, ctx):
    def forward(self, forward_batch, *args, **kwargs):
        out = orig(self, forward_batch, *args, **kwargs)
        if _RECORDER is not None and _RECORDER.dirty and self.ps.tp_rank == 0:
            _RECORDER.write(self.server_args.model_path)
        return out

    return forward


register(
    Seam(
        name="routing.record",
        target="sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE.run_moe_core",
        why="count each MoE layer's top-k selections for the hot-expert ranking",
        build=_record,
        applies=_on,
    )
)
register(
    Seam(
        name="routing.write",
        target="sglang.srt.model_executor.model_runner:ModelRunner.forward",
        why="write the ranking file after each forward pass (TP rank 0)",
        build=_write_after_pass,
        applies=_on,
    )
)
