#!/usr/bin/env bash
# Source on the device machine from the repo root:  source bench/device/setup_device.sh
# Installs the SGLang carry (.carry, built by ../shared/device/make-sglang-carry.sh)
# and puts the project + device stand-ins on PYTHONPATH (no pip install there).
set -e
if [ ! -d /tmp/site/sglang ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/wheels/*.whl
    # sgl-kernel: the .tar.xz trim_carry.py writes (unpacked by Python: lzma is in its
    # standard library, the xz tool may not be on the image), or make-sglang-carry.sh's .tgz
    if [ -f .carry/sgl_kernel_sm90.tar.xz ]; then
        python3 -c 'import sys, tarfile; t = tarfile.open(sys.argv[1], "r:xz"); t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' \
            .carry/sgl_kernel_sm90.tar.xz /tmp/site || tar xJf .carry/sgl_kernel_sm90.tar.xz -C /tmp/site
    else
        tar xzf .carry/sgl_kernel_sm90.tgz -C /tmp/site
    fi
    [ -d /tmp/site/sgl_kernel ] || { echo "setup_device.sh: no sgl_kernel in /tmp/site after unpacking .carry (rebuild it: ../shared/device/make-sglang-carry.sh, bench/device/trim_carry.py)" >&2; return 1 2>/dev/null || exit 1; }
fi
export PYTHONPATH="$PWD/bench/device/site:/tmp/site:$PWD:$PWD/kernels:$PWD/patches:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the multi-GPU kinds (the device's KINDS.md: a program using
# it can put the host's shared GPUs out of service). The image sets these; they are set
# again here so that every server, rank and bench_serving child started from these scripts
# inherits them even where a caller's environment dropped them (SGLang's own NVLS and
# symmetric-memory paths are off by default too: --enable-nccl-nvls, --enable-symm-mem,
# --enable-torch-symm-mem).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Triton's compiled kernels survive only while the machine stays warm, and a cold
# start recompiles every paged-MoE config during graph capture (elastic's decode
# capture: 66 s against plain's 8 s on the H200). .carry/triton_cache_sm90.tgz, when
# there, seeds the cache; save_triton_cache (end of a script) leaves the cache in
# $OUT for the next session to put into .carry. Only the binaries travel: a cached
# kernel loads from its metadata JSON and .cubin (triton 3.6 compiler.py: CompiledKernel
# reads whatever files its group lists and still exist, and takes only asm["cubin"]), so
# the intermediate IR (.source .ttir .ttgir .llir .ptx, two thirds of the archive) is left
# out: both shapes' caches in 2.1 MB instead of 5.3.
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .carry/triton_cache_sm90.tgz ] && [ ! -f "$TRITON_CACHE_DIR/.seeded" ]; then
    tar xzf .carry/triton_cache_sm90.tgz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.seeded"
fi
save_triton_cache() {  # save_triton_cache [MAX_MB=10]: $OUT/triton_cache_sm90.tgz if small enough
    local max_mb=${1:-10} out=${OUT:-/tmp/out}
    tar czf /tmp/triton_cache_sm90.tgz -C "$TRITON_CACHE_DIR" --exclude=.seeded \
        --exclude='*.source' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' . \
        2>/dev/null || return 0
    local mb=$(( $(stat -c %s /tmp/triton_cache_sm90.tgz) >> 20 ))
    if [ "$mb" -le "$max_mb" ]; then cp /tmp/triton_cache_sm90.tgz "$out/"; else echo "triton cache ${mb} MiB: not saved"; fi
}
# flashinfer is a stand-in there: keep SGLang's flashinfer-only imports off
# (it still calls the stand-in's RMSNorm).
export SGLANG_IS_FLASHINFER_AVAILABLE=false
# SGLang flags that work there (DEVICE_NOTES.md): no flashinfer, no CUDA graph.
export RIMURU_DEVICE_FLAGS="--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --grammar-backend none --disable-overlap-schedule"
set +e
