#!/usr/bin/env bash
# Issue 3's GPU check on the lent H200: the tiny Qwen3-MoE served in mode off
# and in --rimuru-mode static (half the experts offloaded) must give the same
# greedy token ids; the paged kernel and expert-manager gpu tests run too.
# Writes $OUT/static_check.json and both server logs.
#   run from the repo root on the device, with .carry carried
set -uo pipefail
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m sglang_rimuru.models write tiny-qwen3-moe --out /tmp/models/tiny-qwen3-moe >/dev/null
MODEL=/tmp/models/tiny-qwen3-moe

serve() {  # serve NAME FLAGS...: start, wait for /health, leave running
    local name=$1; shift
    setsid python3 -m sglang_rimuru.launch_server --model-path $MODEL $RIMURU_DEVICE_FLAGS \
        --mem-fraction-static 0.3 --port 30000 "$@" > "$OUT/$name.log" 2>&1 &
    server=$!
    for _ in $(seq 400); do
        kill -0 $server 2>/dev/null || { echo "$name server exited:"; grep -a -v Warn "$OUT/$name.log" | tail -30; return 1; }
        curl -sf http://127.0.0.1:30000/health >/dev/null && return 0; sleep 1
    done
    return 1
}
collect() {  # collect NAME: greedy ids for a fixed workload -> $OUT/NAME.json
    python3 - "$OUT/$1.json" <<'PY'
import json, sys, requests
url = "http://127.0.0.1:30000/generate"
def gen(text, n):
    r = requests.post(url, json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=600)
    r.raise_for_status(); return r.json()
prompts = [f"prompt {i}: " + "tokens " * (i % 5 + 1) + chr(65 + i) for i in range(16)]
out = {"single": gen("The unified page pool", 32)["output_ids"],
       "batch16": [o["output_ids"] for o in gen(prompts, 16)],
       "batch64": [o["output_ids"] for o in gen([p + str(j) for j in range(4) for p in prompts], 8)]}
json.dump(out, open(sys.argv[1], "w"))
PY
}
serve off && collect off; kill -- -$server 2>/dev/null; sleep 3
serve static --rimuru-mode static --rimuru-resident-experts 4 --rimuru-expert-offload-limit 4 && collect static
grep -a "sglang-rimuru static pool" "$OUT/static.log"
kill -- -$server 2>/dev/null
python3 - "$OUT" <<'PY'
import json, sys
o, s = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("off", "static"))
res = {k: {"equal": o[k] == s[k], "first_diff": next((i for i, (a, b) in enumerate(zip(o[k], s[k])) if a != b), None)} for k in o}
json.dump(res, open(f"{sys.argv[1]}/static_check.json", "w"), indent=1)
print("static == off:", res)
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/experts -m gpu 2>&1 | tail -5
