"""SGLang's bench_serving with its imports done ahead of the traffic.

``run_one.py`` starts this beside the server, so that the ~20 s bench_serving spends importing
SGLang (``sglang.benchmark.serving``: torch, transformers, SGLang's layers) pass while the server
starts instead of between its readiness and the traffic, once per phase of phased traffic. It
then reads one line from stdin, a JSON list of bench_serving's arguments, and runs its command
line (``cli_main``, what ``python -m sglang.bench_serving`` runs); a closed stdin ends it
without running anything.
"""

from __future__ import annotations

import json
import sys

from sglang.benchmark.serving import cli_main  # the import this process exists to do early


def main() -> None:
    line = sys.stdin.readline()
    if not line.strip():
        return
    sys.argv = ["bench_serving", *json.loads(line)]
    cli_main()


if __name__ == "__main__":
    main()
