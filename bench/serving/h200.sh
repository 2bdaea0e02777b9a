#!/usr/bin/env bash
# ShareGPT serving runs on the lent H200, one device call (repo root, carry .carry and .devdata).
#   RUNS="static32 elastic32" bash bench/serving/h200.sh
# Each name below is one system and setting (bench/serving/run_one.py); the JSON,
# server log and adjuster trace of each land in $OUT. RATE / NUM / BUDGET override
# the traffic (default: the anchors' 500 ShareGPT requests at 10 req/s, seed 1; SEED too).
set -uo pipefail
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/models
[ -d /tmp/models/q15 ] || tar xzf .devdata/models.tgz -C /tmp/models
RATE=${RATE:-10}; NUM=${NUM:-500}; BUDGET=${BUDGET:-300}; SEED=${SEED:-1}  # the light-load anchor: RATE=1 NUM=60 SEED=2
SKEW=${SKEW:-0}  # > 0: skewed dummy routers (bench/serving/skew); the run names get "-skew"
# NOISE: 0 to 1, that share of each token's router logits drawn fresh every forward (1: independent
# routings, where dummy weights route by the token alone: bench/serving/dummy_routing.py); names get "-ind"
NOISE=${NOISE:-0}
PHASES=${PHASES:-}  # RATE:NUM,... : phased traffic (bench/serving/phases.py; overrides RATE and NUM; names get "_ph")
CARD_CAP=${CARD_CAP:-}  # 1: torch's allocator held to the card in every server (run_one.py --card-cap; names get "_cap")
# EXTRA: more server flags for every run of the call, e.g. EXTRA="--decode-log-interval 10" (SGLang's
# decode log line every 10 steps instead of 40: a server stopped at its budget leaves more lines)
EXTRA=${EXTRA:-}
# this GPU's MiB: the denominator of every fraction below (run_one.py does the same), so that
# an H100 lent for the H200 (81,559 MiB) emulates the same card
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
TOTAL_MIB=${TOTAL_MIB:-143771}
of_gpu() { python3 -c "print(round(min(0.9, ($1) / $TOTAL_MIB), 5))"; }  # MiB -> this GPU's fraction
# A rate other than the anchors' 10 req/s tags the name NAME_rRATE (RATE=inf: every request sent
# at once, bench_serving's saturation, NAME_rinf; report.py's rate plots;
# the device tool returns no file whose name holds '@').
# RANKING=FILE: pool-mode runs rank experts by it (--rimuru-expert-ranking); the run
# "rank" ("q3rank": the Qwen3-30B-A3B shape) measures one (python -m sglang_rimuru.rank,
# 200 ShareGPT prompts of the anchors' file, the routers skewed as SKEW says) into
# $OUT/ranking_q15_skewS.json (ranking_q3_skewS.json)
# and points RANKING at it for the runs after it in the same call.
RANKING=${RANKING:-}; [ -n "$RANKING" ] && RANKING=$(realpath "$RANKING")  # the server may start elsewhere
# START_S: the server's start, before its BUDGET of traffic (q3offload runs: 342 s at 7f20a2d,
# weights copied to pinned host memory 172 s, graph capture 112 s)
start_limit() {  # start_limit RUN
    # tp2*: Qwen3-30B-A3B at TP=2 (issue 14), never run yet: Qwen3's single-GPU starts (elastic
    # 210-230 s, SGLang's offload 436 s for 34 GB) with each rank holding half of it
    # offload24_*: SGLang's offload at 24 GB, 237.6 s cold at 20 GiB (twenty-seventh session:
    # weights pinned 70.7 s, prefill graph capture replaying the copies 69.4 s)
    case $1 in q3offload*) echo "${START_S:-420}" ;; offload24_*) echo "${START_S:-260}" ;; tp2off*) echo "${START_S:-360}" ;; tp2*) echo "${START_S:-240}" ;;
    *) echo "${START_S:-200}" ;; esac
}
RANK_S=400  # rank's server and its 200 prompts
one() {  # one NAME CARD_GB MODEL -- FLAGS...
    local name=$1 card=$2 model=$3; shift 4
    [ "$SKEW" != 0 ] && name="$name-skew"
    [ "$NOISE" != 0 ] && name="$name-ind"
    [ -z "$PHASES" ] && [ "$RATE" != 10 ] && name="${name}_r$RATE"
    [ -n "$PHASES" ] && name="${name}_ph"  # phased traffic: one name per system (report.py's phase table)
    [ -n "$CARD_CAP" ] && name="${name}_cap"  # torch's allocator held to the card (run_one.py --card-cap)
    case " $* " in *" --rimuru-mode "*) [ -n "$RANKING" ] && set -- "$@" --rimuru-expert-ranking "$RANKING" ;; esac
    local start; start=$(start_limit "$name")
    timeout $(( BUDGET + start )) python3 bench/serving/run_one.py --name "$name" --model /tmp/models/$model \
        --card-gb "$card" --rate "$RATE" --num-prompts "$NUM" --seed "$SEED" --out "$OUT" --budget-s "$BUDGET" --skew "$SKEW" --router-noise "$NOISE" \
        ${PHASES:+--phases "$PHASES"} ${CARD_CAP:+--card-cap} \
        --dataset .devdata/sharegpt_1000_seed1_ctx8192.json.gz -- "$@" $EXTRA 2>&1 | grep -av "Warning\|warn(" | tail -3
}
# staticCCrN: static on a CC GB card with N of 60 experts resident per layer (the sweep).
# Ablation on the 32 GB card: static32 (the pool alone, a fixed split), elastic32copy
# (+ the adjuster; offloaded experts copied into load buffers before use, which
# reads routing on the host, so no CUDA graphs), elastic32 (+ the paged kernel
# reading offloaded experts in place from host pages, what lets decode run graphed).
rank() {  # rank MODEL: the measured ranking of that shape (q15 or q3) under this SKEW
    local model=$1 out="$OUT/ranking_$1_skew$SKEW$([ "$NOISE" != 0 ] && echo _ind).json" fraction; fraction=$(of_gpu 29027)  # the 32 GB card's budget
    # routing does not depend on the budget: Qwen3-30B-A3B's 57 GiB need a larger one in mode off
    [ "$model" = q3 ] && fraction=$(of_gpu 86263)  # 0.6 of the H200: at most 0.9 of a smaller GPU
    python3 - > /tmp/rank_prompts.json <<'PY'
import gzip, json
convs = json.load(gzip.open(".devdata/sharegpt_1000_seed1_ctx8192.json.gz"))
print(json.dumps([c["conversations"][0]["value"] for c in convs[:200]]))
PY
    PYTHONPATH="$PWD/bench/serving/skew:$PYTHONPATH" RIMURU_BENCH_ROUTER_SKEW=$SKEW RIMURU_BENCH_ROUTER_NOISE=$NOISE RIMURU_BENCH_DEVICE_SITE=1 \
        timeout $RANK_S python3 -m sglang_rimuru.rank --model-path /tmp/models/$model --out "$out" \
        --prompts /tmp/rank_prompts.json --concurrency 32 -- --load-format dummy --mem-fraction-static $fraction \
        --chunked-prefill-size 2048 --attention-backend triton --sampling-backend pytorch --grammar-backend none \
        2>&1 | grep -av "Warning\|warn(" | tail -4
    [ -s "$out" ] && RANKING=$out && echo "RANKING=$RANKING"
}
# the longest these runs can take (each server's start limit plus its budget, rank's 400 s, ~45 s
# of setup), said up front where it passes a device call's 600 s: the call's timeout would cut
# the last run (run_one.py keeps what it measured, marked "cut"), so split such a call
worst=45
for run in ${RUNS:-static32 elastic32}; do
    case $run in rank|q3rank) worst=$(( worst + RANK_S )) ;; *) worst=$(( worst + BUDGET + $(start_limit "$run") )) ;; esac
done
[ "$worst" -gt 600 ] && echo "h200.sh: these runs may take up to $worst s, past a device call's 600 s"
for run in ${RUNS:-static32 elastic32}; do
    case $run in
    rank) rank q15 ;;
    q3rank) rank q3 ;;  # the Qwen3-30B-A3B shape's: only q3 runs may follow it in the call
    static32r*) n=${run#static32r}; one "$run" 32 q15 -- --rimuru-mode static --rimuru-resident-experts "$n" --rimuru-expert-offload-limit $(( 60 - n )) ;;
    static24r*) n=${run#static24r}; one "$run" 24 q15 -- --rimuru-mode static --rimuru-resident-experts "$n" --rimuru-expert-offload-limit $(( 60 - n )) ;;
    elastic32l*) n=${run#elastic32l}; one "$run" 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit "$n" ;;
    elastic24l*) n=${run#elastic24l}; one "$run" 24 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit "$n" ;;
    elastic32cl*) n=${run#elastic32cl}; one "$run" 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit "$n" --rimuru-adjuster-policy cost ;;
    elastic32s*) n=${run#elastic32s}; one "$run" 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-load-buffer-slots "$n" ;;
    elastic32cs*) n=${run#elastic32cs}; one "$run" 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-load-buffer-slots "$n" --rimuru-adjuster-policy cost ;;
    elastic32f) one elastic32f 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-moe-kernel fast ;;
    elastic32cf) one elastic32cf 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-adjuster-policy cost --rimuru-moe-kernel fast ;;
    elastic24cf) one elastic24cf 24 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 24 --rimuru-adjuster-policy cost --rimuru-moe-kernel fast ;;
    # issue 12's Qwen3-30B-A3B target on one 32 GB card (54 GiB of experts, 9 MiB each, 128 a layer):
    # SGLang --cpu-offload-gb N (the anchor: N = 32), static with N of 128 resident, elastic
    # q3offload32_GB_lessMIB: the same with SGLang's static budget MIB below the card's rule, the
    # room a user gives it so that its prefill graphs and layer copies fit (with the rule's budget it
    # ran out of memory at start under the card's cap, thirteenth session)
    q3offload32_*_less*) gb=${run#q3offload32_}; less=${gb#*_less}; gb=${gb%%_less*}
        one "$run" 32 q3 -- --cpu-offload-gb "$gb" \
            --mem-fraction-static "$(of_gpu "0.886 * 32768 - $less")" ;;
    q3offload32_*) gb=${run#q3offload32_}; one "$run" 32 q3 -- --cpu-offload-gb "$gb" ;;
    # the anchor with SGLang's mixed chunked prefill: the choice the pool modes make while experts are out
    q3offload32m) one q3offload32m 32 q3 -- --cpu-offload-gb 32 --enable-mixed-chunk ;;
    q3static32r*) n=${run#q3static32r}; one "$run" 32 q3 -- --rimuru-mode static --rimuru-resident-experts "$n" --rimuru-expert-offload-limit $(( 128 - n )) ;;
    q3elastic32)  one q3elastic32 32 q3 -- --rimuru-mode elastic --rimuru-expert-offload-limit 112 ;;
    # issue 14 (nvidia-h200-x2): Qwen3-30B-A3B at TP=2 on two 24 GB cards (27 GiB of experts per rank)
    tp2off)     one tp2off 24 q3 -- --tp-size 2 --cpu-offload-gb 12 ;;
    tp2static)  one tp2static 24 q3 -- --tp-size 2 --rimuru-mode static --rimuru-resident-experts 80 --rimuru-expert-offload-limit 48 ;;
    tp2elastic) one tp2elastic 24 q3 -- --tp-size 2 --rimuru-mode elastic --rimuru-expert-offload-limit 64 ;;
    elastic32copy) one elastic32copy 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-load-buffer-slots 20 --rimuru-zero-copy-max-tokens 0 --disable-cuda-graph ;;
    offload24_*) gb=${run#offload24_}; one "$run" 24 q15 -- --cpu-offload-gb "$gb" ;;
    off32)      one off32 32 q15 -- ;;
    static32)   one static32 32 q15 -- --rimuru-mode static --rimuru-resident-experts 50 --rimuru-expert-offload-limit 10 ;;
    elastic32)  one elastic32 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 ;;  # the defaults: cost policy, buffers for what is out at start (elastic32c before it was the default)
    elastic32p) one elastic32p 32 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 20 --rimuru-adjuster-policy paper --rimuru-load-buffer-slots 20 ;;  # elastic32 of 2026-12-01
    static24)   one static24 24 q15 -- --rimuru-mode static --rimuru-resident-experts 36 --rimuru-expert-offload-limit 24 ;;
    elastic24)  one elastic24 24 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 24 ;;
    # elastic with no limit flag: the default (all but one a layer under the cost policy)
    elastic24d) one elastic24d 24 q15 -- --rimuru-mode elastic ;;
    q3elastic32d) one q3elastic32d 32 q3 -- --rimuru-mode elastic ;;
    # ... with the CPU split (--rimuru-cpu-experts 0.PP of each layer's offloaded experts on the
    # host's CPUs in decode passes; sglang_rimuru/experts/cpu_split.py): elastic24dcpu25, q3elastic32dcpu25;
    # elastic24dcpuauto, q3elastic32dcpuauto: --rimuru-cpu-experts auto (the balancing count)
    elastic24dcpuauto) one "$run" 24 q15 -- --rimuru-mode elastic --rimuru-cpu-experts auto ;;
    q3elastic32dcpuauto) one "$run" 32 q3 -- --rimuru-mode elastic --rimuru-cpu-experts auto ;;
    # ... in-place reads (and the split's passes) up to 512 tokens, not 128: Qwen3's decode passes
    # past the decode graphs' 160 (on default.json a uniform Qwen3 pass of up to ~500 tokens gives
    # each expert one BLOCK_SIZE_M block, so in place reads each offloaded expert once, as a copy does)
    q3elastic32dz512) one "$run" 32 q3 -- --rimuru-mode elastic --rimuru-zero-copy-max-tokens 512 ;;
    q3elastic32dcpuautoz512) one "$run" 32 q3 -- --rimuru-mode elastic --rimuru-cpu-experts auto \
        --rimuru-zero-copy-max-tokens 512 --rimuru-cpu-max-tokens 512 ;;
    # ... the split up to 512 tokens on the copy path (in place stays at 128: past it the copies read
    # Qwen3's offloaded experts at 52.9 GB/s where in-place reads move 40.6, forty-third session)
    q3elastic32dcpuautoc512) one "$run" 32 q3 -- --rimuru-mode elastic --rimuru-cpu-experts auto \
        --rimuru-cpu-max-tokens 512 ;;
    elastic24dcpu*) one "$run" 24 q15 -- --rimuru-mode elastic --rimuru-cpu-experts "0.${run#elastic24dcpu}" ;;
    q3elastic32dcpu*) one "$run" 32 q3 -- --rimuru-mode elastic --rimuru-cpu-experts "0.${run#q3elastic32dcpu}" ;;
    # ... with SGLang's mixed chunked prefill: each prefill pass carries the running decodes, so a
    # pass that reads every offloaded expert once also advances every running request
    q3elastic32dm) one q3elastic32dm 32 q3 -- --rimuru-mode elastic --enable-mixed-chunk ;;
    # ... with the kernel's own tables, fused SiLU*up and top-k sum (issue 13 item 5): at uniform
    # Qwen3 a serving step read in place at 36 GB/s where the same reads alone, on those tables, ran at 52
    q3elastic32df) one q3elastic32df 32 q3 -- --rimuru-mode elastic --rimuru-moe-kernel fast ;;
    elastic24p) one elastic24p 24 q15 -- --rimuru-mode elastic --rimuru-expert-offload-limit 24 --rimuru-adjuster-policy paper --rimuru-load-buffer-slots 24 ;;
    offload24)  one offload24 24 q15 -- --cpu-offload-gb 8 ;;
    *) echo "unknown run $run" ;;
    esac
done
save_triton_cache  # for .carry next session (setup_device.sh)
