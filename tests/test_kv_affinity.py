"""Request affinity under SGLang: its own prefill and decode allocation over the pool.

The checks live in ``sglang_cpu/affinity_over_pool.py`` and run in a child
process, because importing SGLang needs the CPU stand-in installed first.
"""

from tests.conftest import run_sglang_cpu_script


def test_interleaved_requests_keep_to_their_own_expert_pages():
    run_sglang_cpu_script("affinity_over_pool.py")
