"""Talks to a running sglang-rimuru server: /generate, OpenAI, and a DSL program.

Usage: python scripts/demo_client.py http://127.0.0.1:30000 [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import sys

import requests
import sglang as sgl

from sglang_rimuru.serving import ServerNotReady, wait_healthy


@sgl.function
def plan_trip(s, city):
    s += f"Plan a day in {city}.\nMorning: " + sgl.gen("morning", max_tokens=12, temperature=0)
    s += "\nTransport: " + sgl.select("transport", choices=["walk", "bike", "tram"])
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f"\nEvening option {i + 1}: " + sgl.gen("evening", max_tokens=8, temperature=0)
    branches.join()
    s["evenings"] = [b["evening"] for b in branches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--wait", type=float, default=0, help="seconds to wait for /health")
    args = parser.parse_args()
    if args.wait:
        try:
            wait_healthy(args.url, args.wait)
        except ServerNotReady as exc:
            sys.exit(str(exc))

    out = requests.post(
        args.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        timeout=120,
    ).json()
    print(f"/generate -> {len(out['output_ids'])} tokens: {out['text']!r}")

    chat = requests.post(
        args.url + "/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 12},
        timeout=120,
    ).json()
    print(f"/v1/chat/completions -> {chat['choices'][0]['message']['content']!r}")

    state = plan_trip.run(city="Kyoto", backend=sgl.RuntimeEndpoint(args.url))
    print(f"DSL gen -> {state['morning']!r}")
    print(f"DSL select -> {state['transport']!r}")
    print(f"DSL fork -> {state['evenings']!r}")
    print("(the default model has random weights: the text is noise; the ids are deterministic)")


if __name__ == "__main__":
    main()
