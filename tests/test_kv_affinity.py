"""Request affinity under SGLang: its own prefill and decode allocation over the pool.

The checks live in ``sglang_cpu/affinity_over_pool.py`` and run in a child
process, because importing SGLang needs the CPU stand-in installed first.
"""

import subprocess
import sys
from pathlib import Path


def test_interleaved_requests_keep_to_their_own_expert_pages():
    script = Path(__file__).parent / "sglang_cpu" / "affinity_over_pool.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
