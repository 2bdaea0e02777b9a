#!/usr/bin/env bash
# Sets up the environment (scripts/setup.sh) and runs the whole test suite on CPU.
# Extra arguments go to pytest, e.g. scripts/test.sh -k radix
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$("$root/scripts/setup.sh" | tail -n 1)"
cd "$root"
exec "$py" -m pytest -q -ra "$@"
