"""Can a Triton kernel read pinned host memory in place, and how fast? (H200 check)

    python3 bench/device/zero_copy_diag.py [OUT.json]
    python3 bench/device/zero_copy_diag.py --pin-cost GIB [OUT.json]

1. a pinned tensor passed as a Triton pointer argument;
2. the same bytes reached from a device tensor's pointer plus an element offset
   (how the paged kernel addresses host pages);
3. read bandwidth of (2) for 128 MiB, against a pinned cudaMemcpy of the same bytes;
4. the same in-place read from each kind of page-locked memory the host store can
   use (``SGLANG_RIMURU_HOST_PIN``): torch's pinned allocator (as in 1-3),
   ``register`` (plain memory, cudaHostRegister: the default) and ``hugepage``
   (2 MiB-aligned, transparent huge pages, registered). Decode with offloaded
   experts is bound by this read (bench/RESULTS.md).
5. ``--pin-cost GIB``: GPU memory each kind costs per GiB page-locked and mapped
   (the GPU's translation of the host pages lives in GPU memory; at 4 KiB host
   pages and 8 B an entry that would be 2 MiB per GiB, which the KV cache loses).
   Each kind in a fresh process, so one kind's mappings do not hide another's.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _copy(src_ptr, dst_ptr, offset, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + offset + i, mask=m), mask=m)


def by_pin(host, anchor, dev, n, grid) -> dict:
    """In-place read rate from each kind of the host store's page-locked memory."""
    import os

    from sglang_rimuru.experts.host_store import PIN_ENV, pinned_empty

    out = {}
    preset = os.environ.get(PIN_ENV)  # the caller's choice comes back afterwards
    for how in ("torch", "register", "hugepage"):
        os.environ[PIN_ENV] = how
        src = pinned_empty((n,), torch.bfloat16)
        src.copy_(host)
        off = (src.data_ptr() - anchor.data_ptr()) // 2
        dev.zero_()
        _copy[grid](anchor, dev, off, n, BLOCK=4096)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), host), how
        ms = triton.testing.do_bench(lambda: _copy[grid](anchor, dev, off, n, BLOCK=4096), warmup=5, rep=50)
        out[how] = round(2 * n / ms / 1e6, 1)
    if preset is None:
        os.environ.pop(PIN_ENV, None)
    else:
        os.environ[PIN_ENV] = preset
    return out


def pin_cost_child(how: str, gib: int) -> None:
    """Print the MiB of free GPU memory that pinning ``gib`` GiB (1 GiB tensors) took."""
    import os

    os.environ["SGLANG_RIMURU_HOST_PIN"] = how
    from sglang_rimuru.experts.host_store import pinned_empty

    torch.empty(1, device="cuda")  # the context first: its own memory is not the pin's
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    keep = [pinned_empty((1 << 29,), torch.bfloat16) for _ in range(gib)]
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    print(json.dumps({"kind": how, "gib": gib, "gpu_mib": (free0 - free1) / 2**20, "tensors": len(keep)}))


def pin_cost(gib: int) -> dict:
    import subprocess

    out = {}
    try:  # "madvise" or "always": huge pages for hugepage_empty's MADV_HUGEPAGE; "never": none
        out["thp_enabled"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError as exc:
        out["thp_enabled"] = f"n/a ({exc})"
    print("transparent huge pages:", out["thp_enabled"], flush=True)
    for how in ("torch", "register", "hugepage"):
        r = subprocess.run([sys.executable, __file__, "--pin-cost-child", how, str(gib)],
                           capture_output=True, text=True, timeout=120)
        line = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
        try:
            d = json.loads(line)
            out[how] = round(d["gpu_mib"] / gib, 2)
        except ValueError:
            out[how] = f"failed: {line}"
        print(f"GPU MiB per GiB pinned, {how}: {out[how]}", flush=True)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--pin-cost-child":
        return pin_cost_child(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) > 2 and sys.argv[1] == "--pin-cost":
        res = {"gpu_mib_per_gib_pinned": pin_cost(int(sys.argv[2]))}
        if len(sys.argv) > 3:
            json.dump(res, open(sys.argv[3], "w"), indent=1)
        return print(json.dumps(res))
    res = {}
    n = 64 << 20  # elements of bf16: 128 MiB
    host = torch.randn(n, dtype=torch.float32).to(torch.bfloat16).pin_memory()
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    anchor = torch.empty(16, dtype=torch.bfloat16, device="cuda")
    res["host_ptr"] = hex(host.data_ptr())
    res["anchor_ptr"] = hex(anchor.data_ptr())
    try:
        from cupy.cuda import runtime as rt

        res["host_device_ptr"] = hex(rt.hostGetDevicePointer(host.data_ptr(), 0))
    except Exception as exc:  # noqa: BLE001
        res["host_device_ptr"] = f"n/a ({type(exc).__name__}: {exc})"
    grid = (triton.cdiv(n, 4096),)
    for name, src, off in (("pointer_arg", host, 0),
                           ("anchor_plus_offset", anchor, (host.data_ptr() - anchor.data_ptr()) // 2)):
        dev.zero_()
        try:
            _copy[grid](src, dev, off, n, BLOCK=4096)
            torch.cuda.synchronize()
            ok = torch.equal(dev.cpu(), host)
            res[name] = "equal" if ok else "DIFFERENT"
        except Exception as exc:  # noqa: BLE001
            res[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(name, res[name], flush=True)
    if res.get("anchor_plus_offset") == "equal":
        off = (host.data_ptr() - anchor.data_ptr()) // 2
        ms = triton.testing.do_bench(lambda: _copy[grid](anchor, dev, off, n, BLOCK=4096), warmup=5, rep=50)
        res["zero_copy_read_GBps"] = 2 * n / ms / 1e6
        ms2 = triton.testing.do_bench(lambda: dev.copy_(host, non_blocking=True), warmup=5, rep=50)
        res["memcpy_h2d_GBps"] = 2 * n / ms2 / 1e6
        print("zero-copy read %.1f GB/s, pinned memcpy %.1f GB/s" % (res["zero_copy_read_GBps"],
                                                                    res["memcpy_h2d_GBps"]), flush=True)
        try:
            res["zero_copy_read_GBps_by_pin"] = by_pin(host, anchor, dev, n, grid)
            print("in-place read by host memory kind, GB/s:", res["zero_copy_read_GBps_by_pin"], flush=True)
        except Exception as exc:  # noqa: BLE001
            res["zero_copy_read_GBps_by_pin"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if len(sys.argv) > 1:
        json.dump(res, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
