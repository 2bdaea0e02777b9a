"""The kernels' Triton specialization does not follow the batch size.

Triton compiles one variant per specialization of a launch's arguments (each
int: divisible by 16, equal to 1, i32 or i64). On the H200 an eager prefill of
a new token count compiled new variants of the paged GEMM and the align kernels
for seconds the first time experts were offloaded under load (bench/RESULTS.md,
2026-12-02). Here the launches of batches whose sizes fall in different
classes are bound by Triton's own binder for sm_90 (as
bench/kernel/compile_sm90.py does, no GPU needed) and must give one key.

Runs in a subprocess: on CPU this folder's conftest sets TRITON_INTERPRET=1,
under which triton.jit makes interpreted functions, which have no binder.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, "bench/kernel")
import compile_sm90 as c
from triton import knobs
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from rimuru_kernels import align

backend = make_backend(c.SM90)
keys = {}

def bind(name, fn, args, kwargs):
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    _, spec, _ = binder(*args, **kwargs)
    keys.setdefault(name, set()).add(str(spec))

configs = c.our_configs(2048)
configs["unfused_gateup"] = c.SGLANG_FALLBACK
# T*top_k and the padded length land in different divisibility classes
for T in (3, 1537, 1538, 1540, 1552, 2048):
    for lc in c.our_launches(T, configs):
        bind(lc.name, lc.fn, lc.args, lc.kwargs)
# align: one-program (<= 1024 slots, one BLOCK_N per power of two) and chunked
for slots in (513, 516, 528, 1008, 1024):
    with c.recording(align, "_align_one_program_kernel") as rec:
        align.moe_align_block_size_triton(torch.empty(slots, dtype=torch.int32, device="meta"), 64, 128)
    (args, kwargs), = rec.calls
    bind("align_one_program", align._align_one_program_kernel, args, kwargs)
names = ("_align_chunk_count_kernel", "_align_chunk_offsets_kernel", "_align_chunk_scatter_kernel")
for slots in (1025, 4100, 6144, 8191):
    with c.recording(align, names[0]) as r0, c.recording(align, names[1]) as r1, \
            c.recording(align, names[2]) as r2:
        align.moe_align_block_size_triton(torch.empty(slots, dtype=torch.int32, device="meta"), 64, 128,
                                          one_program=False)
    for name, rec in zip(names, (r0, r1, r2)):
        (args, kwargs), = rec.calls
        bind(name, getattr(align, name), args, kwargs)
print(json.dumps({k: sorted(v) for k, v in keys.items()}))
"""


def test_batch_size_does_not_respecialize():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "kernels"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"ours_fused_gateup_tip", "ours_down_tip", "align_one_program", "_align_chunk_count_kernel",
            "_align_chunk_offsets_kernel", "_align_chunk_scatter_kernel"} <= set(keys)
    many = {k: v for k, v in keys.items() if len(v) != 1}
    assert not many, f"specialization follows the batch size: {many}"
