"""Routed experts are made in host memory, never on the GPU (pool modes).

SGLang's ``FusedMoE`` allocates every routed expert on the GPU when the model
is built, and the pool used to move them to host memory only after loading.
On a card that cannot hold the weights (the case the pool is for) that load
peak is what fails: Qwen1.5-MoE-A2.7B is 26.6 GiB with its routed experts
(23.2 GiB of it), more than a 24 GiB card; Qwen3-30B-A3B's experts alone are
54 GiB. So in pool modes:

* ``experts.host_weights`` (``UnquantizedFusedMoEMethod.create_weights``):
  while the main model is built (``experts.host_load``, around
  ``ModelRunner.load_model``; a draft model keeps SGLang's own placement),
  each MoE layer's ``w13_weight`` / ``w2_weight`` are views of one host tensor
  ``[E, 3, inter*hidden]`` in :class:`HostExpertStore`'s layout (W1, W3, W2
  of an expert adjacent; on CUDA made by ``pinnable_empty`` and page-locked in
  place, exactly that size, only after the pool is sized: the GPU's map of
  23 GiB of pinned pages is GPU memory the pool would otherwise lose). SGLang's
  weight loaders write
  through the views; ``RimuruRuntime.build`` adopts the tensors (:func:`take`),
  no copy. SGLang's own ``create_weights`` still runs, on the meta device (no
  memory), so every attribute it sets on the parameters is kept.
* ``experts.dummy_weights`` (``initialize_dummy_weights`` as the model loader
  calls it): ``--load-format dummy`` draws each parameter from a generator on
  the parameter's own device, seeded per parameter. A host parameter would
  get the CPU generator's numbers, a different model from mode off's. The
  host experts are drawn on the model's device instead, as mode off draws
  them (same seed, same contiguous shape), one parameter at a time (a
  transient of one layer's ``w13``), and copied to host.

What remains on the GPU at load: attention, shared experts, embeddings; SGLang's
``device_loading_context`` still moves one MoE layer at a time to the GPU and
back for ``process_weights_after_loading`` (a no-op for unquantized MoE on CUDA).
Layers this does not fit (biases, an ungated MoE, a triton-kernels layout, an
unmanaged quant method) keep SGLang's allocation, and the runtime copies them
as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from sglang_rimuru.experts.host_store import HostExpertStore, pinnable_empty

logger = logging.getLogger(__name__)

#: True while the main model (not a draft model) is being built and loaded
_PLACING = False
#: layer id -> the host tensor its FusedMoE parameters are views of
_HOSTED: dict[int, torch.Tensor] = {}
#: marks a parameter that is a view of a hosted tensor
HOSTED_ATTR = "_rimuru_hosted"


def take() -> dict[int, torch.Tensor]:
    """The hosted layers' tensors (once; the runtime owns them after)."""
    out = dict(_HOSTED)
    _HOSTED.clear()
    return out


def _rehome(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    """Replace parameter ``name`` (on the meta device) by one over ``data``, keeping its attributes."""
    old = layer._parameters[name]
    new = torch.nn.Parameter(data, requires_grad=False)
    new.__dict__.update(old.__dict__)  # weight_loader and the other attributes SGLang set
    setattr(new, HOSTED_ATTR, True)
    layer.register_parameter(name, new)


def wrap_load_model(orig, ctx):
    def load_model(self, *args, **kwargs):
        if getattr(self, "is_draft_worker", False):
            return orig(self, *args, **kwargs)
        with placing():
            return orig(self, *args, **kwargs)

    return load_model


def wrap_create_weights(orig, ctx):
    pin = not ctx.on_cpu and torch.cuda.is_available()

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       with_bias=False, **extra):
        layer_id = getattr(layer, "layer_id", None)
        fits = (_PLACING and layer_id is not None and not with_bias and not getattr(self, "use_triton_kernels", False)
                and getattr(getattr(layer, "moe_runner_config", None), "is_gated", False))
        if not fits:
            return orig(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                        with_bias=with_bias, **extra)
        with torch.device("meta"):
            orig(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                 with_bias=with_bias, **extra)
        inter = intermediate_size_per_partition
        size = (num_experts, 3, inter * hidden_size)
        # page-locked later, in place, once the pool is sized (RimuruRuntime.build)
        host = pinnable_empty(size, params_dtype) if pin else torch.empty(size, dtype=params_dtype, device="cpu")
        w13, w2 = HostExpertStore.fused_views(host, inter, hidden_size)
        _rehome(layer, "w13_weight", w13)
        _rehome(layer, "w2_weight", w2)
        _HOSTED[layer_id] = host

    return create_weights


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        if not getattr(p, HOSTED_ATTR, False):
            return p.device
    return torch.device("cpu")


def wrap_dummy_weights(orig, ctx):
    signature = inspect.signature(orig)

    def initialize_dummy_weights(model, *args, **kwargs):
        hosted = [p for p in model.parameters() if getattr(p, HOSTED_ATTR, False)]
        if not hosted:
            return orig(model, *args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        bound.apply_defaults()
        low, high, seed = bound.arguments["low"], bound.arguments["high"], bound.arguments["seed"]
        # SGLang draws the rest; the hosted ones are out of its sight meanwhile
        # (a parameter of no elements draws nothing).
        kept = [(p, p.data) for p in hosted]
        for p in hosted:
            p.data = torch.empty(0, dtype=p.dtype)
        try:
            orig(model, *args, **kwargs)
        finally:
            for p, data in kept:
                p.data = data
        device = _model_device(model)
        for p in hosted:
            draw = torch.empty(p.shape, dtype=p.dtype, device=device)
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            draw.uniform_(low, high, generator=generator)
            for e in range(p.shape[0]):  # each expert's rows are contiguous in host memory: plain copies
                p.data[e].copy_(draw[e])
            del draw
        if device.type == "cuda":
            torch.cuda.empty_cache()

    return initialize_dummy_weights


@contextlib.contextmanager
def placing():
    """Place experts on the host inside this block (the main model's load; tests build
    layers without a ModelRunner)."""
    global _PLACING
    _PLACING = True
    try:
        yield
    finally:
        _PLACING = False
