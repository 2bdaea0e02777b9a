#!/usr/bin/env bash
# Source on the device machine from the repo root:  source bench/device/setup_device.sh
# Installs the SGLang carry (.carry, built by ../shared/device/make-sglang-carry.sh)
# and puts the project + device stand-ins on PYTHONPATH (no pip install there).
set -e
if [ ! -d /tmp/site/sglang ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/wheels/*.whl
    tar xzf .carry/sgl_kernel_sm90.tgz -C /tmp/site
fi
export PYTHONPATH="$PWD/bench/device/site:/tmp/site:$PWD:$PWD/kernels:$PWD/patches:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
# flashinfer is a stand-in there: keep SGLang's flashinfer-only imports off
# (it still calls the stand-in's RMSNorm).
export SGLANG_IS_FLASHINFER_AVAILABLE=false
# SGLang flags that work there (DEVICE_NOTES.md): no flashinfer, no CUDA graph.
export RIMURU_DEVICE_FLAGS="--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --grammar-backend none --disable-overlap-schedule"
set +e
