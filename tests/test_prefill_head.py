"""The prefill-demand seam against SGLang's own PrefillAdder: exact KV demand of the queue's head.

The checks live in ``sglang_cpu/prefill_head.py`` and run in a child process,
because importing SGLang needs the CPU stand-in installed first.
"""

import subprocess
import sys
from pathlib import Path


def test_head_demand_is_exactly_what_sglang_admits_the_head_with():
    script = Path(__file__).parent / "sglang_cpu" / "prefill_head.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
