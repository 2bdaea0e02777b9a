"""Pool sizing and the start-up checks, from config.json facts (no SGLang)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from sglang_rimuru.config import RimuruConfig
from sglang_rimuru.models import get_spec
from sglang_rimuru.plan import GIB, ModelFacts, PlanError, check_host_memory, plan_pool

TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 4096,
}
QWEN15 = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "max_position_embeddings": 8192,
}
STATIC = RimuruConfig(mode="static")


def test_facts_of_a_qwen3_moe_config():
    facts = ModelFacts.from_config(TINY)
    assert facts == ModelFacts(
        moe_layer_ids=(0, 1), num_experts=8, top_k=2, hidden=64, moe_inter=32,
        num_layers=2, num_kv_heads=2, head_dim=64, context_len=4096,
    )


def test_sparse_step_and_dense_layers():
    facts = ModelFacts.from_config({**TINY, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert facts.moe_layer_ids == (1, 5)


def test_dense_model_is_refused():
    dense = {k: v for k, v in TINY.items() if k not in ("num_experts", "moe_intermediate_size")}
    dense["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(PlanError, match=r"--rimuru-mode needs a Mixture-of-Experts model; x/config.json describes a dense model \(Qwen3ForCausalLM"):
        ModelFacts.from_config(dense, where="x/config.json")


def test_tiny_plan_from_max_total_tokens():
    plan = plan_pool(ModelFacts.from_config(TINY), STATIC, max_total_tokens=8192)
    # expert page: 32 x 64 bf16; token: 2 layers x K,V x 2 heads x 64 x 2 B
    assert (plan.expert_page_bytes, plan.token_bytes, plan.kv_page_bytes) == (4096, 1024, 1024)
    assert (plan.resident_per_layer, plan.offload_limit) == (4, 4)
    assert plan.fixed_expert_pages() == 1 + 2 * 4 * 3 + 2 * 4 * 3  # dummy slot, load buffers, residents
    assert plan.kv_pages_per_expert_page == 4
    assert plan.pool_bytes == (49 + 8192 // 4) * 4096


def test_qwen15_pages_do_not_divide():
    plan = plan_pool(ModelFacts.from_config(QWEN15), STATIC)
    assert plan.expert_page_bytes == 2048 * 1408 * 2 == 5_767_168
    assert plan.token_bytes == 24 * 2 * 16 * 128 * 2 == 196_608
    assert plan.kv_pages_per_expert_page == 28  # 29.33 fit on average; 28 in every page
    assert plan.pool_bytes is None  # sized on the GPU from SGLang's KV budget
    assert plan_pool(ModelFacts.from_config(QWEN15), STATIC, tp_size=2).expert_page_bytes == 2048 * 704 * 2


def rank_plan(model: str, tp_size: int):
    """One TP rank's static plan for a model of ``sglang_rimuru.models`` (its spec's config)."""
    return plan_pool(ModelFacts.from_config(get_spec(model).config), STATIC, tp_size=tp_size)


@pytest.mark.parametrize(
    "tiny, real, tp_size",
    [
        ("tiny-qwen2-moe-q15-ratio", "qwen1.5-moe-a2.7b", 1),
        ("tiny-qwen3-moe-q3-ratio", "qwen3-30b-a3b", 1),
        ("tiny-qwen3-moe-q3-ratio-tp2", "qwen3-30b-a3b", 2),
    ],
)
def test_ratio_models_have_a_real_models_page_geometry_on_each_rank(tiny, real, tp_size):
    """The tiny "-ratio" models stand in for a real shape in the server tests
    (tests/server/test_real_geometry.py): one TP rank's expert page over its KV token
    must be the real model's, so the pool's KV slots per page and its holes are too."""
    small, big = rank_plan(tiny, tp_size), rank_plan(real, tp_size)
    assert Fraction(small.expert_page_bytes, small.token_bytes) == Fraction(big.expert_page_bytes, big.token_bytes)
    assert small.kv_pages_per_expert_page == big.kv_pages_per_expert_page
    if tiny.endswith("-tp2"):  # one rank of Qwen3-30B-A3B: 1.5 MiB pages, 48 KiB tokens
        assert (big.expert_page_bytes, big.token_bytes) == (2048 * 384 * 2, 48 * 2 * 2 * 128 * 2)
        assert (small.expert_page_bytes, small.token_bytes) == (16_384, 512)


def test_a_one_kv_head_ratio_model_loses_its_ratio_at_tp2():
    """Why tiny-qwen3-moe-q3-ratio-tp2 exists: at TP=2 the 1-head model's KV head is
    replicated while its experts are halved, so its ratio halves; the real model's does not."""
    def ratio(name):
        plan = rank_plan(name, 2)
        return Fraction(plan.expert_page_bytes, plan.token_bytes)

    assert ratio("tiny-qwen3-moe-q3-ratio") == 16
    assert ratio("qwen3-30b-a3b") == ratio("tiny-qwen3-moe-q3-ratio-tp2") == 32


@pytest.mark.parametrize(
    "config, message",
    [
        (RimuruConfig(mode="static", expert_offload_limit=9), r"--rimuru-expert-offload-limit 9 is above the 8 routed experts"),
        (RimuruConfig(mode="static", resident_experts=0), r"--rimuru-resident-experts 0: each MoE layer must keep at least one"),
        (RimuruConfig(mode="static", resident_experts=9), r"--rimuru-resident-experts 9 is above the 8"),
        (RimuruConfig(mode="static", resident_experts=2, expert_offload_limit=4), r"offloads 6 experts per layer, above --rimuru-expert-offload-limit 4"),
        (RimuruConfig(mode="static", pool_gb=0.001), r"--rimuru-pool-gb: a pool of 0.001 GiB cannot hold 4 resident experts x 2 layers .* one request of 4096 tokens .* at least 0.00\d+ GiB"),
    ],
)
def test_bad_flags_name_the_flag(config, message):
    with pytest.raises(PlanError, match=message):
        plan_pool(ModelFacts.from_config(TINY), config)


def test_page_size_above_one_is_refused():
    with pytest.raises(PlanError, match=r"--page-size 16: --rimuru-mode supports page size 1 only"):
        plan_pool(ModelFacts.from_config(TINY), STATIC, page_size=16)


def test_smallest_pool_that_passes():
    plan = plan_pool(ModelFacts.from_config(TINY), STATIC)
    assert plan.min_pool_bytes == (49 + 4096 // 4) * 4096
    plan_pool(ModelFacts.from_config(TINY), RimuruConfig(mode="static", pool_gb=plan.min_pool_bytes / GIB))


def test_mode_off_rejects_pool_flags():
    with pytest.raises(ValueError, match=r"--rimuru-pool-gb need --rimuru-mode static"):
        RimuruConfig(pool_gb=1.0)


# --- elastic: the budget counts what the offload limit can free -------------------

ELASTIC_Q15 = RimuruConfig(mode="elastic", expert_offload_limit=20)
#: what SGLang left for the pool on the H200 emulating a 32 GB card (0dafc5d's log: 24.455 GiB)
CARD_32GB_POOL = int(24.455 * GIB)


def test_elastic_without_residents_fits_what_the_pool_holds():
    plan = plan_pool(ModelFacts.from_config(QWEN15), ELASTIC_Q15)
    assert plan.resident_per_layer is None and plan.min_resident_per_layer == 40
    plan.check_pool_bytes(CARD_32GB_POOL)
    # one full-context request with 40 of 60 experts per layer, the load buffers and the dummy page
    assert plan.min_pool_bytes == (1 + 2 * 20 * 3 + 24 * 40 * 3 + -(-8192 // 28)) * 5_767_168
    # 32 GB card: 4553 expert pages, 4432 free after the dummy page and the load buffers:
    # all 1440 experts fit, with 112 pages (~3k tokens) of KV left
    free = CARD_32GB_POOL // 5_767_168 - 1 - 2 * 20 * 3
    assert (free, plan.residents_at_start(free, keep_free_pages=2)) == (4432, 24 * 60)
    # ~17.5 GiB (a 24 GB card): not all fit; as many as do, the low water kept free
    free = int(17.5 * GIB) // 5_767_168 - 1 - 2 * 20 * 3
    total = plan.residents_at_start(free, keep_free_pages=2)
    assert total == (free - 2) // 3 == 1045
    assert free - 3 * total >= 2  # the adjuster's low water stays free: no eviction at idle
    # never below what the offload limit allows (check_pool_bytes holds that much)
    assert plan.residents_at_start(0, keep_free_pages=2) == 24 * 40


def test_elastic_with_residents_needs_them_at_start_but_not_with_a_request():
    plan = plan_pool(ModelFacts.from_config(QWEN15), RimuruConfig(mode="elastic", expert_offload_limit=20,
                                                                 resident_experts=58))
    plan.check_pool_bytes(CARD_32GB_POOL)  # 0dafc5d: "needs 24.65 GiB, has 24.46"
    assert plan.residents_at_start(123, keep_free_pages=2) == 24 * 58
    with pytest.raises(PlanError, match=r"--rimuru-resident-experts 60: .* need .* at start; lower it, or leave it out"):
        plan_pool(ModelFacts.from_config(QWEN15), RimuruConfig(mode="elastic", expert_offload_limit=20,
                                                                resident_experts=60)).check_pool_bytes(int(23.5 * GIB))


def test_elastic_budget_too_small_even_at_the_offload_limit():
    plan = plan_pool(ModelFacts.from_config(QWEN15), ELASTIC_Q15)
    with pytest.raises(PlanError, match=r"cannot hold 40 resident experts x 24 layers .*the fewest "
                                        r"--rimuru-expert-offload-limit 20 allows.* one request of 8192 tokens"):
        plan.check_pool_bytes(int(16 * GIB), flag="--mem-fraction-static")


def test_elastic_offload_limit_of_every_expert_is_refused():
    with pytest.raises(PlanError, match=r"--rimuru-expert-offload-limit 8 would let a layer offload all 8"):
        plan_pool(ModelFacts.from_config(TINY), RimuruConfig(mode="elastic", expert_offload_limit=8))


def test_host_memory_must_hold_every_routed_expert():
    facts = ModelFacts.from_config(QWEN15)
    need = 24 * 60 * 3 * 1408 * 2048 * 2  # every layer's 60 experts, W1 W3 W2, bf16
    assert facts.routed_expert_bytes() == need == 24_914_165_760
    check_host_memory(facts, need)
    with pytest.raises(PlanError, match=r"need 23\.2 GiB of page-locked host memory and this machine has 16\.0 GiB"):
        check_host_memory(facts, 16 * GIB)


def test_static_sized_by_sglang_caps_requests_like_sglang_instead_of_refusing():
    """Every expert resident on the 32 GB card: mode off holds 7,112 KV tokens and serves
    an 8,192-token context by capping requests; static sized from the same budget does
    the same. With the pool size given (--rimuru-pool-gb) the full request stays required."""
    plan = plan_pool(ModelFacts.from_config(QWEN15), RimuruConfig(mode="static", expert_offload_limit=0))
    assert plan.min_resident_per_layer == 60 and plan.request_tokens == 8192
    # 4553 expert pages: 1 dummy + 4320 for the experts + 232 of KV (28 whole KV pages each)
    assert CARD_32GB_POOL // 5_767_168 == 4553
    assert plan.kv_tokens_beside(CARD_32GB_POOL) == 232 * 28 == 6496
    assert plan.check_pool_bytes(CARD_32GB_POOL, flag="--mem-fraction-static", like_sglang=True) == 6496
    with pytest.raises(PlanError, match=r"one request of 8192 tokens"):
        plan.check_pool_bytes(CARD_32GB_POOL)
    # a pool that fits the request returns it whole
    assert plan.check_pool_bytes(plan.min_pool_bytes, like_sglang=True) == 8192
    # below SGLang's own floor (two tokens) it is refused all the same
    with pytest.raises(PlanError, match=r"cannot hold 60 resident experts"):
        plan.check_pool_bytes(4321 * 5_767_168, flag="--mem-fraction-static", like_sglang=True)
    # elastic keeps the full request (its evictions supply it)
    elastic = plan_pool(ModelFacts.from_config(QWEN15), ELASTIC_Q15)
    with pytest.raises(PlanError):
        elastic.check_pool_bytes(int(16 * GIB), flag="--mem-fraction-static", like_sglang=True)


def test_fewer_load_buffer_slots_leave_more_of_the_pool_for_kv():
    full = plan_pool(ModelFacts.from_config(QWEN15), ELASTIC_Q15)
    small = plan_pool(ModelFacts.from_config(QWEN15), RimuruConfig(mode="elastic", expert_offload_limit=20,
                                                                  load_buffer_slots=4))
    assert (full.buffer_slots, small.buffer_slots) == (20, 4)
    assert full.min_pool_bytes - small.min_pool_bytes == 2 * 16 * 3 * 5_767_168  # 96 pages, 528 MiB
    assert small.min_pool_bytes == (1 + 2 * 4 * 3 + 24 * 40 * 3 + -(-8192 // 28)) * 5_767_168
    # the paper policy's default limit is half the experts (30); the plan checks what the flags could not
    with pytest.raises(PlanError, match=r"--rimuru-load-buffer-slots 31 is above the offload limit 30"):
        plan_pool(ModelFacts.from_config(QWEN15), RimuruConfig(mode="elastic", load_buffer_slots=31,
                                                               adjuster_policy_name="paper"))


def test_elastic_buffers_hold_what_is_offloaded_at_start():
    plan = plan_pool(ModelFacts.from_config(QWEN15), ELASTIC_Q15)
    # a 32 GB card: every expert fits (1440 x 3 pages + low water 2 of 4553 free): no buffers,
    # the KV keeps the pages (the H200 run with buffers of 20 started with 3,267 KV tokens)
    assert plan.start_buffer_slots(4553, 2) == 0
    # 3,200 free pages: 1,066 fit without buffers, 16 out per layer; 16 slots leave 1,034
    # (17 out in some layer); 17 slots leave 1,032: settled
    assert plan.start_buffer_slots(3200, 2) == 17
    # tighter: the offload limit caps the slots (and the residents' floor of 40 a layer holds)
    assert plan.start_buffer_slots(2900, 2) == 20
    # the flag, static mode and a fixed elastic residency decide without the search
    flagged = plan_pool(ModelFacts.from_config(QWEN15),
                        RimuruConfig(mode="elastic", expert_offload_limit=20, load_buffer_slots=3))
    assert flagged.start_buffer_slots(4553, 2) == 3
    static = plan_pool(ModelFacts.from_config(QWEN15),
                       RimuruConfig(mode="static", resident_experts=50, expert_offload_limit=10))
    assert static.start_buffer_slots(4553, 2) == 10
    fixed = plan_pool(ModelFacts.from_config(QWEN15),
                      RimuruConfig(mode="elastic", resident_experts=50, expert_offload_limit=20))
    assert fixed.start_buffer_slots(4553, 2) == 10


# --- the default offload limit ------------------------------------------------------

#: the Qwen3-30B-A3B shape (python -m sglang_rimuru.models write qwen3-30b-a3b)
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "max_position_embeddings": 40960,
}
#: the pool SGLang left on the H200 emulating a 32 GB card for that shape
#: (bench/results/serving_h200_2026-12-02e/q3elastic32-skew_7f20a2d.log.gz: 25.122 GiB)
CARD_32GB_POOL_Q3 = int(25.122 * GIB)


def test_the_default_offload_limit_is_all_but_one_under_the_cost_policy_only():
    facts = ModelFacts.from_config(QWEN15)
    assert plan_pool(facts, RimuruConfig(mode="elastic")).offload_limit == 59
    assert plan_pool(facts, RimuruConfig(mode="elastic")).min_resident_per_layer == 1
    assert plan_pool(facts, RimuruConfig(mode="elastic", adjuster_policy_name="paper")).offload_limit == 30
    assert plan_pool(facts, STATIC).offload_limit == 30
    assert plan_pool(facts, RimuruConfig(mode="elastic", expert_offload_limit=20)).offload_limit == 20


def test_elastic_starts_a_model_whose_experts_outgrow_the_card_without_the_flag():
    """Qwen3-30B-A3B holds 54 GiB of experts; on a 32 GB card half of them resident
    (27 GiB) leave no pool for a request, which the old default (half) made a start-up
    error unless the user found --rimuru-expert-offload-limit."""
    facts = ModelFacts.from_config(QWEN3_30B)
    half = plan_pool(facts, RimuruConfig(mode="elastic", expert_offload_limit=64))
    with pytest.raises(PlanError, match=r"cannot hold 64 resident experts x 48 layers .*"
                                        r"--rimuru-expert-offload-limit 64 allows"):
        half.check_pool_bytes(CARD_32GB_POOL_Q3, flag="--mem-fraction-static")
    plan = plan_pool(facts, RimuruConfig(mode="elastic"))
    assert plan.offload_limit == 127
    assert plan.check_pool_bytes(CARD_32GB_POOL_Q3, flag="--mem-fraction-static") == plan.request_tokens
