"""SGLang's RadixCache (unchanged) over the pooled KV allocator: exact page ids.

The checks live in ``sglang_cpu/radix_over_pool.py`` and run in a child
process, because importing SGLang needs the CPU stand-in installed first.
"""

from tests.conftest import run_sglang_cpu_script


def test_radix_cache_over_the_unified_pool():
    run_sglang_cpu_script("radix_over_pool.py")


def test_sglang_kv_pool_over_the_pool_at_real_geometry():
    """Every KV id inside SGLang's KV pool bounds at Qwen1.5-MoE / Qwen3-30B byte geometry."""
    run_sglang_cpu_script("kv_bounds_real_geometry.py", timeout=600)
