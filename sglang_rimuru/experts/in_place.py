"""Which passes read offloaded experts in place: the tokens each one expects.

The paged kernel reads an offloaded expert in place from pinned host memory
once per block of the tokens routed to it; the copy path (``prefetch_next`` +
``prepare_layer``) moves it across PCIe once, but reads routing on the host, so
no CUDA graph can hold it. In place is the better way while each offloaded
expert gets about one block: ``--rimuru-zero-copy-max-tokens`` = N says where
that ends under uniform routing (a pass of N tokens gives each expert
``N * top_k / E`` of them, 8.5 at N = 128 on Qwen1.5-MoE-A2.7B). So a pass of
``T`` tokens reads in place while its hottest offloaded expert expects no more::

    T * p_max <= N * top_k / E          p_max: largest per-token probability out

Under uniform routing that is ``T <= N``, as before. Under skewed routing the
cold experts that go out first expect far fewer tokens, so longer passes (and
SGLang's captured prefill graphs, which read in place) keep the graph path:
with every offloaded expert at a tenth of the uniform probability, passes of
up to 10 N tokens. An expert that was never routed (p = 0) never forces a
copy. The probabilities are the ranking's (``ExpertRanking.token_probabilities``),
so the rule is as good as the ranking: with the default one (uniform) it is
the plain token count.
"""

from __future__ import annotations

__all__ = ["reads_in_place", "replay_max_probability"]


def _per_expert_tokens(max_tokens: int, top_k: int, num_experts: int) -> float:
    return max_tokens * top_k / num_experts


def reads_in_place(num_tokens: int, p_max: float, max_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a pass of ``num_tokens`` whose hottest offloaded expert a token picks
    with probability ``p_max`` should read offloaded experts in place."""
    if p_max <= 0.0:
        return True
    # the small relative slack keeps T = N exact under uniform routing despite rounding
    return num_tokens * p_max <= _per_expert_tokens(max_tokens, top_k, num_experts) * (1 + 1e-9)


def replay_max_probability(pass_tokens: int, max_tokens: int, top_k: int, num_experts: int) -> float:
    """The largest per-token probability an offloaded expert may have for a pass of
    ``pass_tokens`` (the largest prefill pass) to still read in place:
    ``CostModel.replay_max_p``."""
    if pass_tokens <= 0:
        raise ValueError(f"pass_tokens must be > 0, got {pass_tokens!r}")
    return _per_expert_tokens(max_tokens, top_k, num_experts) / pass_tokens
