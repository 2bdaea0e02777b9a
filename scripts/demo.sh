#!/usr/bin/env bash
# Sets up the environment, starts the server on the default model (the tiny
# Qwen3-MoE, generated on first use), answers a request over HTTP and over the
# OpenAI API, runs a frontend DSL program against it, and stops the server.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$("$root/scripts/setup.sh" | tail -n 1)"
port="${PORT:-30000}"
log="$(mktemp -t rimuru-server.XXXXXX.log)"
cd "$root"
echo "[demo] starting: python -m sglang_rimuru.launch_server --port $port (log: $log)"
setsid "$py" -m sglang_rimuru.launch_server --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true' EXIT
"$py" scripts/demo_client.py "http://127.0.0.1:$port" --wait 300 || { tail -n 40 "$log"; exit 1; }
