#!/usr/bin/env bash
# Issue 13 item 4 in one device call (< 10 min; device tool: carry [".carry"], timeout_s 600):
#   1. tune SGLang 0.5.17's fused_moe_kernel with the paged kernel's tuner (same grid, inputs, CUDA-graph
#      timing and pick; tune_paged_moe.py --kernel sglang) for Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B,
#      writing SGLang-format tables under $OUT/sglang_tuned (SGLANG_MOE_CONFIG_DIR layout);
#   2. the kernel bench (bench_moe_kernels.py) with SGLang's path four ways beside the paged kernel:
#      pieces / whole fused_experts_impl (what serving runs), each with SGLang's configs and the tuned ones.
# Budgets: the tuner stops timing new sizes after TUNE_S (240) seconds, its compile phase included; the
# bench gets what is left of DEADLINE_S (570) and saves its JSON after every size. Qwen1.5 first.
# Run from the repo root:  bash bench/kernel/sglang_compare.sh
set -uo pipefail
START=$(date +%s)
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-570}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader

timeout $(( DEADLINE_S - 150 )) python3 bench/kernel/tune_paged_moe.py --kernel sglang --shapes Qwen1.5 Qwen3 \
    --out-dir "$OUT/sglang_tuned" --workers ${WORKERS:-14} --budget-s ${TUNE_S:-240} 2>&1 \
    | grep -av "Warning:\|warnings.warn\|Config file not found\|Using default MoE kernel config" | tail -40
echo "tuner done at $(( $(date +%s) - START )) s; tables: $(find "$OUT/sglang_tuned" -name 'E=*.json' | wc -l)"

left=$(( DEADLINE_S - ($(date +%s) - START) ))
[ $left -lt 90 ] && { echo "only $left s left for the bench (the tuner overran): giving it 90"; left=90; }
timeout $(( left - 5 )) python3 bench/kernel/bench_moe_kernels.py --shapes Qwen1.5 Qwen3 --no-transfers --no-step \
    --sglang-tuned-dir "$OUT/sglang_tuned" --budget-s $(( left - 45 )) --out "$OUT/kernel_bench_sglang_tuned.json" \
    ${BENCH_FLAGS:-} 2>&1 | grep -av "Warning:\|warnings.warn\|Config file not found\|Using default MoE kernel config" \
    | tail -100
echo "sglang_compare: $(( $(date +%s) - START )) s"
