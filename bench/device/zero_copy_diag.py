"""Can a Triton kernel read pinned host memory in place, and how fast? (H200 check)

    python3 bench/device/zero_copy_diag.py [OUT.json]

1. a pinned tensor passed as a Triton pointer argument;
2. the same bytes reached from a device tensor's pointer plus an element offset
   (how the paged kernel addresses host pages);
3. read bandwidth of (2) for 128 MiB, against a pinned cudaMemcpy of the same bytes;
4. the same in-place read from each kind of page-locked memory the host store can
   use (``SGLANG_RIMURU_HOST_PIN``): torch's pinned allocator (as in 1-3),
   ``register`` (plain memory, cudaHostRegister: the default) and ``hugepage``
   (2 MiB-aligned, transparent huge pages, registered). Decode with offloaded
   experts is bound by this read (bench/RESULTS.md).
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


def main() -> None:
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
