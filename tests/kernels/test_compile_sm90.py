"""The down GEMM compiled for sm_90 on this host (bench/kernel/compile_sm90.py, no GPU):
with the shipped H200 config the launcher picks TILE_IN_PAGE, and that compile has
no spills, the per-column compile's wgmma count and no more SASS per tile.

The tool runs in a subprocess: on CPU this folder's conftest sets
TRITON_INTERPRET=1, under which triton.jit makes interpreted functions, which
do not compile. Skipped without the ptxas / nvdisasm the triton wheel ships.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "bench" / "kernel" / "compile_sm90.py"


def test_down_gemm_tile_in_page_compiles_no_worse(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "kernels"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(TOOL), "--only", "ours_down", "--out-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 2 and " not found" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "compile_sm90.json").read_text())["kernels"]}
    assert "ours_down_tip" in rows, f"the launcher did not pick TILE_IN_PAGE for the shipped config: {list(rows)}"
    tip, col = rows["ours_down_tip"], rows["ours_down_col"]
    assert (tip["spill_store_bytes"], tip["spill_load_bytes"]) == (0, 0), tip
    assert tip["mma_per_iter"] == col["mma_per_iter"] > 0, (tip, col)
    assert tip["per_tile"] <= col["per_tile"], (tip, col)
