"""--rimuru-mix-decodes offloaded: when a prefill pass carries the running decodes (the
seam sets SGLang's ``is_mixed_chunk`` each round; on a GPU only: tests/server/test_elastic.py
checks that a CPU server never mixes, the H200 runs serve it)."""

import pytest

from rimuru_patches.mixed_decodes import mix_now
from sglang_rimuru.config import RimuruConfig


def test_mixing_follows_the_offloaded_experts():
    # SGLang's own --enable-mixed-chunk always wins
    assert mix_now(True, chunked=True, deterministic=False, all_resident=True, on_gpu=False)
    assert mix_now(True, chunked=True, deterministic=True, all_resident=False, on_gpu=True)
    # otherwise only on a GPU while some expert is offloaded, with chunked prefill, not deterministic
    assert mix_now(False, chunked=True, deterministic=False, all_resident=False, on_gpu=True)
    assert not mix_now(False, chunked=True, deterministic=False, all_resident=False, on_gpu=False)
    assert not mix_now(False, chunked=True, deterministic=False, all_resident=True, on_gpu=True)
    assert not mix_now(False, chunked=False, deterministic=False, all_resident=False, on_gpu=True)
    assert not mix_now(False, chunked=True, deterministic=True, all_resident=False, on_gpu=True)


def test_the_flag_needs_a_pool_mode_and_a_known_choice():
    assert RimuruConfig(mode="elastic").mix_decodes == "offloaded"
    RimuruConfig(mode="static", mix_decodes="sglang")
    with pytest.raises(ValueError, match="--rimuru-mix-decodes need --rimuru-mode static or elastic"):
        RimuruConfig(mode="off", mix_decodes="sglang")
    with pytest.raises(ValueError, match="--rimuru-mix-decodes: unknown choice 'always'"):
        RimuruConfig(mode="elastic", mix_decodes="always")
