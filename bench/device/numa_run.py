"""Run a Python script with its memory bound to one NUMA node (no numactl needed).

    python3 bench/device/numa_run.py NODE script.py ARGS...

``set_mempolicy(MPOL_BIND, {NODE})`` (Linux x86-64 syscall 238) and the CPUs of that
node, then the script as ``__main__``: so ``bench/kernel/zero_copy_scale.py``'s pinned
host pages lie on NODE, and its in-place reads show what a node's distance from the
GPU costs (the H200 device: bench/RESULTS.md).
"""

import ctypes
import os
import runpy
import sys

MPOL_BIND = 2
SYS_SET_MEMPOLICY = 238  # x86-64


def node_cpus(node: int) -> set[int]:
    cpus = set()
    for part in open(f"/sys/devices/system/node/node{node}/cpulist").read().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind(node: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    if libc.syscall(SYS_SET_MEMPOLICY, MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(64)) != 0:
        raise OSError(ctypes.get_errno(), f"set_mempolicy(MPOL_BIND, node {node}) failed")
    os.sched_setaffinity(0, node_cpus(node))


if __name__ == "__main__":
    node, script = int(sys.argv[1]), sys.argv[2]
    bind(node)
    print(f"numa_run: memory bound to node {node}, CPUs {sorted(os.sched_getaffinity(0))}", flush=True)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
