"""Benchmarks only: skewed and independent expert routing for dummy-weight models (issue 12).

Random (dummy) weights route almost uniformly: every expert is about as popular
as every other, so no expert is cheap to offload. Real MoE routers are skewed.
With ``RIMURU_BENCH_ROUTER_SKEW=s`` (s > 0) on the PYTHONPATH of a server (run_one.py
``--skew s`` does both), every MoE layer's router logits are standardized per token
(mean 0, standard deviation 1 over the experts) and get a fixed bias before SGLang
picks the top-k::

    logits'[t][e] = (logits[t][e] - mean_t) / std_t - s * log(1 + rank_layer(e))

with rank a seeded permutation per layer. Standardizing makes the skew independent
of the logits' scale: dummy weights give router logits of ~1e-5, against which any
bias is absolute (unstandardized, up to bfb4cc7, s = 2 routed every Qwen1.5-shape
token to the same 4 experts of 60 in every layer, measured on the H200). With the
standardized logits close to independent N(0, 1) draws, the per-token probability of
the expert of rank r (top-4 of 60, 200,000 simulated tokens) is:

    s     rank 0  rank 4  rank 9  rank 19  rank 39  rank 59   experts < 0.00417  top-10 share
    0.5   0.46    0.18    0.105   0.056    0.027    0.017      0                  0.52
    1.0   0.85    0.27    0.096   0.024    0.0043   0.0013     20                 0.82
    1.5   0.97    0.31    0.062   0.0056   0.0002   0.00004    39                 0.94

(0.00417 is the probability above which an offloaded Qwen1.5 expert turns a
2,048-token prefill eager, see ``sglang_rimuru/experts/in_place.py``.) The measured
popularity comes from ``python -m sglang_rimuru.rank`` against the skewed server and
is what the benchmark reports, not this table. The bias is a fixed tensor added on
the device, so CUDA graphs capture it.

``RIMURU_BENCH_ROUTER_NOISE=n`` (0 < n <= 1; run_one.py ``--router-noise n``) mixes each
token's standardized logits with fresh N(0, 1) draws every forward, ``sqrt(1 - n^2) z + n eps``,
before the bias. Why: on SGLang's dummy weights a token's routing is a function of the token
alone, the same in every layer, and requests whose prompts end in one token decode one token
sequence, so a batch shares routings that real weights, which continue a request from its whole
context, would not (``bench/serving/dummy_routing.py``, bench/RESULTS.md thirty-fifth
session). With n = 1 every token routes by its own draws, as the table above assumes:
independent routings, the same popularity law. The draws come from torch's default generator
on the logits' device, which CUDA graphs capture graph-safe (each replay draws anew). At
TP > 1 each rank draws from its own generator, seeded alike by SGLang (``set_random_seed`` of
the one ``--random-seed``) and drawn alike (the same forwards on the same batch), as SGLang's
own sampling relies on; ``RIMURU_BENCH_ROUTER_TALLY=DIR`` (eager forwards only: it reads each
draw's sum back) has every process append its draws' sums to ``DIR/PID.txt``, which the TP=2
CPU test compares rank against rank.

Not part of the product: it changes the model. It installs itself through an
import hook when SGLang imports ``sglang.srt.layers.moe.topk`` (after the
project's own bootstrap), in every process that imports that module.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import math
import os
import sys

TARGET = "sglang.srt.layers.moe.topk"
SKEW = float(os.environ.get("RIMURU_BENCH_ROUTER_SKEW", "0") or 0)
NOISE = float(os.environ.get("RIMURU_BENCH_ROUTER_NOISE", "0") or 0)
TALLY = os.environ.get("RIMURU_BENCH_ROUTER_TALLY", "")
if not 0 <= NOISE <= 1:
    raise SystemExit(f"RIMURU_BENCH_ROUTER_NOISE={NOISE}: the share of fresh draws in each token's logits, 0 to 1")


def _bias(layer_id: int, num_experts: int, device, dtype):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (layer_id + 1))
    rank = torch.empty(num_experts, dtype=torch.long)
    rank[torch.randperm(num_experts, generator=g)] = torch.arange(num_experts)
    return (-SKEW * torch.log1p(rank.double())).to(device=device, dtype=dtype)


def skewed_logits(router_logits, bias, noise: float = 0.0, tally=None):
    """The router logits standardized per token (over the experts), mixed with ``noise`` of
    fresh N(0, 1) draws, plus ``bias``, in the logits' dtype. Elementwise, reductions and
    the default generator's draws only: graph-capturable. ``tally``: a callable given the
    draws (RIMURU_BENCH_ROUTER_TALLY; not under graph capture)."""
    import torch

    z = router_logits.float()
    z = (z - z.mean(dim=-1, keepdim=True)) / (z.std(dim=-1, keepdim=True) + 1e-12)
    if noise > 0:
        eps = torch.randn_like(z)
        if tally is not None:
            tally(eps)
        z = math.sqrt(1.0 - noise * noise) * z + noise * eps
    return (z + bias.float()).to(router_logits.dtype)


def _tally_to(folder: str):
    """Appends each forward's draws (layer, shape, sum) to ``folder/PID.txt``."""
    path = os.path.join(folder, f"{os.getpid()}.txt")

    def tally(layer: int, eps) -> None:
        with open(path, "a") as f:
            f.write(f"{layer} {tuple(eps.shape)} {float(eps.double().sum()):.9e}\n")
    return tally


def _patch(module) -> None:
    topk_cls = module.TopK
    original = topk_cls.forward

    def forward(self, hidden_states, router_logits, *args, **kwargs):
        bias = getattr(self, "_rimuru_bench_bias", None)
        if bias is None or bias.device != router_logits.device or bias.dtype != router_logits.dtype:
            layer = self.layer_id if self.layer_id is not None else 0
            bias = _bias(layer, router_logits.shape[-1], router_logits.device, router_logits.dtype)
            self._rimuru_bench_bias = bias
        tally = functools.partial(_TALLY, self.layer_id or 0) if _TALLY else None
        return original(self, hidden_states, skewed_logits(router_logits, bias, NOISE, tally), *args, **kwargs)

    topk_cls.forward = forward
    print(f"[bench] router skew {SKEW}, noise {NOISE} installed (pid {os.getpid()}): standardized logits"
          + (f", {NOISE} of fresh draws" if NOISE else "") + ", bias -s*log(1+rank) per layer",
          file=sys.stderr, flush=True)


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module once
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        sys.meta_path.remove(self)
        _patch(module)


_TALLY = _tally_to(TALLY) if TALLY else None
if (SKEW > 0 and math.isfinite(SKEW)) or NOISE > 0:
    sys.meta_path.insert(0, _Hook())
# the device machine's own quirks (transformers registration) still apply there
_device_site = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "device", "site", "sitecustomize.py")
if os.path.exists(_device_site) and os.environ.get("RIMURU_BENCH_DEVICE_SITE") == "1":
    exec(compile(open(_device_site).read(), _device_site, "exec"))
