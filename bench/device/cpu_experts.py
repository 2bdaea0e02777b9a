"""Could the host's CPU compute the cold experts instead of the GPU reading them over PCIe?

    python3 bench/device/cpu_experts.py [--shape qwen3|qwen1.5] [--layers 4] [OUT.json]

Decode with offloaded experts is bound by PCIe: every offloaded expert a step touches
crosses it once (Qwen3-30B-A3B at saturation: ~4,000 reads, ~1 s a step at 36-52 GB/s,
bench/RESULTS.md). KTransformers and Fiddler compute such experts on the CPU instead, so
only activations cross. That wins only if the host reads weights faster than PCIe does,
and keeps doing so while the GPU's copies draw on the same DRAM. This measures, on the
machine it runs on (the H200's host is a 16-vCPU Firecracker VM):

1. the CPU: model, the bf16 units torch can use (AMX, AVX512-BF16), torch's thread count;
2. DRAM read rate: a sum over 4 GiB, all threads and one;
3. one layer's experts at the model's shape as one batched matmul over the layer's slab
   (``bmm``: every expert at ``m`` tokens, the weights read in place, no gather), for m in
   ``--tokens``: ms a layer, weight GB/s;
4. the same expert by expert (``loop``: ``m`` tokens each, torch's threads inside each
   matmul): what varying token counts would cost without padding;
5. (with a GPU) the pinned H2D copy rate alone, then (3) and the copies at once: whether
   the two paths add up or share one memory bus.

Prints a table and writes the numbers as JSON. ~1-2 minutes on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

SHAPES = {"qwen3": (2048, 768, 128), "qwen1.5": (2048, 1408, 60)}  # hidden, moe inter, experts a layer


def cpu_info() -> dict:
    info = {"threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    try:
        info["capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        pass
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name"):
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["bf16_units"] = sorted(f for f in flags if f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f"))
            break
    return info


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def dram_read_gbs(gib: float = 4.0) -> dict:
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    out = {}
    for threads in (torch.get_num_threads(), 1):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        s = timed(lambda: x.sum(), 3 if threads > 1 else 1)
        torch.set_num_threads(prev)
        out[f"{threads}_threads"] = round(x.numel() * 4 / s / 1e9, 1)
    return out


def layer_slabs(hidden: int, inter: int, experts: int, layers: int, pin: bool):
    """Each layer's gate/up and down weights as one slab in SGLang's layout (w13 [E, 2I, H],
    w2 [E, H, I]: output-major, as nn.Linear), as the host store keeps them. On this CPU the
    output-major matmul read bf16 weights 2.5x faster than [E, H, 2I]."""
    w13 = [torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    w2 = [torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    if pin:
        w13 = [w.pin_memory() for w in w13]
        w2 = [w.pin_memory() for w in w2]
    return w13, w2


def experts_bmm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [E, m, H]: every expert of the layer on its m tokens (SiLU(gate) * up, then down)."""
    gu = torch.bmm(x, w13.transpose(1, 2))
    g, u = gu.chunk(2, dim=-1)
    return torch.bmm(torch.nn.functional.silu(g) * u, w2.transpose(1, 2))


def experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    for e in range(x.shape[0]):
        gu = x[e] @ w13[e].T
        g, u = gu.chunk(2, dim=-1)
        (torch.nn.functional.silu(g) * u) @ w2[e].T


def expert_rates(w13, w2, tokens: list[int], loop: bool) -> list[dict]:
    E, _, H = w13[0].shape
    layer_bytes = (w13[0].numel() + w2[0].numel()) * 2
    rows = []
    for m in tokens:
        x = torch.randn(E, m, H, dtype=torch.bfloat16)
        fn = experts_loop if loop else experts_bmm
        # cycle over the layers so no slab sits in the cache from the last rep
        s = timed(lambda: [fn(x, a, b) for a, b in zip(w13, w2)], 2) / len(w13)
        rows.append({"m": m, "ms_per_layer": round(s * 1e3, 2), "weight_gbs": round(layer_bytes / s / 1e9, 1),
                     "us_per_expert": round(s / E * 1e6, 1)})
    return rows


def h2d_alongside(w13, w2, m: int, seconds: float = 4.0) -> dict:
    """Pinned H2D copies on a side stream, alone and while the CPU computes experts."""
    src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    stream = torch.cuda.Stream()

    def copies(stop: threading.Event, moved: list) -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
                moved[0] += 4 * src.numel()

    def run(with_cpu: bool) -> dict:
        stop, moved = threading.Event(), [0]
        th = threading.Thread(target=copies, args=(stop, moved))
        t0 = time.perf_counter()
        th.start()
        cpu_bytes, x = 0, torch.randn(w13[0].shape[0], m, w13[0].shape[2], dtype=torch.bfloat16)
        while time.perf_counter() - t0 < seconds:
            if with_cpu:
                for a, b in zip(w13, w2):
                    experts_bmm(x, a, b)
                    cpu_bytes += (a.numel() + b.numel()) * 2
            else:
                time.sleep(0.05)
        stop.set()
        th.join()
        dt = time.perf_counter() - t0
        out = {"h2d_gbs": round(moved[0] / dt / 1e9, 1)}
        if with_cpu:
            out["cpu_weight_gbs"] = round(cpu_bytes / dt / 1e9, 1)
        return out

    return {"alone": run(False), "with_cpu_experts": run(True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="cpu_experts.json")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    ap.add_argument("--layers", type=int, default=4, help="distinct layer slabs cycled (defeats the cache)")
    ap.add_argument("--tokens", default="1,4,8,16,32", help="tokens per expert")
    ap.add_argument("--no-loop", action="store_true", help="skip the expert-by-expert timing")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's CPU threads (0: its default, one per core). Fewer leaves a core to the "
                         "thread that issues the copies: an OpenMP team that loses one core to it waits "
                         "at every barrier, which would understate the CPU's rate alongside the copies")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter, experts = SHAPES[args.shape]
    tokens = [int(t) for t in args.tokens.split(",")]
    res = {"shape": args.shape, "hidden": hidden, "inter": inter, "experts": experts, "cpu": cpu_info()}
    print("cpu:", res["cpu"], flush=True)
    res["dram_read_gbs"] = dram_read_gbs()
    print("DRAM read GB/s:", res["dram_read_gbs"], flush=True)
    gpu = torch.cuda.is_available()
    w13, w2 = layer_slabs(hidden, inter, experts, args.layers, pin=gpu)
    res["bmm"] = expert_rates(w13, w2, tokens, loop=False)
    if not args.no_loop:
        res["loop"] = expert_rates(w13, w2, [t for t in tokens if t <= 16], loop=True)
    if gpu:
        res["h2d"] = h2d_alongside(w13, w2, m=8)
    print(f"\n{args.shape}: {experts} experts a layer, {(w13[0].numel() + w2[0].numel()) * 2 / 2**20:.0f} MiB")
    print("| way | tokens/expert | ms a layer | weight GB/s | us an expert |\n|---|---|---|---|---|")
    for way in ("bmm", "loop"):
        for r in res.get(way, []):
            print(f"| {way} | {r['m']} | {r['ms_per_layer']} | {r['weight_gbs']} | {r['us_per_expert']} |")
    if gpu:
        print("pinned H2D alone / with CPU experts:", res["h2d"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
