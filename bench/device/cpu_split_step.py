"""A Qwen3-30B-A3B decode step whose offloaded experts are split between the GPU's
in-place reads and the host's CPUs, inside one CUDA graph (H200).

    python3 bench/device/cpu_split_step.py --out $OUT/cpu_split.json [--tokens 100] \\
        [--out-per-layer 84] [--cpu-experts 0,21,32,42,52,84] [--threads 14] [--budget-s 240]

Why: a decode step with experts offloaded is their bytes over PCIe (RESULTS ninth
session: 41 GB/s in the server, 52 alone), and the host's CPUs compute experts from DRAM
at ~54 GB/s beside 50 GB/s of copies (``cpu_experts.py --threads 14``). This measures
whether the two add up inside a step, before any of it goes into the server.

Each of the 48 layers (the same T tokens, routing drawn per layer as
``bench/kernel/zero_copy_scale.py`` draws it; ``--out-per-layer`` highest ids offloaded,
as static mode keeps the lowest resident) runs, in stream order:

1. hidden states and routing copied into pinned host buffers;
2. ``_post``: a device counter + 1, written to a mapped host flag (the request);
3. the paged kernel over the resident experts and the GPU's share of the offloaded ones,
   read in place; the CPU's share has page -1 in this table (contributes zero here);
4. meanwhile a host thread sees the request, computes the CPU's share of the offloaded
   experts (``sglang_rimuru.experts.cpu_experts.CpuExperts``, ``--threads`` threads,
   each expert's weights read in place from the layer's host store tensor [E, 3, I*H])
   into a pinned buffer, then writes the request's number to a second flag (done);
5. ``_await``: a one-program kernel polls the done flag (volatile loads over PCIe) until
   it reaches the counter;
6. the CPU's share copied to the device and added to the GPU's.

The CPU's share is the ``--cpu-experts`` highest ids of each layer (0: every offloaded
expert read in place, the server today). Reports per split: step ms, GB/s of offloaded
weights, the host thread's median ms a layer, and the last layer's output against the
all-in-HBM step (relative error; the CPU's matmuls are not bit-equal to the GPU's).
``--regions`` distinct host stores are cycled over the layers (4 x 1.2 GB: beyond any
cache, as the server's 68 GB). Writes JSON, prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from sglang_rimuru.experts.cpu_experts import CpuExperts, store_weights  # noqa: E402
from sglang_rimuru.experts.host_store import pinned_empty  # noqa: E402

E, H, I, TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B's MoE layer
IH = I * H
EXPERT_BYTES = 3 * IH * 2
MAX_SPINS = 20_000_000  # _await gives up after ~20-40 s of PCIe polls: a dead host thread is an error, not a hang


# The two ends of the handshake on the GPU. Flags are reached as ``anchor_ptr + offset``
# (int64 elements from a device tensor to the pinned host flags: under unified addressing a
# pinned host pointer is a device pointer), as the paged kernel reaches host pages.
@triton.jit
def _post(counter_ptr, anchor_ptr, req_off):
    n = tl.load(counter_ptr) + 1
    tl.store(counter_ptr, n)
    tl.store(anchor_ptr + req_off, n)


@triton.jit
def _await(counter_ptr, anchor_ptr, done_off, err_ptr, max_spins):
    want = tl.load(counter_ptr)
    # .cv: a cached line of system memory is stale, fetch it again (the host writes it)
    got = tl.load(anchor_ptr + done_off, cache_modifier=".cv", volatile=True)
    spins = 0
    while (got < want) & (spins < max_spins):
        got = tl.load(anchor_ptr + done_off, cache_modifier=".cv", volatile=True)
        spins += 1
    if got < want:
        tl.store(err_ptr, want)


def host_block(specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """Tensors of these (shape, dtype) as views of one host buffer, each 256-byte aligned,
    page-locked with one ``cudaHostRegister`` when ``pin``. One registration: small buffers
    registered apart may share a page, which cudaHostRegister refuses the second time; and
    not torch's pinned allocator, which records an event per async copy, a step that CUDA
    graph capture may refuse."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        nbytes = dtype.itemsize * max(1, int(torch.Size(shape).numel()))
        total += -(-nbytes // 256) * 256
    buf = pinned_empty((total,), torch.uint8) if pin else torch.empty(total, dtype=torch.uint8)
    return [buf[o:o + dtype.itemsize * torch.Size(shape).numel()].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs)]


def split_table(table0: torch.Tensor, n_out: int, n_cpu: int) -> torch.Tensor:
    """A layer's page table: experts below E - n_out resident (table0's pages), the next
    n_out - n_cpu read in place from host pages 3e, 3e+1, 3e+2 (entry -2 - page), the
    n_cpu highest ids -1 (the CPU computes them)."""
    t = table0.clone()
    for e in range(E - n_out, E):
        if e >= E - n_cpu:
            t[e] = -1
        else:
            t[e] = torch.tensor([-2 - (3 * e + m) for m in range(3)], dtype=t.dtype)
    return t


class HostSide:
    """The host thread: waits for a request number in ``flags[0]``, computes the CPU's
    share of that request's layer, writes the number to ``flags[1]``. Layer of request n:
    (n - 1) % layers (every step posts every layer once, in order)."""

    def __init__(self, flags: torch.Tensor, compute, layers: int):
        self.flags = flags.numpy()
        self.compute = compute  # compute(layer) -> None
        self.layers = layers
        self.last = int(self.flags[0])
        self.ms: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rimuru-cpu-split", daemon=True)

    def start(self) -> "HostSide":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def poll_once(self) -> bool:
        """Serve one pending request, if any; True if it did."""
        n = int(self.flags[0])
        if n == self.last:
            return False
        t0 = time.perf_counter()
        self.compute((n - 1) % self.layers)
        self.ms.append((time.perf_counter() - t0) * 1e3)
        self.flags[1] = n  # after the output's stores (x86 keeps store order); the GPU then copies it
        self.last = n
        return True

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.poll_once():
                    time.sleep(0)  # yield the GIL: the launching thread needs it between replays
        except BaseException as exc:  # reported by the main thread; _await then times out
            self.error = exc


def main() -> None:
    from rimuru_kernels import pack_contiguous_weights, paged_fused_moe

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernel"))
    from paged_rig import capture_graph

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--out-per-layer", type=int, default=84)
    ap.add_argument("--cpu-experts", default="0,14,21,28,42,56,84")
    ap.add_argument("--threads", type=int, default=14, help="host threads computing experts (torch's own set to 1)")
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    t_start = time.time()
    L, T, n_out = args.layers, args.tokens, args.out_per_layer
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).cuda()
    paged = pack_contiguous_weights(w13, w2)
    del w13, w2
    pool, table0, pe = paged.pool, paged.page_table, paged.page_elems
    # host stores [E, 3, I*H] holding the pool's pages (the server's layout), one per region
    stores = []
    for _ in range(args.regions):
        st = pinned_empty((E, 3, IH), torch.bfloat16)
        for e in range(E):
            for m in range(3):
                p = int(table0[e, m])
                st[e, m].copy_(pool[p * pe:p * pe + IH], non_blocking=True)
        stores.append(st)
    torch.cuda.synchronize()
    host_pages = [st.view(-1) for st in stores]
    weights = [store_weights(st, I, H) for st in stores]

    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    routes = []
    for _ in range(L):
        w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), TOP_K, dim=-1)
        routes.append((w.cuda(), ids.to(torch.int32).cuda()))

    # the handshake's buffers, read by the host thread; flags mapped (UVA) for the kernels
    x_pin, ids_pin, w_pin, part_pin, flags = host_block(
        [((T, H), torch.bfloat16), ((T, TOP_K), torch.int32), ((T, TOP_K), torch.float32),
         ((T, H), torch.bfloat16), ((2,), torch.int64)], pin=True)
    flags.zero_()
    anchor = torch.zeros(1, dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    err = torch.zeros(1, dtype=torch.int64, device="cuda")
    delta = flags.data_ptr() - anchor.data_ptr()
    assert delta % 8 == 0, "flags and anchor must be 8-byte aligned relative to each other"
    req_off, done_off = delta // 8, delta // 8 + 1
    part_dev = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    gpu_out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")

    torch.set_num_threads(1)  # each expert thread runs its matmuls alone (CpuExperts' docstring)
    cpu = CpuExperts(args.threads)
    state = {"experts": []}

    def compute(layer: int) -> None:
        cpu(x_pin, ids_pin, w_pin, weights[layer % args.regions], state["experts"], out=part_pin)

    host = HostSide(flags, compute, L).start()

    def step_fn(tables, n_cpu: int):
        def step():
            for l in range(L):
                w, ids = routes[l]
                if n_cpu:
                    x_pin.copy_(hidden, non_blocking=True)
                    ids_pin.copy_(ids, non_blocking=True)
                    w_pin.copy_(w, non_blocking=True)
                    _post[(1,)](counter, anchor, req_off)
                paged_fused_moe(hidden, pool, tables[l], w, ids, inter_size=I, page_elems=pe,
                                host_pages=host_pages[l % args.regions], out=gpu_out if n_cpu else out)
                if n_cpu:
                    _await[(1,)](counter, anchor, done_off, err, MAX_SPINS)
                    part_dev.copy_(part_pin, non_blocking=True)
                    torch.add(gpu_out, part_dev, out=out)
        return step

    def timed(step, reps: int = 3) -> float:
        gr = capture_graph(step)  # eager first (Triton compiles, the handshake runs once), then one replay
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gr.replay()
            b.record()
            torch.cuda.synchronize()  # releases the GIL: the host thread must run meanwhile
            times.append(a.elapsed_time(b))
        if host.error is not None or int(err.item()):
            raise RuntimeError(f"host side failed ({host.error!r}) or _await timed out (request {int(err.item())})")
        return statistics.median(times)

    res = {"layers": L, "tokens": T, "out_per_layer": n_out, "regions": args.regions, "threads": args.threads,
           "expert_bytes": EXPERT_BYTES, "rows": []}
    base_ms = timed(step_fn([table0] * L, 0))
    ref = out.clone()
    res["all_in_hbm_ms"] = base_ms
    print(f"all in HBM: {base_ms:.2f} ms a step of {L} layers, T={T}", flush=True)
    print(f"{'cpu experts':>11} {'gpu reads':>9} {'step ms':>8} {'GB/s':>6} {'host ms/layer':>13} {'rel err':>8}",
          flush=True)
    for n_cpu in [int(v) for v in args.cpu_experts.split(",")]:
        if time.time() - t_start > args.budget_s:
            res.setdefault("skipped", []).append(n_cpu)
            continue
        state["experts"] = list(range(E - n_cpu, E))
        host.ms.clear()
        ms = timed(step_fn([split_table(table0, n_out, n_cpu)] * L, n_cpu))
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        host_ms = statistics.median(host.ms) if host.ms else 0.0
        gbs = L * n_out * EXPERT_BYTES / ((ms - base_ms) * 1e6)
        row = dict(cpu_experts=n_cpu, gpu_in_place=n_out - n_cpu, step_ms=ms, GBps=gbs,
                   host_ms_per_layer=host_ms, rel_err=rel)
        res["rows"].append(row)
        print(f"{n_cpu:11d} {n_out - n_cpu:9d} {ms:8.2f} {gbs:6.1f} {host_ms:13.2f} {rel:8.4f}", flush=True)
        json.dump(res, open(args.out, "w"), indent=1)
    host.stop()
    cpu.close()
    res["wall_s"] = time.time() - t_start
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("cpu_split_step.py needs a CUDA device (pinned, mapped host memory; CUDA graphs)")
    main()
