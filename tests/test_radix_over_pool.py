"""SGLang's RadixCache (unchanged) over the pooled KV allocator: exact page ids.

The checks live in ``sglang_cpu/radix_over_pool.py`` and run in a child
process, because importing SGLang needs the CPU stand-in installed first.
"""

import subprocess
import sys
from pathlib import Path


def test_radix_cache_over_the_unified_pool():
    script = Path(__file__).parent / "sglang_cpu" / "radix_over_pool.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"


def test_sglang_kv_pool_over_the_pool_at_real_geometry():
    """Every KV id inside SGLang's KV pool bounds at Qwen1.5-MoE / Qwen3-30B byte geometry."""
    script = Path(__file__).parent / "sglang_cpu" / "kv_bounds_real_geometry.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
