"""The elastic round's count of KV pages only the radix cache holds, on SGLang's own caches.

SGLang 0.5.17's hybrid caches (SWA, Mamba) raise ``NotImplementedError`` from
``evictable_size`` and count full-attention tokens with ``full_evictable_size``;
the plain radix cache has only ``evictable_size`` (its ``full_evictable_size`` is
the base class's 0). The caches are SGLang's classes with just the counters the
two methods read set (no pools are built).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rimuru_patches import elastic


def _bare(cls, **attrs):
    obj = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def test_plain_radix_cache():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    cache = _bare(RadixCache, evictable_size_=33)
    assert elastic._evictable_tokens(cache) == 33
    assert elastic._cached_pages(SimpleNamespace(tree_cache=cache, page_size=4)) == 8


@pytest.mark.parametrize("module, cls", [("swa_radix_cache", "SWARadixCache"),
                                         ("mamba_radix_cache", "MambaRadixCache")])
def test_hybrid_caches_count_full_attention_tokens(module, cls):
    import importlib

    klass = getattr(importlib.import_module(f"sglang.srt.mem_cache.{module}"), cls)
    cache = _bare(klass, full_evictable_size_=40)
    with pytest.raises(NotImplementedError):
        cache.evictable_size()
    assert elastic._evictable_tokens(cache) == 40
    assert elastic._cached_pages(SimpleNamespace(tree_cache=cache, page_size=1)) == 40
