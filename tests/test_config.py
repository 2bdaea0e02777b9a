"""``RimuruConfig``: the project's flags parse into one frozen dataclass; bad combinations fail naming the flag."""

from __future__ import annotations

import argparse

import pytest

from sglang_rimuru.config import CPU_ENGINES, MOE_KERNELS, RimuruConfig, choose_moe_kernel


def parse(*argv: str) -> RimuruConfig:
    parser = argparse.ArgumentParser()
    RimuruConfig.add_cli_args(parser)
    return RimuruConfig.from_cli_args(parser.parse_args(argv))


def test_defaults_are_the_dataclass_defaults():
    assert parse() == RimuruConfig()
    assert RimuruConfig().moe_kernel == "auto"


@pytest.mark.parametrize("kernel", MOE_KERNELS)
@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_moe_kernel_flag_in_pool_modes(mode, kernel):
    config = parse("--rimuru-mode", mode, "--rimuru-moe-kernel", kernel)
    assert config.moe_kernel == kernel
    assert RimuruConfig.from_dict(config.to_dict()) == config  # what the spawned processes get


@pytest.mark.parametrize("kernel", ["exact", "fast"])
def test_moe_kernel_needs_a_pool_mode(kernel):
    with pytest.raises(ValueError, match=r"^--rimuru-moe-kernel need --rimuru-mode static or elastic$"):
        parse("--rimuru-moe-kernel", kernel)
    assert parse("--rimuru-moe-kernel", "auto") == RimuruConfig()  # the default is fine anywhere


Q15_TABLE = "E=60,N=1408,device_name=NVIDIA_H200.json"


def test_auto_kernel_static_is_exact_whatever_the_tables():
    for deterministic in (False, True):
        assert choose_moe_kernel("auto", "static", deterministic=deterministic, tuned_table=Q15_TABLE,
                                 routed_scaling_factor=None) == ("exact", "static mode: outputs equal "
                                                                 "--rimuru-mode off")


def test_auto_kernel_elastic_is_fast_with_a_tuned_table():
    assert choose_moe_kernel("auto", "elastic", deterministic=False, tuned_table=Q15_TABLE,
                             routed_scaling_factor=1.0) == ("fast", f"elastic mode with a tuned table ({Q15_TABLE})")


def test_auto_kernel_elastic_without_a_tuned_table_is_fast_on_the_default_table():
    """SGLang's default config, which exact would take, reads host pages in 64 B rows above E tokens."""
    kernel, why = choose_moe_kernel("auto", "elastic", deterministic=False, tuned_table=None,
                                    routed_scaling_factor=None)
    assert kernel == "fast" and why.startswith("no tuned table for this shape on this GPU, here or in SGLang: the "
                                               "kernel's default table (BLOCK_K >= 64")


@pytest.mark.parametrize(("deterministic", "table", "scale", "fits", "why"), [
    (True, Q15_TABLE, None, True,
     "--enable-deterministic-inference: SGLang's arithmetic, outputs equal --rimuru-mode off"),
    (False, Q15_TABLE, 2.5, True, "routed_scaling_factor 2.5, which the fast top-k sum does not apply"),
    (False, None, None, False, "the fast kernel's table (the default table) has tiles larger than this GPU's "
                               "shared memory"),
    (False, Q15_TABLE, None, False, f"the fast kernel's table ({Q15_TABLE}) has tiles larger than this GPU's "
                                    "shared memory"),
])
def test_auto_kernel_elastic_falls_back_to_exact(deterministic, table, scale, fits, why):
    assert choose_moe_kernel("auto", "elastic", deterministic=deterministic, tuned_table=table,
                             routed_scaling_factor=scale, table_fits=fits) == ("exact", why)


def test_auto_kernel_elastic_takes_sglangs_tuned_table_over_the_kernels_default():
    assert choose_moe_kernel("auto", "elastic", deterministic=False, tuned_table=None, routed_scaling_factor=None,
                             sglang_tuned=True) == (
        "exact", "no tuned table of the fast kernel for this shape on this GPU; SGLang has one")
    # the kernel's own tuned table wins over SGLang's
    assert choose_moe_kernel("auto", "elastic", deterministic=False, tuned_table=Q15_TABLE,
                             routed_scaling_factor=None, sglang_tuned=True)[0] == "fast"


@pytest.mark.parametrize("kernel", ["exact", "fast"])
def test_given_kernel_is_kept(kernel):
    assert choose_moe_kernel(kernel, "elastic", deterministic=True, tuned_table=None,
                             routed_scaling_factor=None) == (kernel, "given")


def test_unknown_moe_kernel():
    with pytest.raises(SystemExit):  # argparse: one "invalid choice" line
        parse("--rimuru-mode", "static", "--rimuru-moe-kernel", "turbo")
    with pytest.raises(ValueError, match=r"--rimuru-moe-kernel: unknown kernel 'turbo'; choose from auto, exact, fast"):
        RimuruConfig(mode="static", moe_kernel="turbo")


def test_adjuster_policy_flag():
    assert RimuruConfig().adjuster_policy_name == "cost"
    config = parse("--rimuru-mode", "elastic", "--rimuru-adjuster-policy", "paper")
    assert config.adjuster_policy_name == "paper"
    assert RimuruConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"^--rimuru-adjuster-policy need --rimuru-mode elastic$"):
        parse("--rimuru-mode", "static", "--rimuru-adjuster-policy", "paper")
    with pytest.raises(SystemExit):
        parse("--rimuru-mode", "elastic", "--rimuru-adjuster-policy", "greedy")


def test_load_buffer_slots_flag():
    assert RimuruConfig(mode="static", expert_offload_limit=4, load_buffer_slots=1).load_buffer_slots == 1
    with pytest.raises(ValueError, match=r"--rimuru-load-buffer-slots 5 is above --rimuru-expert-offload-limit 4"):
        RimuruConfig(mode="elastic", expert_offload_limit=4, load_buffer_slots=5)
    with pytest.raises(ValueError, match=r"--rimuru-load-buffer-slots must be >= 0"):
        RimuruConfig(mode="static", load_buffer_slots=-1)
    with pytest.raises(ValueError, match=r"--rimuru-load-buffer-slots need --rimuru-mode static or elastic"):
        RimuruConfig(mode="off", load_buffer_slots=2)


def test_cpu_split_problems_name_each_setting_it_cannot_serve():
    cfg = RimuruConfig(mode="elastic", cpu_experts=0.25)
    assert cfg.cpu_split_problems("cuda", 1, False) == []
    assert cfg.cpu_split_problems("cpu", 2, True) == [
        "it needs a CUDA device (--device cpu)",
        "it runs at TP 1 only (--tp-size 2)",
        "its outputs are not bit-equal to the GPU's (--enable-deterministic-inference)",
    ]


def test_cpu_experts_auto():
    config = parse("--rimuru-mode", "elastic", "--rimuru-cpu-experts", "auto")
    assert config.cpu_experts == "auto" and config.cpu_share is None
    assert RimuruConfig.from_dict(config.to_dict()) == config  # what the spawned processes get
    assert parse("--rimuru-mode", "elastic", "--rimuru-cpu-experts", "0.25").cpu_share == 0.25
    with pytest.raises(SystemExit):
        parse("--rimuru-mode", "elastic", "--rimuru-cpu-experts", "half")
    with pytest.raises(ValueError, match=r"in \[0, 1\), or auto; got half"):
        RimuruConfig(mode="elastic", cpu_experts="half")
    with pytest.raises(ValueError, match=r"^--rimuru-cpu-experts need --rimuru-mode static or elastic$"):
        RimuruConfig(mode="off", cpu_experts="auto")


def test_cpu_engine_flag():
    from sglang_rimuru.experts.cpu_experts import ENGINES

    assert ENGINES == CPU_ENGINES  # the flag's choices are the engines CpuExperts has
    assert parse("--rimuru-mode", "elastic", "--rimuru-cpu-experts", "0.25").cpu_engine == "forked"
    config = parse("--rimuru-mode", "elastic", "--rimuru-cpu-experts", "0.25", "--rimuru-cpu-engine", "threads")
    assert config.cpu_engine == "threads"
    assert RimuruConfig.from_dict(config.to_dict()) == config  # what the spawned processes get
    with pytest.raises(SystemExit):
        parse("--rimuru-mode", "elastic", "--rimuru-cpu-engine", "gpu")
    with pytest.raises(ValueError, match=r"--rimuru-cpu-engine: unknown engine 'gpu'; choose from forked, threads"):
        RimuruConfig(mode="elastic", cpu_engine="gpu")
    with pytest.raises(ValueError, match=r"^--rimuru-cpu-engine need --rimuru-mode static or elastic$"):
        RimuruConfig(mode="off", cpu_engine="threads")
