"""The unified expert/KV page pool inside SGLang (``--rimuru-mode static``).

Seams (all inert unless the mode is on; ledger in ``patches/README.md``):

* ``ModelRunner.load_model``, ``UnquantizedFusedMoEMethod.create_weights``,
  ``initialize_dummy_weights``: routed experts are made and loaded in host
  memory, never on the GPU (``host_experts.py``);
* ``ModelRunner.alloc_memory_pool``: build the :class:`RimuruRuntime` (experts
  from host memory into pool pages) before SGLang builds its KV pool;
* ``KVCacheConfigurator._profile_available_bytes`` / ``_apply_token_constraints``:
  SGLang sizes its KV pool to what the unified pool can hold;
* ``KVCacheConfigurator._build_mha_kv_pool`` / ``_build_token_to_kv_pool_allocator``:
  the KV buffers are views of the pool's bytes; the allocator asks the pool;
* ``alloc_for_extend`` / ``alloc_for_decode`` as ``schedule_batch`` calls them:
  each request's KV slots from its own expert pages (``affinity.py``);
* ``ModelRunner.forward``: per-forward state of the expert manager;
* ``PrefillCudaGraphRunner.can_run_graph``: captured prefills replay only while
  every expert is resident (or for passes the MoE reads in place anyway);
* ``FusedMoE.run_moe_core``: managed layers compute from the pool; on CUDA
  the paged kernel with ``--rimuru-moe-kernel exact`` (default) gets SGLang's
  own launch configs, SiLU*up and top-k combine (``sglang_moe.py``, ledger row
  ``experts.kernel_hooks``), with ``fast`` its own (``RimuruRuntime.kernel_hooks``).
"""

from __future__ import annotations

import os

import torch

from rimuru_patches import pass_timer
from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, original, register
from rimuru_patches.unified_pool import affinity, host_experts


def _on(ctx: ProcessContext) -> bool:
    return ctx.rimuru.get("mode", "off") != "off"


def _runtime():
    from rimuru_patches.unified_pool.runtime import active

    return active()


def _alloc_memory_pool(orig, ctx):
    from sglang_rimuru.config import RimuruConfig

    config = RimuruConfig.from_dict(ctx.rimuru)

    def alloc_memory_pool(self, memory_pool_config=None):
        if self.is_draft_worker:
            return orig(self, memory_pool_config)
        from rimuru_patches.unified_pool.runtime import RimuruRuntime

        def profile_bytes() -> int:
            self.init_kv_cache_configurator()
            profile = original("pool.kv_budget")
            return profile(self.kv_cache_configurator, self.pre_model_load_memory)

        from rimuru_patches.start_errors import one_line_start_errors
        from sglang_rimuru.plan import PlanError

        with one_line_start_errors(PlanError):  # a budget that cannot work: one line, no traceback
            RimuruRuntime.build(self, config, profile_bytes)
        return orig(self, memory_pool_config)

    return alloc_memory_pool


def _kv_budget(orig, ctx):
    def _profile_available_bytes(self, pre_model_load_memory):
        runtime = _runtime()
        if runtime is None:
            return orig(self, pre_model_load_memory)
        # The pool already holds its bytes; SGLang must not profile them away.
        return runtime.geometry.pool_bytes

    return _profile_available_bytes


def _token_cap(orig, ctx):
    def _apply_token_constraints(self, token_capacity):
        capped = orig(self, token_capacity)
        runtime = _runtime()
        if runtime is None:
            return capped
        if runtime.elastic is not None:
            # --max-total-tokens sized the pool (KV at start, every expert resident);
            # KV grows past it as experts leave, up to what the offload limit allows.
            return runtime.kv_capacity_tokens
        return min(capped, runtime.kv_capacity_tokens)

    return _apply_token_constraints


def _kv_pool(orig, ctx):
    def _build_mha_kv_pool(self, *, max_total_num_tokens, mha_pool_class, quant_method=None):
        runtime = _runtime()
        if runtime is not None:
            from rimuru_patches.unified_pool.kv import pooled_kv_pool_class, sglang_kv_pool_size

            if quant_method is not None:
                raise RuntimeError("--rimuru-mode does not support a quantized KV cache")
            mha_pool_class = pooled_kv_pool_class(runtime)
            # SGLang's KV pool spans the pool's whole KV id space; admission keeps
            # max_total_num_tokens (the allocator's size). kv.sglang_kv_pool_size says why.
            max_total_num_tokens = sglang_kv_pool_size(runtime)
        return orig(
            self, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class, quant_method=quant_method
        )

    return _build_mha_kv_pool


def _allocator(orig, ctx):
    def _build_token_to_kv_pool_allocator(self, *, sizes, token_to_kv_pool, **kwargs):
        runtime = _runtime()
        if runtime is None or kwargs.get("token_to_kv_pool_allocator") is not None:
            return orig(self, sizes=sizes, token_to_kv_pool=token_to_kv_pool, **kwargs)
        from rimuru_patches.unified_pool.kv import PooledTokenToKVPoolAllocator

        return PooledTokenToKVPoolAllocator(
            sizes.max_total_num_tokens,
            dtype=self.kv_cache_dtype,
            device=self.device,
            kvcache=token_to_kv_pool,
            need_sort=False,
            runtime=runtime,
        )

    return _build_token_to_kv_pool_allocator


def _forward(orig, ctx):
    def forward(self, forward_batch, *args, **kwargs):
        runtime = _runtime()
        if runtime is None:
            return orig(self, forward_batch, *args, **kwargs)
        if runtime.cpu_split is not None:  # a failed host side stops the server here, loudly
            runtime.check_cpu_split()
            if forward_batch.input_ids is not None and not torch.cuda.is_current_stream_capturing():
                # every pass, replayed graphs too: the split's log line and gauges say how many of
                # them its token range covers (moe_forward runs no Python when a graph replays)
                runtime.cpu_split.note_pass(int(forward_batch.input_ids.shape[0]))
        runtime.manager.begin_forward()
        if runtime.elastic is not None:  # this round's migration order rides along this pass
            runtime.elastic.before_forward()
        # each pass's GPU time and kind, for the step record (elastic with a trace; pass_timer.py)
        timer = pass_timer.timer_for(runtime)
        mode = forward_batch.forward_mode
        timed = (timer.begin(forward_batch.batch_size,
                             "decode" if mode.is_decode() else "mixed" if mode.is_mixed() else "extend")
                 if timer is not None and (mode.is_decode() or mode.is_extend())
                 and not torch.cuda.is_current_stream_capturing() else None)
        try:
            return orig(self, forward_batch, *args, **kwargs)
        finally:
            if timed is not None:
                timer.end(timed)
            runtime.manager.end_forward()
            if runtime.elastic is not None:
                runtime.elastic.after_forward()
            runtime.log_stats_every(STATS_EVERY_FORWARDS)

    return forward


def _run_moe_core(orig, ctx):
    def run_moe_core(self, dispatch_output):
        runtime = _runtime()
        if runtime is None or self.layer_id not in runtime.layer_ids or self.layer_id in runtime.sglang_moe_layers:
            return orig(self, dispatch_output)  # not managed, or static in SGLang's layout (use_sglang_moe)
        return runtime.moe_forward(self, dispatch_output)

    return run_moe_core


def _prefill_graph_gate(orig, ctx):
    def can_run_graph(self, forward_batch):
        ok = orig(self, forward_batch)
        runtime = _runtime()
        if not ok or runtime is None:
            return ok
        return runtime.prefill_graph_may_replay(len(forward_batch.input_ids))

    return can_run_graph


#: forward passes between two expert-traffic log lines
STATS_EVERY_FORWARDS = int(os.environ.get("SGLANG_RIMURU_STATS_EVERY", "500"))

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner:ModelRunner"

for _name, _target, _why, _build in (
    ("pool.build", f"{_MODEL_RUNNER}.alloc_memory_pool", "build the unified pool and move experts into it before SGLang builds its KV pool", _alloc_memory_pool),
    ("pool.kv_budget", f"{_CONFIGURATOR}._profile_available_bytes", "the pool already took its memory; SGLang's KV budget is the pool", _kv_budget),
    ("pool.kv_capacity", f"{_CONFIGURATOR}._apply_token_constraints", "cap SGLang's max_total_num_tokens at what the pool can give KV", _token_cap),
    ("pool.kv_buffers", f"{_CONFIGURATOR}._build_mha_kv_pool", "KV buffers are strided views of the pool's bytes", _kv_pool),
    ("pool.kv_allocator", f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", "KV slots are the pool's KV pages", _allocator),
    ("experts.forward_pass", f"{_MODEL_RUNNER}.forward", "per-forward-pass state of the expert manager (prefetches live one pass)", _forward),
    ("experts.moe_core", "sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE.run_moe_core", "managed MoE layers compute from pool pages and load buffers", _run_moe_core),
    ("experts.prefill_graphs", "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph", "a captured prefill replays only where it computes what an eager pass would: every expert resident, or a pass the MoE reads in place anyway", _prefill_graph_gate),
):
    register(Seam(name=_name, target=_target, why=_why, build=_build, applies=_on))

_SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
for _name, _target, _build in (
    ("pool.kv_affinity_extend", f"{_SCHEDULE_BATCH}:alloc_for_extend", affinity.wrap_alloc_for_extend),
    ("pool.kv_affinity_decode", f"{_SCHEDULE_BATCH}:alloc_for_decode", affinity.wrap_alloc_for_decode),
):
    register(Seam(name=_name, target=_target, build=_build,
                  why="tell the pooled allocator whose KV slots one batch allocation takes, so each "
                      "request stays in its own expert pages",
                  applies=lambda ctx: _on(ctx) and affinity.enabled()))

#: ``SGLANG_RIMURU_EXPERTS_ON_HOST=0``: SGLang makes the routed experts on the device
#: and the runtime copies them out after loading (the load peak holds every expert)
EXPERTS_ON_HOST_ENV = "SGLANG_RIMURU_EXPERTS_ON_HOST"


def _experts_on_host(ctx: ProcessContext) -> bool:
    return _on(ctx) and os.environ.get(EXPERTS_ON_HOST_ENV, "1") != "0"


for _name, _target, _build in (
    ("experts.host_load", f"{_MODEL_RUNNER}.load_model", host_experts.wrap_load_model),
    ("experts.host_weights", "sglang.srt.layers.quantization.unquant:UnquantizedFusedMoEMethod.create_weights",
     host_experts.wrap_create_weights),
    ("experts.dummy_weights", "sglang.srt.model_loader.loader:initialize_dummy_weights",
     host_experts.wrap_dummy_weights),
):
    register(Seam(name=_name, target=_target, build=_build,
                  why="routed experts are made and loaded in host memory, never on the GPU, so the load "
                      "peak fits a card that cannot hold them (dummy weights drawn as on the device)",
                  applies=_experts_on_host))
