"""Fused vs unfused gate/up GEMM under sustained load, with the GPU's clocks and power.

At 4096+ tokens the kernel bench's first timing round of the paged kernel is
its fastest and later rounds are ~10 % slower, while SGLang's path stays flat.
This script replays long CUDA graphs (each ~``--graph-ms``) of the default
paged call (SiLU*up fused) and of the unfused one (the separate SiLU kernel via
``act_and_mul``), alternating, and logs every replay's time beside
nvidia-smi's SM clock, power and throttle reasons sampled at 100 ms.

    source bench/device/setup_device.sh
    python3 bench/kernel/sustained_ab.py --out $OUT/sustained_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default="sustained_ab.json")
ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 8192])
ap.add_argument("--graph-ms", type=float, default=50.0)
ap.add_argument("--replays", type=int, default=20, help="replays per variant per turn")
ap.add_argument("--turns", type=int, default=3)
ARGS = ap.parse_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import paged_rig as rig  # noqa: E402
from rimuru_kernels import paged_fused_moe  # noqa: E402
from rimuru_kernels.paged_moe import _silu_and_mul  # noqa: E402

SMI = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
       "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "100"]


def main():
    dev = torch.device("cuda")
    shape = rig.SHAPES["Qwen3-30B-A3B"]
    r = rig.Rig("Qwen3-30B-A3B", **shape, device=dev)
    smi_path = os.path.splitext(ARGS.out)[0] + "_smi.csv"
    smi = subprocess.Popen(SMI, stdout=open(smi_path, "w"), stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    if smi.poll() is not None:  # an older driver: the field's former name
        smi = subprocess.Popen([x.replace("clocks_event_reasons", "clocks_throttle_reasons") for x in SMI],
                               stdout=open(smi_path, "w"), stderr=subprocess.DEVNULL)
    res = dict(meta=dict(device=torch.cuda.get_device_name(), graph_ms=ARGS.graph_ms, smi_csv=smi_path,
                         t0=time.time()), runs=[])
    try:
        for T in ARGS.tokens:
            sets = r.inputs(T, 2)
            outs = [torch.empty(T, r.H, dtype=r.dtype, device=dev) for _ in sets]
            kw = dict(inter_size=r.I, page_elems=r.page_elems, validate=False)
            variants = {
                "fused": lambda: [paged_fused_moe(s[0], r.pool, r.table, s[1], s[2], out=o, **kw)
                                  for s, o in zip(sets, outs)],
                "unfused": lambda: [paged_fused_moe(s[0], r.pool, r.table, s[1], s[2], out=o,
                                                    act_and_mul=_silu_and_mul, **kw)
                                    for s, o in zip(sets, outs)],
            }
            graphs = {}
            for name, fn in variants.items():
                fn()
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                reps = max(1, int(ARGS.graph_ms / 1e3 / max(time.perf_counter() - t, 1e-6)))
                graphs[name] = (rig.capture_graph(fn, reps), reps * len(sets))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for turn in range(ARGS.turns):
                for name, (g, calls) in graphs.items():
                    us = []
                    start = time.time()
                    for _ in range(ARGS.replays):
                        a.record()
                        g.replay()
                        b.record()
                        b.synchronize()
                        us.append(round(a.elapsed_time(b) * 1e3 / calls, 2))
                    res["runs"].append(dict(tokens=T, variant=name, turn=turn, start=start, end=time.time(),
                                            us_per_call=us))
                    print(f"T={T} {name:8s} turn {turn}: first {us[0]:.1f} us, last {us[-1]:.1f} us, "
                          f"min {min(us):.1f}, median {sorted(us)[len(us) // 2]:.1f}", flush=True)
            del graphs
            torch.cuda.synchronize()
    finally:
        smi.terminate()
        with open(ARGS.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
