"""The tiny random MoE models: config, checkpoint layout, HF loading, determinism, tokenizer."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from sglang_rimuru.models import get_spec, write_model
from sglang_rimuru.models.weights import split_fused_experts

from .conftest import TINY

TOKENIZER_TEXTS = [
    "",
    "hello world",
    "héllo wörld — ünïcödé",
    "e\u0301 (decomposed) vs \u00e9",
    "中文测试，你好世界",
    "emoji 🎉 👨‍👩‍👧 family",
    "  leading, trailing  \t\n\r\n  ",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", TINY)
def test_config_has_the_specified_sizes(model_paths, name):
    cfg = _config(model_paths[name])
    assert cfg["architectures"] == [get_spec(name).architecture]
    assert cfg["dtype"] == "bfloat16"
    expected = dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        bos_token_id=256,
        eos_token_id=258,
    )
    if name == "tiny-qwen2-moe":  # head_dim = hidden / heads must be 64 (SGLang CUDA rope)
        expected.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
    elif "-ratio" in name:  # a real model's KV-token / expert-page byte ratio (specs.py)
        expected.update({k: get_spec(name).config[k] for k in (
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "moe_intermediate_size")})
    assert {k: cfg[k] for k in expected} == expected
    if get_spec(name).architecture == "Qwen3MoeForCausalLM":
        assert (cfg["model_type"], cfg["head_dim"], cfg["norm_topk_prob"]) == ("qwen3_moe", 64, True)
    else:
        assert (cfg["model_type"], cfg["shared_expert_intermediate_size"]) == ("qwen2_moe", 64)
    gen = json.loads((model_paths[name] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, [258, 256], 256)
    assert "temperature" not in gen and "top_p" not in gen


@pytest.mark.parametrize("name", TINY)
def test_checkpoint_has_per_expert_keys(model_paths, name):
    path = model_paths[name]
    H = json.loads((path / "config.json").read_text())["hidden_size"]
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert not [k for k in shapes if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    spec = get_spec(name).config
    I, layers = spec["moe_intermediate_size"], spec["num_hidden_layers"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp"
        assert shapes[f"{prefix}.gate.weight"] == (8, H)
        for e in range(8):
            assert shapes[f"{prefix}.experts.{e}.gate_proj.weight"] == (I, H)
            assert shapes[f"{prefix}.experts.{e}.up_proj.weight"] == (I, H)
            assert shapes[f"{prefix}.experts.{e}.down_proj.weight"] == (H, I)
        assert f"{prefix}.experts.8.gate_proj.weight" not in shapes
        if get_spec(name).architecture == "Qwen2MoeForCausalLM":
            assert shapes[f"{prefix}.shared_expert.gate_proj.weight"] == (64, H)
            assert shapes[f"{prefix}.shared_expert.down_proj.weight"] == (H, 64)
            assert shapes[f"{prefix}.shared_expert_gate.weight"] == (1, H)
            assert shapes[f"model.layers.{layer}.self_attn.q_proj.bias"] == (H,)
        else:
            assert shapes[f"model.layers.{layer}.self_attn.q_norm.weight"] == (64,)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (320, H)
    n_expert_keys = sum(".experts." in k for k in shapes)
    assert n_expert_keys == layers * 8 * 3


@pytest.mark.parametrize("name", TINY)
def test_loads_in_transformers_with_finite_logits_and_deterministic_greedy(model_paths, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = model_paths[name]
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.dtype == torch.bfloat16
    assert type(model).__name__ == get_spec(name).architecture

    # The per-expert tensors reached the right experts (gate rows before up rows).
    saved = load_file(str(path / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    gate_up = torch.cat([saved["model.layers.1.mlp.experts.5.gate_proj.weight"], saved["model.layers.1.mlp.experts.5.up_proj.weight"]])
    assert torch.equal(experts.gate_up_proj[5], gate_up)
    assert torch.equal(experts.down_proj[3], saved["model.layers.1.mlp.experts.3.down_proj.weight"])

    ids = torch.tensor([list(b"The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert logits.shape == (1, ids.shape[1], 320)
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 10  # sane scale, not collapsed or exploding

    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=256)
    first = model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()
    second = model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist()
    assert first == second
    assert 1 <= len(first) <= 6


@pytest.mark.parametrize("name", TINY)
def test_same_seed_gives_identical_bytes(model_paths, tmp_path, name):
    again = write_model(name, tmp_path / "again", seed=0)
    files = sorted(p.name for p in model_paths[name].iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for f in files:
        assert (model_paths[name] / f).read_bytes() == (again / f).read_bytes(), f

    other = write_model(name, tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    with safe_open(str(other / "model.safetensors"), "pt") as a, safe_open(str(again / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())


@pytest.mark.parametrize("name", TINY)
def test_byte_tokenizer_round_trips_and_has_chat_template(model_paths, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_paths[name]))
    assert len(tok) == 320
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 258, "<|endoftext|>", 256)
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_60|>"]) == [256, 257, 258, 319]

    rng = random.Random(0)
    texts = TOKENIZER_TEXTS + ["".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(40)).encode("utf-8", "ignore").decode("utf-8", "ignore") for _ in range(20)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        if "<|" not in text:
            assert ids == list(text.encode("utf-8")), text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [258]

    config = json.loads((model_paths[name] / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in config["chat_template"]
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_split_fused_experts_converts_transformers_fused_layout():
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # [E, 2I, H], I = 2
    down = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # [E, H, I]
    out = split_fused_experts(
        {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down, "x": down}
    )
    assert sorted(out) == sorted(
        ["x"] + [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up", "down")]
    )
    assert torch.equal(out["model.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :2])
    assert torch.equal(out["model.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, 2:])
    assert torch.equal(out["model.layers.0.mlp.experts.0.down_proj.weight"], down[0])
