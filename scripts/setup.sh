#!/usr/bin/env bash
# Creates (once) the project's virtualenv and installs the project into it.
# Prints the venv's python path on the last line. Idempotent: a second run
# only re-links the editable install (seconds).
#   RIMURU_VENV   where the venv lives (default: ~/.cache/sglang-rimuru/venv)
#   PYTHON        the interpreter to build it with (default: python3, >= 3.10)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${RIMURU_VENV:-$HOME/.cache/sglang-rimuru/venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    echo "[setup] creating $venv" >&2
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip >&2
fi
echo "[setup] installing sglang-rimuru and its pinned dependencies into $venv (first time: ~4 min, ~9 GB)" >&2
log="$venv/setup.log"
if ! "$venv/bin/pip" install -q -e "$root[test]" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "[setup] pip install failed (full log: $log)" >&2
    exit 1
fi
echo "$venv/bin/python"
