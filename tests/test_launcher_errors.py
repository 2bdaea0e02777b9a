"""Bad command lines end the start with one clear line and a non-zero exit."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.conftest import launcher_cmd, warm_run


def run_launcher(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The launcher's command line, as a fresh interpreter runs it (tests/warm_python.py)."""
    return warm_run(launcher_cmd(*args)[1:], timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_unknown_flag():
    proc = run_launcher("--definitely-not-a-flag", "3")
    assert_one_line_error(proc, "unrecognized arguments", "--definitely-not-a-flag")


def test_unknown_rimuru_mode():
    proc = run_launcher("--rimuru-mode", "sideways")
    assert_one_line_error(proc, "--rimuru-mode", "sideways")


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = run_launcher("--model-path", str(missing))
    assert_one_line_error(proc, "--model-path", str(missing), "does not exist")


def test_port_already_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_launcher("--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(proc, f"--port {port}", "already in use")


def test_help_lists_sglang_and_rimuru_flags():
    proc = run_launcher("--help")
    assert proc.returncode == 0
    for flag in ("--model-path", "--tp-size", "--max-total-tokens", "--rimuru-mode"):
        assert flag in proc.stdout
    assert "sglang-rimuru options" in proc.stdout


# --- the unified pool's start-up checks: before any weight loads ----------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from sglang_rimuru.models import ensure_model

    return str(ensure_model("tiny-qwen3-moe", cache_dir=tmp_path_factory.mktemp("models")))


@pytest.mark.parametrize("mode", ["static", "elastic"])
def test_dense_model_with_pool_mode(tmp_path, mode):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, '
        '"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}'
    )
    proc = run_launcher("--model-path", str(dense), "--rimuru-mode", mode)
    assert_one_line_error(proc, "--rimuru-mode", "dense model", "Qwen3ForCausalLM")


def test_offload_limit_above_expert_count(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "static", "--rimuru-expert-offload-limit", "9")
    assert_one_line_error(proc, "--rimuru-expert-offload-limit 9", "above the 8 routed experts")


def test_pool_too_small_for_one_expert_per_layer_and_one_request(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "static", "--rimuru-pool-gb", "0.0001")
    assert_one_line_error(proc, "--rimuru-pool-gb", "cannot hold", "one request of 4096 tokens", "at least")


@pytest.mark.parametrize("flags, names", [
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype fp8_e5m2", "a quantized KV cache"]),
    (["--speculative-algorithm", "NGRAM"], ["--speculative-algorithm NGRAM", "speculative decoding"]),
    (["--cpu-offload-gb", "4"], ["--cpu-offload-gb 4", "the pool offloads experts itself"]),
    (["--enable-hierarchical-cache"], ["--enable-hierarchical-cache:", "HiCache"]),
])
def test_sglang_features_the_pool_does_not_support(tiny_moe, flags, names):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "elastic", *flags)
    assert_one_line_error(proc, "--rimuru-mode elastic does not support", *names)


def test_pool_flags_need_a_pool_mode(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-resident-experts", "4")
    assert_one_line_error(proc, "--rimuru-resident-experts", "need --rimuru-mode static or elastic")


def test_corrupt_ranking_file(tiny_moe, tmp_path):
    bad = tmp_path / "ranking.json"
    bad.write_text('{"format": "sglang-rimuru-expert-ranking", "version": 1, "layers": {')
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "static", "--rimuru-expert-ranking", str(bad))
    assert_one_line_error(proc, str(bad))


def test_elastic_offload_limit_above_expert_count(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "12")
    assert_one_line_error(proc, "--rimuru-expert-offload-limit 12", "above the 8 routed experts")


def test_adjuster_flags_need_elastic_mode(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "static", "--rimuru-adjuster-max-restores", "2")
    assert_one_line_error(proc, "--rimuru-adjuster-max-restores", "need --rimuru-mode elastic")


def test_adjuster_thresholds_that_would_ping_pong(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "elastic",
                        "--rimuru-adjuster-evict-low-water", "4", "--rimuru-adjuster-restore-high-water", "6")
    assert_one_line_error(proc, "--rimuru-adjuster-restore-high-water=6", "must exceed", "ping-pong")


def test_moe_kernel_needs_a_pool_mode(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-moe-kernel", "fast")
    assert_one_line_error(proc, "--rimuru-moe-kernel", "need --rimuru-mode static or elastic")


@pytest.mark.parametrize("flags, names", [
    (["--rimuru-cpu-experts", "1.5"], ["--rimuru-cpu-experts", "in [0, 1)", "1.5"]),
    (["--rimuru-cpu-experts", "most"], ["--rimuru-cpu-experts", "or auto", "'most'"]),
    (["--rimuru-cpu-experts", "0.25", "--rimuru-cpu-min-tokens", "64", "--rimuru-cpu-max-tokens", "32"],
     ["--rimuru-cpu-min-tokens 64", "--rimuru-cpu-max-tokens 32"]),
    (["--rimuru-cpu-experts", "0.25", "--device", "cpu", "--tp-size", "2"],
     ["--rimuru-cpu-experts 0.25", "needs a CUDA device (--device cpu)", "TP 1 only (--tp-size 2)"]),
])
def test_cpu_split_settings_it_cannot_serve(tiny_moe, flags, names):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-mode", "elastic", *flags)
    assert_one_line_error(proc, *names)


def test_cpu_split_needs_a_pool_mode(tiny_moe):
    proc = run_launcher("--model-path", tiny_moe, "--rimuru-cpu-experts", "0.25")
    assert_one_line_error(proc, "--rimuru-cpu-experts", "need --rimuru-mode static or elastic")


def test_mem_available_is_read_from_meminfo(tmp_path):
    from rimuru_patches.server import mem_available_bytes

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert mem_available_bytes(str(info)) == 20_000_000 * 1024
    info.write_text("MemTotal:       24000000 kB\n")
    assert mem_available_bytes(str(info)) is None
    assert mem_available_bytes(str(tmp_path / "missing")) is None
