"""The seam registry: targets resolve in the pinned SGLang; a missing one fails loudly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, SeamTargetMissing


def _seam(target: str) -> Seam:
    return Seam(name="test.seam", target=target, why="test", build=lambda o, c: o, applies=lambda c: True)


def test_missing_module_names_the_seam():
    with pytest.raises(SeamTargetMissing, match=r"seam 'test.seam': cannot import no_such_module_xyz"):
        _seam("no_such_module_xyz:thing").resolve()


def test_missing_attribute_names_the_seam_and_target():
    with pytest.raises(SeamTargetMissing, match=r"seam 'test.seam': target json:JSONDecoder.no_such_method"):
        _seam("json:JSONDecoder.no_such_method").resolve()


def test_resolve_returns_owner_and_original():
    import json

    owner, attr, original = _seam("json:JSONDecoder.decode").resolve()
    assert owner is json.JSONDecoder and attr == "decode" and original is json.JSONDecoder.decode


def test_context_round_trips_through_the_environment(monkeypatch):
    ctx = ProcessContext(device="cpu", tp_size=2, rimuru={"mode": "off"})
    monkeypatch.delenv("SGLANG_RIMURU_CONTEXT", raising=False)
    assert ProcessContext.from_env() is None
    ctx.publish()
    assert ProcessContext.from_env() == ctx


def test_every_seam_resolves_and_installs_in_the_pinned_sglang():
    # In a child process: installing imports SGLang with the CPU stand-in.
    code = textwrap.dedent(
        """
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        from rimuru_patches import seams
        bootstrap_process(ProcessContext(device="cpu", tp_size=2))
        import sglang.srt.models.qwen2_moe as q2
        assert q2.fused_gate_sigmoid_mul_add is not seams.original("cpu.qwen2_moe_shared_expert_gate")
        print(sorted(seams.installed()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        sorted(["cpu.no_pynccl", "cpu.qwen2_moe_shared_expert_gate", "http.sampling_param_types"])
    )


def test_cuda_context_installs_no_cpu_seams():
    code = textwrap.dedent(
        """
        from rimuru_patches import all_seams, seams
        from rimuru_patches.context import ProcessContext
        all_seams.load()
        print(sorted(s.name for s in seams.REGISTRY if s.applies(ProcessContext(device="cuda"))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['http.sampling_param_types']"


def test_sampling_param_type_check():
    from rimuru_patches.request_validation import check_sampling_params

    check_sampling_params({"max_new_tokens": 8, "temperature": 0, "top_p": 0.9})
    check_sampling_params(None)
    with pytest.raises(ValueError, match=r"sampling_params.max_new_tokens must be an integer, got 'many'"):
        check_sampling_params({"max_new_tokens": "many"})
    with pytest.raises(ValueError, match=r"sampling_params.temperature must be a finite number"):
        check_sampling_params({"temperature": float("nan")})
    with pytest.raises(ValueError, match=r"sampling_params.n must be an integer, got True"):
        check_sampling_params({"n": True})


def test_pool_seams_resolve_when_the_pool_mode_is_on():
    code = textwrap.dedent(
        """
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        from rimuru_patches import seams
        ctx = ProcessContext(device="cpu", rimuru={"mode": "static"})
        bootstrap_process(ctx)
        print(sorted(s.name for s in seams.verify(ctx)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        sorted(
            [
                "cpu.no_pynccl",
                "cpu.qwen2_moe_shared_expert_gate",
                "http.sampling_param_types",
                "pool.build",
                "pool.kv_budget",
                "pool.kv_capacity",
                "pool.kv_buffers",
                "pool.kv_allocator",
                "experts.forward_pass",
                "experts.moe_core",
            ]
        )
    )
