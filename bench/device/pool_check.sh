#!/usr/bin/env bash
# Issues 3 and 4 on the lent H200, one call: the tiny Qwen3-MoE served
#   off / static (half the experts offloaded): same greedy ids on a fixed workload;
#   elastic under a burst in a small pool: the trace shows experts leaving and
#   coming back, the burst's greedy ids compared with mode off;
# then the gpu-marked kernel / expert tests. Writes $OUT/pool_check.json, logs, trace.
#   run from the repo root on the device, with .carry carried
set -uo pipefail
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m sglang_rimuru.models write tiny-qwen3-moe --out /tmp/models/tiny-qwen3-moe >/dev/null
MODEL=/tmp/models/tiny-qwen3-moe

serve() {  # serve NAME PORT FLAGS...: start, wait for /health, leave running
    local name=$1; PORT=$2; shift 2
    setsid python3 -m sglang_rimuru.launch_server --model-path $MODEL $RIMURU_DEVICE_FLAGS \
        --mem-fraction-static 0.3 --port $PORT "$@" > "$OUT/$name.log" 2>&1 &
    server=$!
    for _ in $(seq 400); do
        kill -0 $server 2>/dev/null || { echo "$name server exited:"; grep -a -v Warn "$OUT/$name.log" | tail -30; return 1; }
        curl -sf http://127.0.0.1:$PORT/health >/dev/null && return 0; sleep 1
    done
    return 1
}
collect() {  # collect NAME: greedy ids of the fixed workload and of a 32-request burst -> $OUT/NAME.json
    python3 - "$OUT/$1.json" $PORT <<'PY'
import json, sys, time, requests, concurrent.futures as cf
url = f"http://127.0.0.1:{sys.argv[2]}/generate"
def gen(text, n):
    r = requests.post(url, json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=600)
    r.raise_for_status(); return r.json()
prompts = [f"prompt {i}: " + "tokens " * (i % 5 + 1) + chr(65 + i) for i in range(16)]
out = {"single": gen("The unified page pool", 32)["output_ids"],
       "batch16": [o["output_ids"] for o in gen(prompts, 16)],
       "batch64": [o["output_ids"] for o in gen([p + str(j) for j in range(4) for p in prompts], 8)]}
t = time.time()
with cf.ThreadPoolExecutor(32) as ex:  # a burst of concurrent requests
    out["burst32"] = [o["output_ids"] for o in ex.map(lambda i: gen(f"request {i}: " + "word " * 30, 24), range(32))]
out["burst_s"] = time.time() - t
time.sleep(5)  # a quiet period: elastic brings the experts back
json.dump(out, open(sys.argv[1], "w"))
PY
}
run() { serve "$@" && collect $1; kill -- -$server 2>/dev/null; sleep 2; }
# a fresh port per server: the killed one may hold its port a moment longer
run off 30000
run static 30001 --rimuru-mode static --rimuru-resident-experts 4 --rimuru-expert-offload-limit 4
run elastic 30002 --rimuru-mode elastic --rimuru-expert-offload-limit 4 --max-total-tokens 256 \
    --rimuru-adjuster-trace "$OUT/elastic_trace.jsonl"
grep -a "sglang-rimuru .* pool:" "$OUT/static.log" "$OUT/elastic.log"
grep -a "sglang-rimuru round" "$OUT/elastic.log" | head -12
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
o, s, e = (json.load(open(f"{d}/{n}.json")) for n in ("off", "static", "elastic"))
def cmp(a, b):
    return {k: {"equal": a[k] == b[k], "requests_equal": sum(x == y for x, y in zip(a[k], b[k])) if isinstance(a[k][0], list) else None}
            for k in ("single", "batch16", "batch64", "burst32")}
trace = [json.loads(l) for l in open(f"{d}/elastic_trace.jsonl")]
res = {"static_vs_off": cmp(o, s), "elastic_vs_off": cmp(o, e),
       "burst_s": {"off": o["burst_s"], "static": s["burst_s"], "elastic": e["burst_s"]},
       "elastic_trace": {"lines": len(trace), "evicted": sum(len(t["evicted"]) for t in trace),
                         "restored": sum(len(t["restored"]) for t in trace),
                         "min_resident": min((t["resident"] for t in trace), default=None),
                         "final_resident": trace[-1]["resident"] if trace else None}}
json.dump(res, open(f"{d}/pool_check.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/experts -m gpu 2>&1 | grep -av -i warn | tail -15
