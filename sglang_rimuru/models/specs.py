"""The catalogue of models this package can write, and their shape arithmetic.

A `ModelSpec` is plain data; `build_config` turns it into a transformers
config. Two kinds of model:

- ``tiny``: random bf16 weights with a byte-level tokenizer, for CPU tests;
- ``shape``: the exact config of a real checkpoint, with the real Qwen BPE
  tokenizer and NO weight files, for GPU benchmarks under SGLang's
  ``--load-format dummy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, NamedTuple

BF16_BYTES = 2

# Byte tokenizer layout (tiny models): ids [0, 256) are the bytes themselves,
# then the three ChatML specials, then fillers up to the vocab size.
BYTE_ENDOFTEXT_ID = 256
BYTE_IM_START_ID = 257
BYTE_IM_END_ID = 258

# Qwen BPE specials (real-shape models), as in the Qwen1.5/2/3 repos.
QWEN_ENDOFTEXT_ID = 151643
QWEN_IM_START_ID = 151644
QWEN_IM_END_ID = 151645


class UnknownModelError(KeyError):
    """A model name that is not in `MODELS`; the message lists the known ones."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown model {self.name!r}; known models: {', '.join(MODELS)}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: Literal["tiny", "shape"]
    architecture: Literal["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
    description: str
    config: Mapping[str, Any]  # kwargs of the transformers config class
    tokenizer: Literal["bytes", "qwen"]
    eos_token: str  # the tokenizer's eos (config.json's eos_token_id)

    @property
    def has_weights(self) -> bool:
        return self.kind == "tiny"

    @property
    def bos_token_id(self) -> int:
        return BYTE_ENDOFTEXT_ID if self.tokenizer == "bytes" else QWEN_ENDOFTEXT_ID

    @property
    def eos_token_id(self) -> int:
        ids = _special_ids(self.tokenizer)
        return ids[self.eos_token]

    @property
    def generation_eos_token_ids(self) -> list[int]:
        """Stop ids for generation_config.json: `<|im_end|>` then `<|endoftext|>`, as Qwen ships."""
        ids = _special_ids(self.tokenizer)
        return [ids["<|im_end|>"], ids["<|endoftext|>"]]


def _special_ids(tokenizer: str) -> dict[str, int]:
    if tokenizer == "bytes":
        return {"<|endoftext|>": BYTE_ENDOFTEXT_ID, "<|im_start|>": BYTE_IM_START_ID, "<|im_end|>": BYTE_IM_END_ID}
    return {"<|endoftext|>": QWEN_ENDOFTEXT_ID, "<|im_start|>": QWEN_IM_START_ID, "<|im_end|>": QWEN_IM_END_ID}


_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,  # dense MLP size; unused (every layer is MoE)
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

# Qwen3-30B-A3B's expert page / KV token in a tiny model (the "-ratio" models: below)
_Q3_RATIO = ModelSpec(
    name="tiny-qwen3-moe-q3-ratio",
    kind="tiny",
    architecture="Qwen3MoeForCausalLM",
    description="random Qwen3-MoE, 2 layers, 8 experts top-2; expert page / KV token = 32, "
    "as Qwen3-30B-A3B (16,384 / 512 B)",
    config=dict(_TINY_COMMON, num_key_value_heads=1, head_dim=64, moe_intermediate_size=128, norm_topk_prob=True),
    tokenizer="bytes",
    eos_token="<|im_end|>",
)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="tiny-qwen3-moe",
            kind="tiny",
            architecture="Qwen3MoeForCausalLM",
            description="random Qwen3-MoE, 2 layers, 8 experts top-2, byte tokenizer",
            # head_dim 64: SGLang's CUDA rotary kernels take head sizes 64/128/256/512
            # only; others hit a fallback that breaks fused KV writes on GPU.
            config=dict(_TINY_COMMON, head_dim=64, norm_topk_prob=True),
            tokenizer="bytes",
            eos_token="<|im_end|>",
        ),
        ModelSpec(
            name="tiny-qwen2-moe",
            kind="tiny",
            architecture="Qwen2MoeForCausalLM",
            description="random Qwen2-MoE with a shared expert, 2 layers, 8 experts top-2, byte tokenizer",
            # Qwen2-MoE derives head_dim = hidden / heads: 128 / 2 = 64 (see above).
            config=dict(
                _TINY_COMMON,
                hidden_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                shared_expert_intermediate_size=64,
                norm_topk_prob=False,
            ),
            tokenizer="bytes",
            eos_token="<|im_end|>",
        ),
        # Tiny models with a real model's KV-token to expert-page byte ratio, so the
        # pool's id space, holes and split counts are those of the real shape
        # (a tiny model's own ratio, 4, hides them). head_dim 64 as above.
        ModelSpec(
            name="tiny-qwen2-moe-q15-ratio",
            kind="tiny",
            architecture="Qwen2MoeForCausalLM",
            description="random Qwen2-MoE, 6 layers, 8 experts top-2 + shared; expert page / KV token "
            "= 88/3, as Qwen1.5-MoE-A2.7B (45,056 / 1,536 B)",
            # moe_intermediate_size a multiple of 32: SGLang pads it to one on CPU.
            config=dict(
                _TINY_COMMON,
                num_hidden_layers=6,
                num_attention_heads=1,
                num_key_value_heads=1,
                moe_intermediate_size=352,
                shared_expert_intermediate_size=64,
                norm_topk_prob=False,
            ),
            tokenizer="bytes",
            eos_token="<|im_end|>",
        ),
        _Q3_RATIO,
        # twice the KV heads and expert width of tiny-qwen3-moe-q3-ratio, so that one TP=2
        # rank's shard has its bytes: the real model keeps its ratio at TP=2, the 1-head tiny
        # one would not (its KV head is replicated, its experts halved)
        dataclasses.replace(
            _Q3_RATIO,
            name="tiny-qwen3-moe-q3-ratio-tp2",
            description="random Qwen3-MoE, 2 layers, 8 experts top-2; at --tp-size 2 each rank's expert "
            "page / KV token = 32, as Qwen3-30B-A3B's at TP=2 (16,384 / 512 B; 1.5 MiB / 48 KiB)",
            config=dict(_Q3_RATIO.config, num_key_value_heads=2, moe_intermediate_size=256),
        ),
        ModelSpec(
            name="qwen1.5-moe-a2.7b",
            kind="shape",
            architecture="Qwen2MoeForCausalLM",
            description="Qwen1.5-MoE-A2.7B shape (24 layers, 60 experts top-4 + shared), no weights",
            config=dict(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                num_experts=60,
                num_experts_per_tok=4,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
                max_position_embeddings=8192,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                rms_norm_eps=1e-6,
                norm_topk_prob=False,
                tie_word_embeddings=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                max_window_layers=21,
            ),
            tokenizer="qwen",
            eos_token="<|endoftext|>",
        ),
        ModelSpec(
            name="qwen3-30b-a3b",
            kind="shape",
            architecture="Qwen3MoeForCausalLM",
            description="Qwen3-30B-A3B shape (48 layers, 128 experts top-8), no weights",
            config=dict(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                rms_norm_eps=1e-6,
                norm_topk_prob=True,
                tie_word_embeddings=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
            tokenizer="qwen",
            eos_token="<|im_end|>",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModelError(name) from None


def build_config(spec: ModelSpec):
    """The transformers config (bf16, Qwen special-token ids) for `spec`."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"Qwen3MoeForCausalLM": Qwen3MoeConfig, "Qwen2MoeForCausalLM": Qwen2MoeConfig}[spec.architecture]
    config = cls(
        **spec.config,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
        dtype="bfloat16",
    )
    config.architectures = [spec.architecture]
    return config


class MoeShape(NamedTuple):
    """Byte arithmetic of a config (bf16), per TP rank 1."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    expert_bytes: int  # one routed expert: W1 (gate) + W3 (up) + W2 (down)
    routed_expert_bytes: int  # all routed experts of all layers
    kv_bytes_per_token: int  # K and V of all layers


def _get(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, Mapping) else getattr(config, key)


def expert_bytes(config: Any, dtype_bytes: int = BF16_BYTES) -> int:
    """Bytes of one routed expert: 3 matrices of hidden x moe_intermediate."""
    return 3 * _get(config, "hidden_size") * _get(config, "moe_intermediate_size") * dtype_bytes


def moe_shape(config: Any, dtype_bytes: int = BF16_BYTES) -> MoeShape:
    """`MoeShape` of a transformers config, a config.json dict or a spec's kwargs."""
    layers = _get(config, "num_hidden_layers")
    experts = _get(config, "num_experts")
    heads = _get(config, "num_attention_heads")
    hidden = _get(config, "hidden_size")
    try:
        head_dim = _get(config, "head_dim") or hidden // heads
    except (KeyError, AttributeError):
        head_dim = hidden // heads
    one = expert_bytes(config, dtype_bytes)
    return MoeShape(
        num_layers=layers,
        num_experts=experts,
        top_k=_get(config, "num_experts_per_tok"),
        hidden_size=hidden,
        moe_intermediate_size=_get(config, "moe_intermediate_size"),
        expert_bytes=one,
        routed_expert_bytes=one * experts * layers,
        kv_bytes_per_token=2 * layers * _get(config, "num_key_value_heads") * head_dim * dtype_bytes,
    )
