"""bench/serving/dummy_routing.py: its model of SGLang's dummy weights, and the reads it counts.

The premise (same-size parameters hold the same values under ``--load-format dummy``) is
checked against SGLang's own ``initialize_dummy_weights``, so a change there fails here.
"""

import sys
import textwrap
from pathlib import Path

import torch

from tests.conftest import warm_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "serving"))
try:
    import dummy_routing
finally:
    sys.path.pop(0)


def test_sglangs_dummy_init_gives_same_size_parameters_the_same_values():
    """In a child (SGLang is imported after the project's CPU bootstrap, as in every test)."""
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        bootstrap_process(ProcessContext(device="cpu", tp_size=1))
        from sglang.srt.model_loader.weight_utils import initialize_dummy_weights
        sys.path.insert(0, {str(ROOT / "bench" / "serving")!r})
        from dummy_routing import dummy_values
        m = torch.nn.Module()
        m.embed = torch.nn.Embedding(50, 16)
        m.lm_head = torch.nn.Linear(16, 50, bias=False)
        m.norm = torch.nn.Parameter(torch.ones(16))
        m.router0 = torch.nn.Linear(16, 8, bias=False)
        m.router1 = torch.nn.Linear(16, 8, bias=False)
        initialize_dummy_weights(m)
        print(torch.equal(m.embed.weight.flatten(), dummy_values(800)),
              torch.equal(m.lm_head.weight, m.embed.weight),  # the LM head is the embedding
              torch.equal(m.router0.weight, m.router1.weight),  # every layer routes alike
              torch.equal(m.norm.detach(), dummy_values(16)))
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True True True True"


def test_requests_ending_in_one_token_decode_and_route_alike():
    model = dummy_routing.DummyDecode(vocab=64, hidden=32, num_experts=8, top_k=2)
    first = torch.tensor([5, 9, 5, 5, 9, 12])
    tokens = first
    for _ in range(4):
        tokens = model.step(tokens)
        ids = model.route(tokens)
        assert tokens[0] == tokens[2] == tokens[3] and tokens[1] == tokens[4]
        assert torch.equal(ids[0], ids[2]) and torch.equal(ids[0], ids[3]) and torch.equal(ids[1], ids[4])
    rows = dummy_routing.replay(model, first, 3, out_experts=2)
    assert len(rows) == 3 and all(r["distinct_tokens"] <= 3 for r in rows)
    assert model.out_set(0, 2) == [6, 7]  # the dummy routers: the highest ids, as the 24 GB trace


def test_skewed_routers_route_each_layer_by_its_bias_and_offload_its_coldest():
    """--skew: the benchmark's skewed routers (bench/serving/skew), so layers differ and each
    layer's offloaded experts are its coldest; one token still routes alike in every request."""
    model = dummy_routing.DummyDecode(vocab=64, hidden=32, num_experts=8, top_k=2, skew=2.0, layers=2)
    assert model.layers == [0, 1]
    for layer in (0, 1):
        bias = model.bias(layer)
        assert model.out_set(layer, 3) == sorted(torch.argsort(bias)[:3].tolist())
    assert model.out_set(0, 3) != model.out_set(1, 3)
    tokens = torch.tensor([7, 7, 30])
    ids = model.route(tokens, 1)
    assert torch.equal(ids[0], ids[1])
    row = dummy_routing.row(model, tokens, 3)
    assert row["distinct_tokens"] == 2 and row["out_hit"] <= 3


def test_reads_count_one_per_block_of_an_offloaded_experts_tokens():
    # expert 3: 20 tokens, expert 2: 5, expert 1: 0; only 2 and 3 are offloaded
    ids = torch.tensor([[3, 0]] * 20 + [[2, 0]] * 5)
    assert dummy_routing.host_reads(ids, [2, 3], 16) == 1 + 2
    assert dummy_routing.host_reads(ids, [2, 3], 64) == 1 + 1
    assert dummy_routing.host_reads(ids, [1], 16) == 0
    row = dummy_routing.row(dummy_routing.DummyDecode(vocab=64, hidden=32, num_experts=8, top_k=2),
                            torch.tensor([5, 5, 5, 9]), out_experts=8)
    assert row["distinct_tokens"] == 2 and row["max_tokens_on_an_expert"] >= 3
    assert row["reads_bm16"] == row["reads_bm64"] == row["out_hit"] <= 4  # two routings: at most 4 experts
