"""Why requests decoding on dummy weights route alike, and what that costs the in-place reads.

    python3 bench/serving/dummy_routing.py --model /tmp/models/q15 \
        --dataset .devdata/sharegpt_1000_seed1_ctx8192.json.gz [--num 16,35,64,120] [--out-experts 17] \
        [--skew 1 [--layers 24]] [--device cuda --dtype bfloat16] [--out FILE]

Every served benchmark runs ``--load-format dummy``. SGLang's ``initialize_dummy_weights``
seeds each parameter's generator with the same seed (1234) and fills it uniform in ±1e-3, so
parameters of one size hold the same values: the embedding and the LM head are one matrix,
every layer's router is the same, every RMSNorm weight the same. At that scale a layer adds
~1e-12 to a residual of ~6e-4 (the token's embedding), so a token's hidden state is its
embedding at every layer: its routing depends on the token alone (and is the same in every
layer), and so does its greedy successor. Requests whose prompts end in the same token ('.'
ends 51 of the anchors' first 150) then decode the same tokens and route alike for their whole
output, which real weights, whose next token depends on the context, do not do.

The paged kernel reads an offloaded expert from host memory once per BLOCK_SIZE_M of its
tokens (bench/RESULTS.md, thirty-fourth session), so routings shared by many requests cost
re-reads at BLOCK_SIZE_M 16 that BLOCK_SIZE_M 64 avoids: the thirty-fifth session's served gain
of BM 64, which random routings do not show. This replays the dummy model's decode on the CPU
(embedding, final norm, one router: what the routing depends on) for the first N requests of
the anchors' traffic (``--num``: batches), all starting together, and counts over the offloaded
experts (``--out-experts``: the highest ids, as elastic's trace leaves them at 24 GB; with
``--skew s``, the benchmark's skewed routers, each layer's coldest) the ones a step hits and its
reads at BM 16 and BM 64, a layer's mean, against N random tokens: independent routings, what
the cost model's expected reads assume and the closer model of real weights, whose next token
follows a request's whole context. Shared routings cut both ways: fewer distinct experts hit
at small batches (fewer reads than real traffic would make), more re-reads at BM 16 at large
ones. CPU by default (fp32, ~1.3 GB at Qwen1.5's vocabulary, ~45 s; ``--device cuda --dtype
bfloat16``: the GPU's generator and the served dtype); needs torch, the model's tokenizer
(transformers) and the kernel package (``zero_copy_scale.host_reads`` counts the reads), no SGLang.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))
from zero_copy_scale import host_reads  # noqa: E402  (an expert routed n tokens: ceil(n / BLOCK_SIZE_M) reads)

SEED, LOW, HIGH = 1234, -1e-3, 1e-3  # SGLang's initialize_dummy_weights defaults


def dummy_values(numel: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What SGLang's dummy init puts in any float parameter of ``numel`` elements of ``dtype``
    on ``device`` (a generator of that device seeded alike for every parameter, as SGLang's):
    the values depend on the size alone."""
    g = torch.Generator(device=device).manual_seed(SEED)
    return torch.empty(numel, device=device, dtype=dtype).uniform_(LOW, HIGH, generator=g)


def skew_law(skew: float):
    """``bench/serving/skew``'s standardization and per-layer bias at ``skew`` (its module,
    loaded here without its import hook: this process serves nothing)."""
    import importlib.util
    import os

    # the module installs its hook where these are set: unset while it loads, then as they were
    saved = {var: os.environ.pop(var, None) for var in ("RIMURU_BENCH_ROUTER_SKEW", "RIMURU_BENCH_ROUTER_NOISE")}
    try:
        spec = importlib.util.spec_from_file_location("rimuru_bench_skew_law",
                                                      Path(__file__).parent / "skew" / "sitecustomize.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.environ.update({var: value for var, value in saved.items() if value is not None})
    module.SKEW = skew  # what _bias reads
    return module


class DummyDecode:
    """The dummy model's decode as far as routing goes: hidden = RMSNorm(embedding of the
    token) (eps left out: it scales a token's hidden state by one positive factor, which moves
    neither a top-k nor an argmax), routing = top-k of the router, next token = argmax of the
    LM head, which is the embedding. With ``skew`` the benchmark's skewed routers
    (``bench/serving/skew``): the logits standardized, then each layer's bias, so layers differ
    (``layers`` of them are counted); without, every layer routes as the first."""

    def __init__(self, vocab: int, hidden: int, num_experts: int, top_k: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, skew: float = 0.0, layers: int = 4):
        self.embed = dummy_values(vocab * hidden, device, dtype).view(vocab, hidden)
        self.norm = dummy_values(hidden, device, dtype)
        self.router = dummy_values(num_experts * hidden, device, dtype).view(num_experts, hidden)
        self.num_experts, self.top_k, self.device = num_experts, top_k, device
        self.law = skew_law(skew) if skew > 0 else None
        self.layers = list(range(layers)) if self.law else [0]

    def bias(self, layer: int) -> torch.Tensor | None:
        return None if self.law is None else self.law._bias(layer, self.num_experts, "cpu", torch.float32)

    def out_set(self, layer: int, count: int) -> list[int]:
        """The ``count`` experts of ``layer`` elastic would hold on the host: under skew the
        coldest by the layer's bias (what a ranking of this routing keeps out), else the highest
        ids (what the 24 GB trace shows without a ranking)."""
        bias = self.bias(layer)
        if bias is None:
            return list(range(self.num_experts - count, self.num_experts))
        return sorted(torch.argsort(bias)[:count].tolist())

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens.to(self.device)].float()  # RMSNorm in fp32, as SGLang's, then the weights' dtype
        return (x * x.pow(2).mean(-1, keepdim=True).rsqrt() * self.norm.float()).to(self.embed.dtype)

    def route(self, tokens: torch.Tensor, layer: int = 0) -> torch.Tensor:
        logits = (self.hidden(tokens) @ self.router.T).float().cpu()
        if self.law is not None:
            logits = self.law.skewed_logits(logits, self.bias(layer))
        return torch.topk(logits, self.top_k, dim=-1).indices

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.hidden(tokens) @ self.embed.T).float().argmax(-1).cpu()


def row(model: DummyDecode, tokens: torch.Tensor, out_experts: int) -> dict:
    """One step's routing of ``tokens`` counted, a layer's mean, over each layer's
    ``out_experts`` offloaded ones: distinct ones hit (the reads an unbounded BLOCK_SIZE_M
    would make), reads at BM 16 and 64."""
    counts = {"out_hit": 0, "reads_bm16": 0, "reads_bm64": 0, "max_tokens_on_an_expert": 0}
    for layer in model.layers:
        ids, out = model.route(tokens, layer), model.out_set(layer, out_experts)
        for key, bm in (("out_hit", 1 << 30), ("reads_bm16", 16), ("reads_bm64", 64)):
            counts[key] += host_reads(ids, out, bm)
        counts["max_tokens_on_an_expert"] += int(torch.bincount(ids.reshape(-1), minlength=model.num_experts).max())
    return {"distinct_tokens": len(set(tokens.tolist())), **{k: v / len(model.layers) for k, v in counts.items()}}


def replay(model: DummyDecode, first: torch.Tensor, steps: int, out_experts: int) -> list[dict]:
    """Rows for ``steps`` decode steps of requests whose prompts end in ``first``."""
    rows, tokens = [], first
    for _ in range(steps):
        tokens = model.step(tokens)
        rows.append(row(model, tokens, out_experts))
    return rows


def mean_of(rows: list[dict]) -> dict:
    return {k: round(sum(r[k] for r in rows) / len(rows), 2) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model folder (config.json and tokenizer)")
    ap.add_argument("--dataset", required=True, help="the anchors' ShareGPT file (.json or .json.gz)")
    ap.add_argument("--num", default="16,35,64,120",
                    help="batches: the first N requests decoding together, comma separated (35: the 32 GB "
                         "card's at 10 req/s; 120: a full 24 GB batch)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps averaged (a dummy request's tokens "
                                                         "cycle with period 1 or 2)")
    ap.add_argument("--out-experts", type=int, default=17, help="offloaded experts a layer (the highest ids; "
                                                                "17 of 60: the 24 GB trace's)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="the benchmark's skewed routers at this s (bench/serving/skew); the offloaded "
                         "experts are then each layer's coldest")
    ap.add_argument("--layers", type=int, default=24, help="with --skew: the layers counted (each its own bias)")
    ap.add_argument("--device", default="cpu", help="cuda: the GPU's generator and bf16 arithmetic, as served")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    model = DummyDecode(cfg["vocab_size"], cfg["hidden_size"], num_experts, cfg["num_experts_per_tok"],
                        args.device, getattr(torch, args.dtype), skew=args.skew,
                        layers=args.layers)
    tok = AutoTokenizer.from_pretrained(args.model)
    nums = [int(n) for n in args.num.split(",")]
    opener = gzip.open if args.dataset.endswith(".gz") else open
    with opener(args.dataset, "rt") as f:
        convs = json.load(f)[: max(nums)]
    last = torch.tensor([tok(c["conversations"][0]["value"])["input_ids"][-1] for c in convs])
    rand = torch.randint(0, cfg["vocab_size"], (max(nums),), generator=torch.Generator().manual_seed(0))
    ends = torch.unique(last, return_counts=True)
    top = sorted(zip(ends[1].tolist(), ends[0].tolist()), reverse=True)[:3]
    print(f"first {max(nums)} requests: {len(ends[0])} distinct last prompt tokens; most common: "
          + ", ".join(f"{tok.decode([t])!r} x{n}" for n, t in top)
          + f"; {args.out_experts} of {num_experts} experts a layer offloaded"
          + (f" (each layer's coldest, skew {args.skew:g}, {len(model.layers)} layers)" if args.skew else "")
          + f"; means over {args.steps} steps; "
          f"{args.dtype} on {args.device}")
    print("| batch | distinct tokens: traffic / random | most tokens on an expert | offloaded experts hit "
          "| reads at BM 16 | BM 16 / BM 64 reads |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in nums:
        served = mean_of(replay(model, last[:n], args.steps, args.out_experts))
        random_ = mean_of(replay(model, rand[:n], args.steps, args.out_experts))
        rows.append({"batch": n, "traffic": served, "random": random_})
        pair = lambda k: f"{served[k]:g} / {random_[k]:g}"  # noqa: E731
        print(f"| {n} | {pair('distinct_tokens')} | {pair('max_tokens_on_an_expert')} | {pair('out_hit')} | "
              f"{pair('reads_bm16')} | {served['reads_bm16'] / served['reads_bm64']:.2f}x / "
              f"{random_['reads_bm16'] / random_['reads_bm64']:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "skew": args.skew,
                                              "out_experts": args.out_experts,
                                              "steps": args.steps, "rows": rows,
                                              "last_token_counts": top}, indent=1))


if __name__ == "__main__":
    main()
