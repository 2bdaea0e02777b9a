"""Routed experts made and loaded in host memory (``experts.host_*`` seams) under SGLang.

The checks live in ``sglang_cpu/host_experts_load.py`` and run in a child
process, because importing SGLang needs the CPU stand-in installed first.
"""

from tests.conftest import run_sglang_cpu_script


def test_experts_are_made_in_host_memory_and_drawn_as_sglang_draws_them():
    run_sglang_cpu_script("host_experts_load.py")
