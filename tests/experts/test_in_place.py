"""The rule for reading offloaded experts in place: tokens each one expects
(``sglang_rimuru/experts/in_place.py``)."""

from __future__ import annotations

import pytest

from sglang_rimuru.experts import reads_in_place, replay_max_probability


def test_uniform_routing_is_the_token_count():
    # top-2 of 8: p = 1/4 each, N = 128 tokens give each expert 32
    assert reads_in_place(128, 2 / 8, 128, 2, 8) and not reads_in_place(129, 2 / 8, 128, 2, 8)
    # Qwen1.5-MoE-A2.7B: top-4 of 60 (a p that does not divide evenly)
    assert reads_in_place(128, 4 / 60, 128, 4, 60) and not reads_in_place(129, 4 / 60, 128, 4, 60)


def test_cold_experts_stretch_the_pass_and_never_routed_ones_never_stop_it():
    # a tenth of the uniform probability: ten times the tokens
    assert reads_in_place(1280, 4 / 600, 128, 4, 60) and not reads_in_place(1281, 4 / 600, 128, 4, 60)
    assert reads_in_place(10 ** 9, 0.0, 128, 4, 60)


def test_replay_max_probability():
    # the largest prefill pass (2,048 tokens) replays while every offloaded expert is under
    # 128 * 4 / 60 / 2048 per token (a sixteenth of uniform)
    p = replay_max_probability(2048, 128, 4, 60)
    assert p == pytest.approx(4 / 60 / 16)
    assert reads_in_place(2048, p, 128, 4, 60) and not reads_in_place(2048, p * 1.001, 128, 4, 60)
    with pytest.raises(ValueError, match="pass_tokens"):
        replay_max_probability(0, 128, 4, 60)
