"""The CPU split's host side alone: what one layer request costs the host, and where.

    python3 bench/device/cpu_split_host.py [--shape qwen1.5] [--tokens 128] [--reps 20] [OUT.json]

In serving (bench/RESULTS.md, thirty-eighth session) the host took ~9-10 ms a layer
request on an H100's 16-core host almost whatever its experts (9.35 ms for 4, 10.2 for
8, 11.5 for 13.8: ~8.5 ms fixed), which made it the step's floor below batch ~40; the
session before, without the row pieces ``CpuExperts`` now cuts when there are fewer
experts than threads, the same 4 experts took 3.84-4.13 ms. This times
``CpuSplit.serve_once``'s work (``CpuExperts`` over the layer's host experts, reading a
host-store layer tensor in place, into the mailbox's part) at the serving shape, per
request: by expert count (4, 8, 14, 28), on each engine (``forked``: TorchScript
tasks on torch's inter-op pool; ``threads``: Python threads), each with and without the
row pieces, at the server's thread count (the host's cores less two), alone and beside a
Python thread that
holds the GIL whenever it can (the scheduler's at its busiest; the server's switch
interval, ``SWITCH_INTERVAL_S``); and the routing and combine
steps apart. Weights cycle over ``--layers`` layers (~1 GiB each for Qwen1.5) so DRAM,
not the cache, serves them, as 24 layers do in serving. Prints a table, writes JSON.
No GPU needed; ~1 minute on the device's host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from sglang_rimuru.experts.cpu_experts import CpuExperts, store_weights  # noqa: E402
from sglang_rimuru.experts.cpu_split import SWITCH_INTERVAL_S  # noqa: E402

SHAPES = {"qwen1.5": (2048, 1408, 60, 4), "qwen3": (2048, 768, 128, 8)}  # hidden, moe inter, experts, top-k


def busy(stop: threading.Event) -> None:
    """A Python thread that runs bytecode (holds the GIL) all the time: the worst case of
    the scheduler's thread, which holds it between its launches and syncs."""
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1


def time_requests(cpu: CpuExperts, layers, x, ids, w, experts, part, reps: int) -> list[float]:
    out = []
    for r in range(reps + 2):
        weights = layers[r % len(layers)]
        t0 = time.perf_counter()
        cpu(x, ids, w, weights, experts, out=part)
        if r >= 2:  # the first two create the matmul shapes' kernels
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 2))
    ap.add_argument("--experts", default="4,8,14,28")
    ap.add_argument("out", nargs="?", default="cpu_split_host.json")
    args = ap.parse_args()
    H, I, E, k = SHAPES[args.shape]
    torch.set_num_threads(1)  # as the server does with more than one host thread
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as CpuSplit.start() does
    torch.manual_seed(0)
    t0 = time.perf_counter()
    stores = [torch.empty(E, 3, I * H, dtype=torch.bfloat16).fill_(0.01) for _ in range(args.layers)]
    layers = [store_weights(s, I, H) for s in stores]
    T = args.tokens
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k)
    part = torch.empty(T, H, dtype=torch.bfloat16)
    cpus = os.cpu_count()
    print(f"{args.shape}: {E} experts of {3 * I * H * 2 / 2**20:.1f} MiB, top-{k}, {T} tokens; "
          f"{args.threads} threads of {cpus} CPUs; weights filled in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for n in [int(v) for v in args.experts.split(",")]:
        experts = list(range(n))
        pairs = int(torch.isin(ids, torch.tensor(experts, dtype=torch.int32)).sum())
        for engine, pieces in (("forked", False), ("forked", True), ("threads", True), ("threads", False)):
            for contended in (False, True):
                cpu = CpuExperts(args.threads, pieces=pieces, engine=engine)
                stop = threading.Event()
                other = threading.Thread(target=busy, args=(stop,), daemon=True) if contended else None
                if other is not None:
                    other.start()
                try:
                    ms = time_requests(cpu, layers, x, ids, w, experts, part, args.reps)
                finally:
                    stop.set()
                    if other is not None:
                        other.join()
                    cpu.close()
                med = statistics.median(ms)
                gbs = n * 3 * I * H * 2 / (med * 1e6)
                rows.append(dict(experts=n, token_pairs=pairs, engine=engine, pieces=pieces and n < args.threads,
                                 contended=contended, median_ms=round(med, 3), min_ms=round(min(ms), 3),
                                 weight_gbps=round(gbs, 1)))
                print(f"  {n:3d} experts ({pairs:4d} token pairs)  {engine:7s}  "
                      f"pieces {str(pieces and n < args.threads):5s}  "
                      f"busy Python thread {str(contended):5s}  median {med:7.2f} ms  min {min(ms):7.2f}  "
                      f"({gbs:5.1f} GB/s of weights)", flush=True)
    # the request's steps apart: routing and combine, on the calling thread
    cpu = CpuExperts(1)
    experts = list(range(8))
    t1 = time.perf_counter()
    for _ in range(50):
        work = cpu.routed(ids, experts)
    routed_ms = (time.perf_counter() - t1) / 50 * 1e3
    items = list(work.items())
    ys = [torch.zeros(len(s), H, dtype=torch.bfloat16) for _, s in items]
    t1 = time.perf_counter()
    for _ in range(50):
        cpu._combine(x, w, items, ys, part)
    combine_ms = (time.perf_counter() - t1) / 50 * 1e3
    cpu.close()
    print(f"  routing {routed_ms:.3f} ms, combine {combine_ms:.3f} ms (8 experts, one thread)")
    info = dict(shape=args.shape, tokens=T, threads=args.threads, cpus=cpus, torch=torch.__version__,
                capability=getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
                rows=rows, routed_ms=round(routed_ms, 3), combine_ms=round(combine_ms, 3))
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
