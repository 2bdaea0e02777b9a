"""bench/kernel/sglang_compare.sh's two steps on CPU (Triton interpreter, tiny shape): the tuner's
``--kernel sglang`` writes SGLang-format tables that SGLang's own lookup reads back in the kernel
bench, and SGLang's whole ``fused_experts_impl`` runs there (its TP group of one initialized).

Subprocesses: each needs TRITON_INTERPRET before SGLang defines its kernels. CPU only (on a GPU
SGLang takes its CUDA branches; the device call runs the real thing).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "kernel"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check; the GPU runs sglang_compare.sh")


def run(*args, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1")
    paths = [str(ROOT), str(ROOT / "kernels"), str(ROOT / "patches"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_sglang_tuned_tables_reach_sglang_lookup_and_full_path_runs(tmp_path):
    tuned = tmp_path / "sglang_tuned"
    run(BENCH / "tune_paged_moe.py", "--kernel", "sglang", "--cpu-smoke", "--tokens", "1", "--workers", "0",
        "--out-dir", tuned)
    res = json.loads((tuned / "tune_sglang_moe.json").read_text())
    assert res["meta"]["kernel"] == "sglang" and res["sizes"][0]["pick"]
    tables = sorted(p.name for p in tuned.glob("configs/triton_*/E=*.json"))
    assert tables == ["E=8,N=32,device_name=CPU_dry_run,dtype=float32.json",
                      "E=8,N=32,device_name=CPU_dry_run,dtype=float32_down.json"]

    out = tmp_path / "kb.json"
    run(BENCH / "bench_moe_kernels.py", "--cpu-dry-run", "--shapes", "tiny-a", "--tokens", "1", "--routings",
        "uniform", "--no-transfers", "--no-step", "--sglang-tuned-dir", tuned, "--out", out)
    kb = json.loads(out.read_text())
    assert kb["meta"]["sglang"]["variants"] == ["sglang", "sglang_tuned", "sglang_full", "sglang_full_tuned"]
    assert kb["meta"]["sglang"]["setup"]["tp_group"].startswith("world size 1")
    (check,) = kb["correctness"]
    assert all(check["ok"].values()) and len(check["ok"]) == 6, check
    (rec,) = kb["kernels"]
    pick = res["sizes"][0]["pick"]["up"]
    for v in ("sglang_tuned", "sglang_full_tuned"):
        assert rec[f"{v}_info"]["tuned_entry_used"] and rec[f"{v}_info"]["up_config"] == pick
    assert rec["sglang_full_info"]["path"].startswith("fused_experts_impl")
    assert set(rec["over_paged_ratio"]) == {"sglang", "sglang_tuned", "sglang_full", "sglang_full_tuned"}
    assert not kb["errors"]
