"""Prefill passes carry the running decodes while experts are offloaded (``--rimuru-mix-decodes``).

With experts offloaded a forward pass costs about the PCIe time of every offloaded
expert it routes to, and under load it routes to nearly all of them, whatever its
token count. SGLang runs a prefill pass and the decode batch as two passes (unless
``--enable-mixed-chunk``): each prefill round then stalls every running request
for one more read of the offloaded experts. On the H200 (Qwen3-30B-A3B shape,
32 GB card, 500 ShareGPT requests at 10 req/s, bench/RESULTS.md) the elastic
server held 310 running requests and spent 121 of its ~160 passes in 200 s on
prefills of 1-10 new requests, ~1.5 s each, that advanced none of them.

Seam ``scheduler.mix_decodes`` (``Scheduler.get_new_batch_prefill``): before
SGLang builds a prefill batch, its ``is_mixed_chunk`` (read only there in 0.5.17:
the PrefillAdder's decode-token reservation and ``mix_with_running``) is set to
SGLang's own setting OR "some routed expert is offloaded now", so a prefill pass
also advances every running request (SGLang still refuses to mix requests that
return logprobs). Nothing changes while every expert is resident; never under
``--enable-deterministic-inference``, whose batch-invariant outputs assume
SGLang's own batches. TP ranks hold the same residency (the order agreement), so
they decide alike.

GPU only: on CPU an offloaded expert costs no PCIe time (host memory is the memory the
CPU computes from), and SGLang 0.5.17's CPU attention (``torch_native``) cannot run a
mixed batch under the overlap scheduler: ``mix_with_running`` gives the running
requests a prefix length that already counts their pending token (``delta = 0``), and
``_run_sdpa_forward_extend`` then slices an empty output for them (a RuntimeError
that stops the scheduler; seen in tests/server/test_api.py's elastic burst). The H200
runs (triton attention) served mixed batches under the overlap scheduler without an
error (bench/RESULTS.md).
"""

from __future__ import annotations

import logging

from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, register

logger = logging.getLogger(__name__)


def _on(ctx: ProcessContext) -> bool:
    return ctx.rimuru.get("mode", "off") != "off" and ctx.rimuru.get("mix_decodes", "offloaded") == "offloaded"


def mix_now(sglang_setting: bool, chunked: bool, deterministic: bool, all_resident: bool, on_gpu: bool) -> bool:
    """Whether this round's prefill batch carries the running decodes."""
    if sglang_setting:
        return True
    return on_gpu and chunked and not deterministic and not all_resident


def _offloaded_mixing(orig, ctx):
    def get_new_batch_prefill(self, running_batch):
        from rimuru_patches.unified_pool.runtime import active

        if not hasattr(self, "_rimuru_mixed_chunk_sglang"):  # SGLang's own setting, once
            self._rimuru_mixed_chunk_sglang = bool(self.is_mixed_chunk)
        runtime = active()
        resident = runtime is None or runtime.residency.all_resident()
        mix = mix_now(self._rimuru_mixed_chunk_sglang,
                      self.chunked_prefill_size is not None and self.chunked_prefill_size > 0,
                      bool(self.server_args.enable_deterministic_inference), resident,
                      runtime is not None and runtime.device.type == "cuda")
        if mix != self.is_mixed_chunk and not self._rimuru_mixed_chunk_sglang:  # say when it changes
            logger.info("sglang-rimuru: prefill passes %s the running decodes (%s)",
                        "carry" if mix else "no longer carry",
                        "experts offloaded" if not resident else "every expert resident")
        self.is_mixed_chunk = mix
        return orig(self, running_batch)

    return get_new_batch_prefill


register(Seam(
    name="scheduler.mix_decodes",
    target="sglang.srt.managers.scheduler:Scheduler.get_new_batch_prefill",
    why="while experts are offloaded a prefill pass also advances the running decodes (SGLang's mixed "
        "chunked prefill), so each read of the offloaded experts serves every running request",
    build=_offloaded_mixing, applies=_on))
