"""The server tests' tie-tolerant greedy comparison (``tests.conftest.assert_greedy_equal_up_to_ties``)."""

from __future__ import annotations

import pytest

from tests.conftest import assert_greedy_equal_up_to_ties


def reference(ids: list[int], top2: list[tuple[float, int, float, int]]) -> dict:
    """A ``/generate`` answer with top-2 log-probabilities, as SGLang writes it."""
    tops = [[(lp0, id0, None), (lp1, id1, None)] for lp0, id0, lp1, id1 in top2]
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": tops}}


REF = reference([5, 7, 9], [(-0.5, 5, -2.0, 6), (-1.0, 7, -1.03125, 8), (-0.2, 9, -3.0, 1)])


def test_equal_ids_pass():
    assert_greedy_equal_up_to_ties([5, 7, 9], REF)


def test_parting_at_a_one_step_tie_to_the_second_token_passes_whatever_follows():
    assert_greedy_equal_up_to_ties([5, 8, 4], REF)


def test_parting_where_the_best_two_are_far_apart_fails():
    with pytest.raises(AssertionError, match="part at step 0"):
        assert_greedy_equal_up_to_ties([6, 7, 9], REF)


def test_parting_at_a_tie_to_a_third_token_fails():
    with pytest.raises(AssertionError, match="part at step 1"):
        assert_greedy_equal_up_to_ties([5, 3, 9], REF)


def test_lengths_must_match():
    with pytest.raises(AssertionError):
        assert_greedy_equal_up_to_ties([5, 7], REF)
