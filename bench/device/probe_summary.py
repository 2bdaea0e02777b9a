"""Summarize serve_probe.py results: ids vs off, decode step times, prefill, and the ratios between servers.

    python3 bench/device/probe_summary.py DIR [DIR ...] [--out summary.json]

Reads ``NAME.json`` for every server name below from the DIRs (the first DIR
holding a name wins), so the results of two device calls can be summarized
together. Prints one block per comparison and writes everything to --out
(default: DIR/probe_summary.json of the first DIR).

Ratios are times over times (< 1: the first server is faster): ``fast/exact``
is the paged kernel's own path over SGLang's arithmetic on the same pool
(``--rimuru-moe-kernel fast`` vs ``exact``); ``X/off`` is against plain SGLang.
A decode batch whose requests need more KV tokens than the server holds
(``kv_tokens_needed`` > ``max_total_num_tokens``) ran as smaller batches; its
ratios are marked ``*``.
"""

from __future__ import annotations

import argparse
import json
import os

#: every server real_shape_check.sh starts, in its order
NAMES = ("off", "off2", "static_all", "static_all_paged", "static_all_fast", "static", "static_fast",
         "elastic_all", "elastic_all_fast", "elastic_all_auto", "elastic")
#: (numerator, denominator, label)
PAIRS = (
    ("static_all_fast", "static_all", "fast/exact, every expert resident"),
    ("static_fast", "static", "fast/exact, experts offloaded"),
    ("off2", "off", "off2/off: a second plain SGLang server, the spread between instances"),
    ("static_all", "off", "static_all/off"),
    ("static_all", "off2", "static_all/off2"),
    ("static_all_paged", "off", "static_all_paged/off (the paged kernel on full layers, SGLANG_RIMURU_PAGED_ONLY=1)"),
    ("static_all", "static_all_paged", "SGLang's own MoE on the pool / the paged kernel, every expert resident"),
    ("static_all_fast", "off", "static_all_fast/off"),
    ("static", "off", "static/off"),
    ("static_fast", "off", "static_fast/off"),
    ("elastic_all", "off", "elastic_all/off (every expert resident, the exact paged kernel)"),
    ("elastic_all_fast", "off", "elastic_all_fast/off (every expert resident, the fast paged kernel)"),
    ("elastic_all_fast", "elastic_all", "fast/exact, elastic, every expert resident"),
    ("elastic_all_auto", "off", "elastic_all_auto/off (every expert resident, the default kernel: auto)"),
    ("elastic", "off", "elastic/off"),
)


def load(dirs: list[str]) -> dict[str, dict]:
    res = {}
    for name in NAMES:
        for d in dirs:
            path = os.path.join(d, f"{name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    res[name] = json.load(f)
                res[name]["_from"] = path
                break
    return res


def decode_by_batch(r: dict) -> dict[int, dict]:
    return {x["batch"]: x for x in r.get("decode", []) if x.get("step_ms_median")}


def fits(r: dict, d: dict) -> bool:
    """The batch's requests fit in the server's KV at once (unknown counts as fitting)."""
    cap = (r.get("server") or {}).get("max_total_num_tokens")
    need = d.get("kv_tokens_needed")
    return cap is None or need is None or need <= cap


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(res: dict[str, dict]) -> dict:
    out: dict = {"servers": {}, "ids_vs_off": {}, "ratios": {}}
    for n, r in res.items():
        out["servers"][n] = {
            "from": r["_from"],
            "max_total_num_tokens": (r.get("server") or {}).get("max_total_num_tokens"),
            "decode_ms_per_step": {b: round(d["step_ms_median"], 3) for b, d in decode_by_batch(r).items()},
            "decode_round_spread": {b: d["round_spread"] for b, d in decode_by_batch(r).items() if "round_spread" in d},
            "decode_fits_kv": {b: fits(r, d) for b, d in decode_by_batch(r).items()},
            "long_prefill_s": (r.get("long") or {}).get("s"),
            "long_prompt_tokens": (r.get("long") or {}).get("prompt_tokens"),
            "errors": r.get("errors"),
        }
    if "off" in res:
        a = res["off"]
        for n, b in res.items():
            if n == "off":
                continue
            out["ids_vs_off"][n] = {
                "short_equal": a.get("short_ids") == b.get("short_ids"),
                "long_equal": (a.get("long") or {}).get("ids") == (b.get("long") or {}).get("ids"),
                "batch16_equal": sum(x == y for x, y in zip(a.get("batch16_ids", []), b.get("batch16_ids", []))),
            }
    for num, den, label in PAIRS:
        if num not in res or den not in res:
            continue
        dn, dd = decode_by_batch(res[num]), decode_by_batch(res[den])
        decode = {}
        for b in sorted(set(dn) & set(dd)):
            decode[b] = {"ratio": ratio(dn[b]["step_ms_median"], dd[b]["step_ms_median"]),
                         "both_fit_kv": fits(res[num], dn[b]) and fits(res[den], dd[b])}
        ln, ld = res[num].get("long") or {}, res[den].get("long") or {}
        out["ratios"][label] = {
            "decode": decode,
            "long_prefill": ratio(ln.get("s"), ld.get("s")),
            "long_prompt_tokens_equal": ln.get("prompt_tokens") == ld.get("prompt_tokens"),
            "greedy_short_ids_equal": res[num].get("short_ids") == res[den].get("short_ids"),
        }
    return out


def fmt(x, f="{:.3f}"):
    return "n/a" if x is None else f.format(x)


def show(s: dict) -> None:
    for n, v in s["ids_vs_off"].items():
        print(f"{n} vs off: short ids equal {v['short_equal']} | long ids equal {v['long_equal']} | "
              f"batch16 equal {v['batch16_equal']} / 16")
    for n, v in s["servers"].items():
        marks = {b: f"{ms}{'' if v['decode_fits_kv'][b] else '*'}" for b, ms in v["decode_ms_per_step"].items()}
        print(f"{n}: decode ms/step {marks} | long prefill {fmt(v['long_prefill_s'])} s "
              f"({v['long_prompt_tokens']} tokens) | KV {v['max_total_num_tokens']} tokens | errors {v['errors']}"
              + (f" | spread over rounds { {b: fmt(x) for b, x in v['decode_round_spread'].items()} }"
                 if v.get("decode_round_spread") else ""))
    for label, v in s["ratios"].items():
        dec = ", ".join(f"{b}: {fmt(x['ratio'])}{'' if x['both_fit_kv'] else '*'}" for b, x in v["decode"].items())
        print(f"{label}: decode per batch {{{dec}}} | long prefill {fmt(v['long_prefill'])}"
              f"{'' if v['long_prompt_tokens_equal'] else ' (different prompt lengths)'} | "
              f"short ids equal {v['greedy_short_ids_equal']}")
    print("(ratio = time / time: < 1 means the first is faster; * = the batch did not fit in one server's KV)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = summarize(load(args.dirs))
    show(s)
    out = args.out or os.path.join(args.dirs[0], "probe_summary.json")
    with open(out, "w") as f:
        json.dump(s, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
