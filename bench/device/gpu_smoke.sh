#!/usr/bin/env bash
# GPU check of the foundation on the lent H200: the launcher serves the tiny
# Qwen3-MoE, answers /generate (twice: greedy ids must match), the OpenAI API
# and a frontend DSL program. Writes $OUT/smoke.json, server.log, client.txt.
#   run from the repo root on the device, with .carry carried
set -uo pipefail
source bench/device/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m sglang_rimuru.models write tiny-qwen3-moe --out /tmp/models/tiny-qwen3-moe
t0=$(date +%s)
setsid python3 -m sglang_rimuru.launch_server --model-path /tmp/models/tiny-qwen3-moe \
    $RIMURU_DEVICE_FLAGS --mem-fraction-static 0.3 --port 30000 ${EXTRA_FLAGS:-} > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 400); do  # wait for /health, but stop at once if the server died
    kill -0 $server 2>/dev/null || { echo "server exited:"; grep -a -v Warn "$OUT/server.log" | tail -20; exit 1; }
    curl -sf http://127.0.0.1:30000/health >/dev/null && break; sleep 1
done
python3 scripts/demo_client.py http://127.0.0.1:30000 2>&1 | tee "$OUT/client.txt"
t1=$(date +%s)
python3 - "$OUT" "$t0" "$t1" <<'PY'
import json, sys, time, requests
out, t0, t1 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
url = "http://127.0.0.1:30000"
body = {"text": ["The capital of France is", "MoE on a GPU"], "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
runs = []
for _ in range(2):
    s = time.perf_counter(); r = requests.post(url + "/generate", json=body, timeout=300).json(); e = time.perf_counter() - s
    runs.append({"seconds": round(e, 3), "output_ids": [o["output_ids"] for o in r]})
info = requests.get(url + "/model_info", timeout=30).json()
res = {"model_path": info.get("model_path"), "start_to_first_reply_s": t1 - t0, "runs": runs,
       "greedy_identical": runs[0]["output_ids"] == runs[1]["output_ids"]}
json.dump(res, open(f"{out}/smoke.json", "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "runs"}), [r["seconds"] for r in runs])
print("ids[0][:12] =", runs[0]["output_ids"][0][:12])
PY
grep -a "seams installed" "$OUT/server.log"
kill -- -$server 2>/dev/null
