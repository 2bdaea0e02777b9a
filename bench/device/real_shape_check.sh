#!/usr/bin/env bash
# Real-shape serving on the lent H200 (issues 10 and 11), one call:
#   the paged kernel's host pages on CUDA (gpu tests), then the Qwen1.5-MoE-A2.7B
#   shape (dummy weights) on an emulated 32 GB card WITH CUDA graphs, served
#   off / static / elastic, each probed by serve_probe.py (greedy ids, a ~4.7k
#   token prefill, decode step times); static/elastic ids compared with off.
#   run from the repo root on the device, with .carry and .devdata carried
#   STAGES (default "tests off static elastic") picks the parts; GRAMMAR=1 adds
#   bench/grammar_check.py (every structured-output kind, refusals) on each server.
#   STATIC_SPLIT (the static stage's residency flags; Qwen1.5's 50 of 60 by default) and
#   ELASTIC_LIMIT (20) for other shapes; EXTRA_FLAGS="--tp-size 2" for TP=2 (issue 14).
#   off2: mode off again (the spread between two instances of one server, beside X/off ratios);
#   REPEATS=N measures each decode batch N times in rounds (serve_probe.py --repeats).
#   static_all_paged: static_all with SGLANG_RIMURU_PAGED_ONLY=1 (the paged kernel on layers
#   static mode otherwise hands to SGLang's own MoE in its layout).
#   static_fast / static_all_fast: static / static_all with --rimuru-moe-kernel fast
#   (the paged kernel's own configs, fused SiLU*up and top-k sum instead of SGLang's).
#   elastic_all / elastic_all_fast: elastic mode with every expert resident (offload limit 0), which
#   keeps the paged kernel (its residency may move), with --rimuru-moe-kernel exact / fast;
#   elastic_all_auto: the same with no kernel flag (the default, auto: fast where tuned).
#   A stage is skipped (and said so) when fewer than STAGE_S (170) seconds remain of
#   DEADLINE_S (560), so the summary (bench/device/probe_summary.py) always prints.
set -uo pipefail
START=$(date +%s)
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models
tar xzf .devdata/models.tgz -C /tmp/models
MODEL=${MODEL:-/tmp/models/q15}
STAGES=${STAGES:-"tests off static elastic"}
# SGLang's defaults on this machine, CUDA graphs on; the card emulated as SGLang sizes a 32 GB one
# (SGLang's default grammar backend, xgrammar 0.2.9 from the carry: GRAMMAR=1 checks structured output)
FLAGS="--attention-backend triton --sampling-backend pytorch --load-format dummy \
 --cuda-graph-max-bs ${MAX_BS:-64} --mem-fraction-static ${FRACTION:-0.2019} --chunked-prefill-size 2048 ${EXTRA_FLAGS:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

serve() {  # serve NAME PORT FLAGS...: start, wait for /health (stop early if it died)
    local name=$1; PORT=$2; shift 2
    t0=$(date +%s)
    setsid python3 -m sglang_rimuru.launch_server --model-path $MODEL $FLAGS --port $PORT "$@" \
        > "$OUT/$name.log" 2>&1 &
    server=$!
    for _ in $(seq 420); do
        kill -0 $server 2>/dev/null || { echo "$name server exited:"; grep -a -v Warn "$OUT/$name.log" | tail -25; return 1; }
        curl -sf http://127.0.0.1:$PORT/health >/dev/null && { echo "$name ready in $(( $(date +%s) - t0 )) s"; return 0; }
        sleep 1
    done
    echo "$name not ready"; return 1
}
peak_mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd/; }  # GPU0/GPU1 at TP=2
probe() {  # probe NAME: run serve_probe, keep the pool lines and GPU memory
    timeout ${PROBE_S:-150} python3 bench/device/serve_probe.py http://127.0.0.1:$PORT "$OUT/$1.json" \
        --batches ${BATCHES:-1,32} --repeats ${REPEATS:-1} 2>&1 | tail -${PROBE_LINES:-8}
    if [ "${GRAMMAR:-0}" = 1 ]; then
        timeout 120 python3 bench/grammar_check.py --url http://127.0.0.1:$PORT --refusals > "$OUT/$1_grammar.txt" 2>&1
        echo "$1 grammar check exit $? ($(grep -ac . "$OUT/$1_grammar.txt") lines):"; tail -4 "$OUT/$1_grammar.txt"
    fi
    echo "$1 GPU memory used: $(peak_mem) MiB; host RSS of the server's processes:" \
        "$(ps -o rss= -p "$(pgrep -d, -g $server)" | awk '{s+=$1} END {print int(s/1024)}') MiB"
    grep -a "sglang-rimuru .* pool:\|Traceback\|Error\|error" "$OUT/$1.log" | grep -av "warn" | head -6
}
run() { serve "$@" && probe $1; kill -- -$server 2>/dev/null; sleep 3; }

for stage in $STAGES; do
    left=$(( ${DEADLINE_S:-560} - ($(date +%s) - START) ))
    if [ "$stage" != tests ] && [ $left -lt ${STAGE_S:-170} ]; then
        echo "SKIP $stage: $left s left of DEADLINE_S=${DEADLINE_S:-560} (a server stage needs ~${STAGE_S:-170} s)"
        continue
    fi
    case $stage in
    tests)
        timeout 60 python3 bench/device/zero_copy_diag.py "$OUT/zero_copy_diag.json" 2>&1 | tail -4
        timeout 200 python3 -m pytest -q -p no:cacheprovider -x --tb=short tests/kernels/test_paged_moe.py \
            tests/experts/test_compute.py -k "host or gpu" 2>&1 | grep -av -i warn | tail -30 ;;
    off) run off 30000 ;;
    off2) run off2 30006 ;;  # a second plain server: how far two instances of the same one differ
    sweep) timeout ${SWEEP_S:-150} python3 bench/kernel/zero_copy_sweep.py --out "$OUT/zero_copy_sweep.json" \
        --budget-s $(( ${SWEEP_S:-150} - 40 )) 2>&1 | grep -av -i warn | tail -45 ;;
    static_all) run static_all 30003 --rimuru-mode static --rimuru-expert-offload-limit 0 ;;
    static_all_paged) SGLANG_RIMURU_PAGED_ONLY=1 run static_all_paged 30007 --rimuru-mode static \
        --rimuru-expert-offload-limit 0 ;;  # full layers on the paged kernel (before 70eb775's default)
    static_all_fast) run static_all_fast 30005 --rimuru-mode static --rimuru-expert-offload-limit 0 \
        --rimuru-moe-kernel fast ;;
    static) BATCHES=${STATIC_BATCHES:-${BATCHES:-1,32}} run static 30001 --rimuru-mode static \
        ${STATIC_SPLIT:---rimuru-resident-experts 50 --rimuru-expert-offload-limit 10} ;;
    static_fast) BATCHES=${STATIC_BATCHES:-${BATCHES:-1,32}} run static_fast 30004 --rimuru-mode static \
        --rimuru-resident-experts 50 --rimuru-expert-offload-limit 10 --rimuru-moe-kernel fast ;;
    elastic_all) run elastic_all 30008 --rimuru-mode elastic --rimuru-expert-offload-limit 0 \
        --rimuru-moe-kernel exact ;;
    elastic_all_fast) run elastic_all_fast 30009 --rimuru-mode elastic --rimuru-expert-offload-limit 0 \
        --rimuru-moe-kernel fast ;;
    elastic_all_auto) run elastic_all_auto 30010 --rimuru-mode elastic --rimuru-expert-offload-limit 0 ;;
    elastic) run elastic 30002 --rimuru-mode elastic --rimuru-expert-offload-limit ${ELASTIC_LIMIT:-20} \
        --rimuru-adjuster-trace "$OUT/elastic_trace.jsonl" ;;
    esac
done
python3 bench/device/probe_summary.py "$OUT"
echo "real_shape_check: $(( $(date +%s) - START )) s"
[ -f "$OUT/elastic_trace.jsonl" ] && wc -l "$OUT/elastic_trace.jsonl" && head -c 600 "$OUT/elastic_trace.jsonl"
