#!/usr/bin/env bash
# Issue 4 on the lent H200: elastic vs off under a burst with SGLang's
# batch-invariant mode (--enable-deterministic-inference) on both servers, so a
# request's greedy ids cannot depend on which requests share its forward pass.
# Both servers start at once (different ports). Writes $OUT/elastic_equal.json.
#   run from the repo root on the device, with .carry carried
set -uo pipefail
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m sglang_rimuru.models write tiny-qwen3-moe --out /tmp/models/tiny-qwen3-moe >/dev/null
MODEL=/tmp/models/tiny-qwen3-moe
DET="--enable-deterministic-inference --mem-fraction-static 0.3"
start() { setsid python3 -m sglang_rimuru.launch_server --model-path $MODEL $RIMURU_DEVICE_FLAGS $DET --port $2 "${@:3}" > "$OUT/$1.log" 2>&1 & }
start off 30000
start elastic 30001 --rimuru-mode elastic --rimuru-expert-offload-limit 4 --max-total-tokens 256 \
    --rimuru-adjuster-trace "$OUT/elastic_trace.jsonl"
for port in 30000 30001; do
    for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
python3 - "$OUT" <<'PY'
import json, sys, time, requests, concurrent.futures as cf
d = sys.argv[1]
def gen(port, text, n):
    r = requests.post(f"http://127.0.0.1:{port}/generate", json={"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=600)
    r.raise_for_status(); return r.json()
def work(port):
    prompts = [f"prompt {i}: " + "tokens " * (i % 5 + 1) + chr(65 + i) for i in range(16)]
    out = {"batch64": [o["output_ids"] for o in gen(port, [p + str(j) for j in range(4) for p in prompts], 8)]}
    t = time.time()
    with cf.ThreadPoolExecutor(32) as ex:
        out["burst32"] = [o["output_ids"] for o in ex.map(lambda i: gen(port, f"request {i}: " + "word " * 30, 24), range(32))]
    out["burst_s"] = time.time() - t
    return out
res = {}
try:
    o, e = work(30000), work(30001)
    time.sleep(4)
    trace = [json.loads(l) for l in open(f"{d}/elastic_trace.jsonl")]
    res = {k: {"requests_equal": sum(a == b for a, b in zip(o[k], e[k])), "of": len(o[k])} for k in ("batch64", "burst32")}
    res["burst_s"] = {"off": o["burst_s"], "elastic": e["burst_s"]}
    res["trace"] = {"lines": len(trace), "evicted": sum(len(t["evicted"]) for t in trace),
                    "restored": sum(len(t["restored"]) for t in trace),
                    "min_resident": min((t["resident"] for t in trace), default=None),
                    "final_resident": trace[-1]["resident"] if trace else None}
except Exception as exc:
    res["error"] = repr(exc)
json.dump(res, open(f"{d}/elastic_equal.json", "w"), indent=1)
print(json.dumps(res, indent=1))
PY
for f in off elastic; do echo "== $f"; grep -a -i "error\|Traceback\|deterministic" "$OUT/$f.log" | grep -v -i warn | tail -4; done
grep -a "sglang-rimuru round" "$OUT/elastic.log" | head -4 | cut -c1-250
pkill -f sglang_rimuru.launch_server
