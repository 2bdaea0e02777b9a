"""Locally generated MoE models for tests and benchmarks (no model hub).

    from sglang_rimuru.models import ensure_model, default_model_path
    path = default_model_path()                  # tiny Qwen3-MoE, generated on first use
    path = ensure_model("qwen3-30b-a3b")         # config + Qwen tokenizer, no weights

This package imports only the standard library, torch, transformers,
tokenizers and safetensors — never sglang. See README.md.
"""

from .specs import (
    MODELS,
    ModelSpec,
    MoeShape,
    UnknownModelError,
    build_config,
    expert_bytes,
    get_spec,
    moe_shape,
)
from .store import (
    DEFAULT_SEED,
    cache_root,
    default_model_path,
    ensure_model,
    is_current,
    models_dir,
    write_model,
)


def list_models() -> list[str]:
    return list(MODELS)


__all__ = [
    "DEFAULT_SEED",
    "MODELS",
    "ModelSpec",
    "MoeShape",
    "UnknownModelError",
    "build_config",
    "cache_root",
    "default_model_path",
    "ensure_model",
    "expert_bytes",
    "get_spec",
    "is_current",
    "list_models",
    "models_dir",
    "moe_shape",
    "write_model",
]
