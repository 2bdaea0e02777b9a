"""Random bf16 weights for the tiny models, keyed by checkpoint tensor name.

Layout written (one `model.safetensors`, metadata {"format": "pt"}), the
per-expert keys SGLang's `FusedMoE.make_expert_params_mapping` expects:

    model.embed_tokens.weight                           [V, H]
    model.layers.{l}.self_attn.{q,k,v,o}_proj.weight    (+ q/k/v bias for Qwen2-MoE,
                                                          q_norm/k_norm for Qwen3-MoE)
    model.layers.{l}.mlp.gate.weight                    [E, H]  router
    model.layers.{l}.mlp.experts.{e}.gate_proj.weight   [I, H]  W1
    model.layers.{l}.mlp.experts.{e}.up_proj.weight     [I, H]  W3
    model.layers.{l}.mlp.experts.{e}.down_proj.weight   [H, I]  W2
    model.layers.{l}.mlp.shared_expert.*, mlp.shared_expert_gate.weight  (Qwen2-MoE)
    model.layers.{l}.{input,post_attention}_layernorm.weight, model.norm.weight
    lm_head.weight                                      [V, H]

Values: every tensor is drawn from its own generator seeded by (seed, key), so
a tensor's bytes depend only on the seed, its key and its shape — not on the
order or fusion of transformers' modules. Scales keep every residual branch
O(1) so that attention, routing and each expert visibly change the output:
matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 + N(0, 0.1^2),
biases N(0, 0.1^2), lm_head N(0, 4/H) (logit std ~2).
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def split_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert keys from transformers' fused `experts.gate_up_proj [E, 2I, H]` /
    `experts.down_proj [E, H, I]` (gate rows first); other keys pass through.

    transformers 5.12.1 already saves per-expert keys; this guards a release that does not.
    """
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _FUSED_EXPERTS.match(key)
        if m is None:
            out[key] = t
            continue
        prefix = m["prefix"]
        for e in range(t.shape[0]):
            if m["kind"] == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def _std_and_mean(key: str, shape: torch.Size, hidden: int) -> tuple[float, float]:
    if key.endswith("norm.weight"):
        return 0.1, 1.0
    if key.endswith(".bias"):
        return 0.1, 0.0
    if key == "model.embed_tokens.weight":
        return 1.0, 0.0
    if key == "lm_head.weight":
        return 2.0 / hidden**0.5, 0.0
    return 1.0 / shape[-1] ** 0.5, 0.0


def random_tensor(key: str, shape: torch.Size, seed: int, hidden: int) -> torch.Tensor:
    """The deterministic bf16 value of checkpoint tensor `key`."""
    g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    std, mean = _std_and_mean(key, shape, hidden)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float32) * std + mean).to(torch.bfloat16)


def write_tiny_weights(out: Path, config, seed: int) -> list[str]:
    """Build the model with `from_config`, `save_pretrained` it into `out`, then rewrite
    every tensor with `random_tensor` into a single per-expert `model.safetensors`.

    Also leaves config.json and generation_config.json from `save_pretrained`
    (the caller overwrites generation_config.json). Returns the sorted tensor keys.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    del model

    shards = sorted(out.glob("*.safetensors"))
    saved: dict[str, torch.Tensor] = {}
    for shard in shards:
        saved.update(load_file(str(shard)))
        shard.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)

    tensors = split_fused_experts(saved)
    n_expert_keys = sum(1 for k in tensors if _PER_EXPERT.match(k))
    expected = 3 * config.num_experts * config.num_hidden_layers
    if n_expert_keys != expected:
        raise RuntimeError(f"found {n_expert_keys} per-expert tensors in the checkpoint, expected {expected}")
    hidden = config.hidden_size
    values = {k: random_tensor(k, t.shape, seed, hidden) for k, t in sorted(tensors.items())}
    save_file(values, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    os.chmod(out / WEIGHTS_FILE, 0o644)  # safetensors creates it 0600
    return sorted(values)
