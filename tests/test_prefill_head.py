"""The prefill-demand seam against SGLang's own PrefillAdder: exact KV demand of the queue's head.

The checks live in ``sglang_cpu/prefill_head.py`` and run in a child process,
because importing SGLang needs the CPU stand-in installed first.
"""

from tests.conftest import run_sglang_cpu_script


def test_head_demand_is_exactly_what_sglang_admits_the_head_with():
    run_sglang_cpu_script("prefill_head.py")
