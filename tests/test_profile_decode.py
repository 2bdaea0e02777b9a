"""bench/device/profile_decode.py's trace summary: the GPU's busy time is the union of its
kernels and copies (streams overlap), the idle rest is the GPU waiting for the host. The
profiling itself needs the H200 (a device call runs it)."""

import gzip
import json

from tests.conftest import bench_module


def load():
    return bench_module("device/profile_decode.py")


def test_busy_union_counts_overlaps_once():
    m = load()
    assert m.busy_union([]) == 0.0
    assert m.busy_union([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25.0
    assert m.busy_union([(20, 30), (0, 10)]) == 20.0


def test_summary_of_a_trace(tmp_path):
    m = load()
    events = [
        {"cat": "kernel", "name": "fused_moe_kernel", "ts": 0, "dur": 400},
        {"cat": "kernel", "name": "fused_moe_kernel", "ts": 1000, "dur": 200},
        {"cat": "kernel", "name": "fused_moe_kernel", "ts": 1200, "dur": 200},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200, "dur": 300},  # overlaps the first
        {"cat": "kernel", "name": "attention", "ts": 1900, "dur": 100},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host side: not GPU time
    ]
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = m.summarize(path)
    assert s["gpu_events"] == 5
    assert s["span_ms"] == 2.0 and s["busy_ms"] == 1.0  # 0-500, 1000-1400, 1900-2000
    assert s["top"][0] == {"name": "kernel: fused_moe_kernel", "count": 3, "total_ms": 0.8,
                           "median_us": 200.0, "max_us": 400.0}
    assert [r["name"] for r in s["top"][1:]] == ["gpu_memcpy: Memcpy HtoD (Pinned -> Device)", "kernel: attention"]


def test_numa_pages_sum_each_node_over_the_process_tree(tmp_path):
    """A parent and its child, each with its own map: both counted, each once. The tree is
    one the test starts (pytest's own process may have children of its own)."""
    import subprocess
    import time

    import psutil

    m = load()
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.time() + 10
        while not psutil.Process(parent.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(parent.pid).children()
        (tmp_path / f"maps-{parent.pid}").write_text(
            "7f00 default anon=10 dirty=10 N0=6 N1=4 kernelpagesize_kB=4\n"
            "7fff default file=/lib/x.so mapped=3 N0=3 kernelpagesize_kB=4\n")
        (tmp_path / f"maps-{child.pid}").write_text(
            "7f80 bind:1 anon=512 N1=512 kernelpagesize_kB=2048\n")  # huge pages count their size
        got = m.numa_pages_mib(parent.pid, numa_maps=str(tmp_path / "maps-{pid}"))
        assert got == {"N0": (9 * 4096) >> 20, "N1": (4 * 4096 + 512 * 2 * 2**20) >> 20}  # 0 and 1024 MiB
        assert m.numa_pages_mib(child.pid, numa_maps=str(tmp_path / "maps-{pid}")) == {"N1": 1024}
    finally:
        for p in psutil.Process(parent.pid).children():
            p.kill()
        parent.kill()
        parent.wait()


def test_cpu_experts_bmm_is_each_expert_on_its_tokens():
    """bench/device/cpu_experts.py times one batched matmul over a layer's slab (SGLang's
    w13 [E, 2I, H] / w2 [E, H, I] layout): it must compute what each expert does alone."""
    import torch

    m = bench_module("device/cpu_experts.py")
    torch.manual_seed(0)
    w13, w2 = m.layer_slabs(hidden=16, inter=8, experts=3, layers=1, pin=False)
    x = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    got = m.experts_bmm(x, w13[0], w2[0]).float()
    for e in range(3):
        g, u = (x[e].float() @ w13[0][e].float().T).chunk(2, dim=-1)
        want = (torch.nn.functional.silu(g) * u) @ w2[0][e].float().T
        torch.testing.assert_close(got[e], want, rtol=2e-2, atol=2e-3)
