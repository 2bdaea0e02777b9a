"""Tables and plots from bench/serving/run_one.py's JSON files.

    python3 bench/serving/report.py RESULT.json [...] [--plots DIR] [--baseline NAME]

Prints one markdown table (system, card, completed, duration, output tok/s,
TTFT and TPOT median / p99, peak running, peak GPU memory against the card,
the server's peak host RSS, evictions / restores) and, with ``--baseline NAME``, each system's ratios to
that system at each run's own rate (throughput, TTFT median, peak running, TPOT
median; ``NAME_rRATE`` against ``NAME-OF-BASELINE_rRATE``). ``--floor-step-ms
[MS]`` adds each run's duration against its traffic's floor (``makespan.py``:
below saturation the arrivals and the longest outputs, not the server, set the
duration). Phased runs (``run_one.py --phases``) get a second table, phase by phase,
each phase beside its own floor and the run beside the sum of them (the most any server
could serve that traffic over it); they have no one rate, so no place in the rate plot. ``--plots DIR``
writes PNGs (matplotlib; the H200 image has it): the pool split over time
(resident experts from the adjuster trace) beside the waiting queue, one per
elastic run, and output throughput / TTFT median against request rate when
runs of one system at several rates are given (names ``SYSTEM`` at the anchors'
10 req/s, ``SYSTEM_rRATE`` at other rates, as bench/serving/h200.sh names them).
``--targets``: issue 12's targets over the runs given (``targets.py``). Runs at
``--tp-size`` > 1 get a table of each GPU's peak and the ranks' adjuster traces
(``per_rank.py``: the same orders on every rank, issue 14).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

from code_digest import run_digest
from makespan import FASTEST_STEP_MS, LENS, floor, floor_of_run
from per_rank import rank_table
from targets import describe, gpu_of, over_card, same_requests, stopped_rate, targets_table, traffic_of


def load(paths: list[str]) -> list[dict]:
    """The runs' JSON, each with ``_dir``: where its side files (a phase's details) lie, and
    the server code it ran where the run predates its ``code_digest`` (code_digest.run_digest:
    ``code_digest_source`` says how it was recovered)."""
    runs = []
    for p in paths:
        path = Path(p).resolve()
        r = json.loads(path.read_text())
        r["_dir"] = str(path.parent)
        digest, source = run_digest(path, r)
        if digest and source != "run":
            r["code_digest"], r["code_digest_source"] = digest, source
        runs.append(r)
    return runs


def row(r: dict) -> str:
    b, lg, tr = r["bench"], r["log"], r.get("trace") or {}
    # "cut": the device call's timeout ended it (run_one.py's SIGTERM path), before its budget
    done = f"{b.get('completed', 0)}/{r['num_prompts']}" + (
        " (cut)" if r.get("cut") else " (stopped)" if r.get("stopped_at_budget") else "")
    # the card emulation's check (the process's peak against the card), said in the row;
    # "capped": torch's allocator was held to the card (run_one.py --card-cap)
    mem = (f"{r['peak_process_mib'] / 1024:.1f} / {r['card_gib']:.0f}" + (" **over the card**" if over_card(r) else "")
           + (" (capped)" if r.get("card_cap") else ""))
    host = f"{r['peak_host_rss_mib'] / 1024:.1f}" if "peak_host_rss_mib" in r else "-"
    moves = f"{tr.get('evicted', 0)} / {tr.get('restored', 0)}" if tr else "-"
    # a run stopped at its budget has no bench_serving summary: the elastic step record's
    # passes (every token, prefill passes carrying decodes included), else SGLang's decode log
    if "output_throughput" in b:
        tput = f"{b['output_throughput']:.0f}"
    else:
        rate, source = stopped_rate(r)
        tput = f"~{rate or 0:.0f} ({source})"
    return (f"| {r['name']} | {r['card_gib']:.0f} GB | {done} | {b.get('duration', 0):.1f} | "
            f"{tput} | {b.get('median_ttft_ms', 0) / 1e3:.2f} / "
            f"{b.get('p99_ttft_ms', 0) / 1e3:.2f} | {b.get('median_tpot_ms', 0):.2f} / {b.get('p99_tpot_ms', 0):.2f} | "
            f"{lg['peak_running']} | {mem} | {host} | {moves} |")


def table(results: list[dict]) -> str:
    head = ("| system | card | completed | duration s | output tok/s | TTFT med / p99 s | TPOT med / p99 ms | "
            "peak running | peak GPU GiB (process) / card | host RSS GiB | evicted / restored |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *(row(r) for r in results)])


# h200.sh names a run at another rate than 10 req/s NAME_rRATE; RATE=inf (every request sent at
# once, bench_serving's saturation) gives NAME_rinf
RATE_SUFFIX = re.compile(r"_r(?:[0-9.]+|inf)$")


def rate_series(results: list[dict]) -> dict[str, list[dict]]:
    """The rate plot's lines: each system's finished runs (names without their ``_rRATE``),
    for systems run at more than one rate. A phased run has no one rate to plot at; a run
    stopped at its budget has no bench_serving throughput or TTFT (the rate a log gives it is
    another measure, for the tables only)."""
    by_system = defaultdict(list)
    for r in results:
        if r.get("rate") is not None and "output_throughput" in r.get("bench", {}):
            by_system[RATE_SUFFIX.sub("", r["name"])].append(r)
    return {s: rs for s, rs in by_system.items() if len({r["rate"] for r in rs}) > 1}


def rate_positions(rates: list[float]) -> tuple[list[float], list[float], list[str]]:
    """x positions for the rate plots, and their ticks: a finite rate at itself, ``inf`` (all at
    once) one step past the largest finite rate (twice it), labelled so."""
    top = max([r for r in rates if r != float("inf")], default=10.0)
    xs = [2 * top if r == float("inf") else r for r in rates]
    label = {x: "all at once" if r == float("inf") else f"{r:g}" for r, x in zip(rates, xs)}
    ticks = sorted(label)
    return xs, ticks, [label[t] for t in ticks]


def baseline_for(r: dict, baseline: str) -> str:
    """The run ``r`` is compared with: the baseline system at ``r``'s own rate (``BASE_rRATE``
    for ``NAME_rRATE``). Throughput below saturation is the traffic's, so a ratio across
    rates says nothing about the systems."""
    m = RATE_SUFFIX.search(r["name"])
    return baseline + (m.group(0) if m else "")


def ratios(results: list[dict], baseline: str) -> str:
    by_name = {r["name"]: r for r in results}
    if not any(baseline_for(r, baseline) in by_name for r in results):  # the baseline's own run maps to it
        raise SystemExit(f"no result named {baseline!r} (or {baseline}_rRATE)")

    def ratio(a, b):
        return f"{a / b:.2f}x" if b else "-"

    lines = [f"| vs {baseline} at the same rate | output tok/s | TTFT median | peak running | TPOT median |",
             "|---|---|---|---|---|"]
    for r in results:
        base = by_name.get(baseline_for(r, baseline))
        if base is None:
            lines.append(f"| {r['name']} | no {baseline_for(r, baseline)} | - | - | - |")
            continue
        b, bb = r["bench"], base["bench"]
        if "output_throughput" not in b or "output_throughput" not in bb:
            # one side stopped at its budget: no bench_serving summary, so both sides' own
            # decode-log rates (SGLang's, steady decode only: kinder to the slower side)
            a, z = r["log"].get("gen_tok_s_mean"), base["log"].get("gen_tok_s_mean")
            tput = f"~{ratio(a, z)} (decode log)" if a and z else "-"
            lines.append(f"| {r['name']} | {tput} | - | "
                         f"{ratio(r['log']['peak_running'], base['log']['peak_running'])} | - |")
            continue
        lines.append(f"| {r['name']} | {ratio(b.get('output_throughput', 0), bb.get('output_throughput', 0))} | "
                     f"{ratio(b.get('median_ttft_ms', 0), bb.get('median_ttft_ms', 0))} | "
                     f"{ratio(r['log']['peak_running'], base['log']['peak_running'])} | "
                     f"{ratio(b.get('median_tpot_ms', 0), bb.get('median_tpot_ms', 0))} |")
    return "\n".join(lines)


_FLOORS: dict[tuple, object] = {}


def floor_of(r: dict, step_ms: float, lens: Path):
    """``makespan.floor_of_run``, once per traffic, step and lens file (the floor table and
    the rate plot both ask; each floor replays the run's whole traffic)."""
    key = (r.get("rate"), r.get("num_prompts"), r.get("seed"), r.get("bench", {}).get("total_output_tokens"),
           step_ms, str(lens))  # all floor_of_run reads of the run
    if key not in _FLOORS:
        _FLOORS[key] = floor_of_run(r, step_ms, lens)
    return _FLOORS[key]


def floors(results: list[dict], step_ms: float, lens: Path) -> str:
    """Each run's duration beside the traffic's floor (makespan.py): the share of the
    throughput any server could reach on that traffic that the run reached."""
    lines = [f"| system | duration s | floor s (decode step {step_ms:g} ms) | set by request (output tokens) | "
             "output tok/s | ceiling tok/s | of the ceiling |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if "output_throughput" not in r["bench"]:  # stopped at its budget: no duration to set beside it
            lines.append(f"| {r['name']} | - | - (no bench_serving summary) | - | - | - | - |")
            continue
        f = floor_of(r, step_ms, lens)
        if f is None:
            why = "phased traffic" if r.get("phases") else "not the lens file's sample"
            lines.append(f"| {r['name']} | {r['bench'].get('duration', 0):.1f} | - ({why}) | - | - | - | - |")
            continue
        tput = r["bench"]["output_throughput"]
        lines.append(f"| {r['name']} | {r['bench']['duration']:.1f} | {f.makespan_s:.1f} | #{f.binding} "
                     f"({f.binding_output}) | {tput:.0f} | {f.ceiling_tok_s:.0f} | {tput / f.ceiling_tok_s:.0%} |")
    return "\n".join(lines)


def phase_details(r: dict, i: int) -> dict | None:
    """bench_serving's per-request details of phase ``i`` (run_one.py --phases writes them
    beside the JSON as NAME_bench_phaseI.jsonl; bench/results keeps them gzipped), or None."""
    for name in (f"{r['name']}_bench_phase{i}.jsonl", f"{r['name']}_bench_phase{i}.jsonl.gz"):
        f = Path(r.get("_dir", ".")) / name
        if f.exists():
            text = gzip.open(f, "rt").read() if f.suffix == ".gz" else f.read_text()
            return json.loads(text.strip().splitlines()[-1])
    return None


def phase_table(results: list[dict], step_ms: float = FASTEST_STEP_MS) -> str:
    """Phased runs (run_one.py --phases), phase by phase: bench_serving's figures for each,
    and each phase's traffic floor (makespan.py: its arrivals, at the run's seed, and its own
    requests' output lengths, at the fastest decode step). A phase near its floor was bounded
    by its arrivals, not the server; the run's duration over the sum of its phases' floors is
    the most any server could serve this traffic above this run's throughput."""
    lines = ["| system | phase | rate req/s | completed | duration s | output tok/s | TTFT med / p99 s | "
             f"TPOT med / p99 ms | floor s (step {step_ms:g} ms) | duration / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bounds = []
    for r in results:
        floors_s = []
        for i, p in enumerate(r.get("phases") or [], 1):
            det = phase_details(r, i)
            f = floor(det["output_lens"], p["rate"], r.get("seed", 1), step_ms) if det and det.get("output_lens") else None
            floors_s.append(f.makespan_s if f else None)
            fl = f"{f.makespan_s:.1f} | {p.get('duration', 0) / f.makespan_s:.2f}x" if f else "- | -"
            lines.append(f"| {r['name']} | {i} | {p['rate']:g} | {p.get('completed', 0)}/{p['num_prompts']} | "
                         f"{p.get('duration', 0):.1f} | {p.get('output_throughput', 0):.0f} | "
                         f"{p.get('median_ttft_ms', 0) / 1e3:.2f} / {p.get('p99_ttft_ms', 0) / 1e3:.2f} | "
                         f"{p.get('median_tpot_ms', 0):.2f} / {p.get('p99_tpot_ms', 0):.2f} | {fl} |")
        dur = r.get("bench", {}).get("duration")
        if floors_s and None not in floors_s and dur:
            bounds.append(f"- {r['name']}: its phases' floors sum to {sum(floors_s):.1f} s against its "
                          f"{dur:.1f} s, so no server serves this traffic at more than "
                          f"{dur / sum(floors_s):.2f}x its output throughput")
    return "\n".join(lines + ([""] + bounds if bounds else []))


def steps(results: list[dict]) -> str:
    """The decode steps each elastic run timed (run_one's ``steps``), by batch, beside what
    the cost model of its last order prices them at (base + per request x batch + per read
    x expected offloaded reads): where they part, the price of one more request is off.
    ``GPU ms``: the median GPU time of the decode passes of that batch (records since
    ``pass_timer.py``): well under the step's wall time, the CPU held the step."""
    lines = ["| system | batch | steps | median ms | GPU ms | model ms (last fit) | mean expected reads |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        cost = (r.get("trace") or {}).get("cost_ms")
        for lo, hi, n, ms, b, reads, *rest in r.get("steps") or []:
            model = f"{cost['base'] + cost['per_request'] * b + cost['expert'] * reads:.2f}" if cost else "-"
            gpu = f"{rest[0]:.2f}" if rest and rest[0] is not None else "-"
            lines.append(f"| {r['name']} | {lo}-{hi} | {n} | {ms:.2f} | {gpu} | {model} | {reads:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else "(no run has a per-step record)"


def plots(results: list[dict], out: Path, step_ms: float | None = None, lens: Path = LENS) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    for r in results:
        series = (r.get("trace") or {}).get("series")
        if not series:
            continue
        cols = list(zip(*series))  # t, resident experts, waiting requests[, expert pages split for KV]
        t, resident, waiting = cols[:3]
        fig, (ax, ax3) = plt.subplots(2, 1, figsize=(8, 5), sharex=True, height_ratios=[2, 1])
        ax.step(t, resident, where="post", label="resident experts")
        ax.set_ylabel("resident experts")
        if len(cols) > 3:
            ax2 = ax.twinx()
            ax2.step(t, cols[3], where="post", color="tab:green", alpha=0.7, label="expert pages holding KV")
            ax2.set_ylabel("expert pages holding KV")
        ax3.step(t, waiting, where="post", color="tab:red", label="waiting requests")
        ax3.set_ylabel("waiting requests")
        ax3.set_xlabel("s since the first change (the adjuster trace: one point per change)")
        ax.set_title(f"{r['name']} ({r.get('code_digest') or '?'}): the pool's split and the queue")
        fig.tight_layout()
        # named as bench/results/plots keeps them: one setting at two server codes is two plots,
        # and a run on another GPU than the tables' H200 says so (one setting, code and two GPUs)
        gpu = "" if (name := gpu_of(r)) == "H200" else f"{name}_"
        path = out / f"{r['name']}_split_{gpu}{r.get('code_digest') or 'nocode'}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    made += token_plots(results, out, plt)
    by_system = rate_series(results)
    if by_system:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        # every run's rate has a place: the ceiling below is drawn at each, plotted line or not
        every = sorted({r["rate"] for r in results if r.get("rate") is not None})
        xs, ticks, labels = rate_positions(every)
        x_of = dict(zip(every, xs))
        for system, rs in sorted(by_system.items()):
            rs.sort(key=lambda r: r["rate"])
            rates = [x_of[r["rate"]] for r in rs]
            a1.plot(rates, [r["bench"].get("output_throughput", 0) for r in rs], marker="o", label=system)
            a2.plot(rates, [r["bench"].get("median_ttft_ms", 0) / 1e3 for r in rs], marker="o", label=system)
        if step_ms:  # what any server could reach on each rate's traffic (makespan.py)
            ceil = {}
            for r in results:
                f = floor_of(r, step_ms, lens)
                if f is not None:
                    ceil[x_of[r["rate"]]] = f.ceiling_tok_s
            if ceil:
                a1.plot(sorted(ceil), [ceil[k] for k in sorted(ceil)], color="grey", linestyle="--",
                        marker="x", label=f"the traffic's ceiling (step {step_ms:g} ms)")
        for a in (a1, a2):
            a.set_xticks(ticks, labels)
            a.set_xlabel("request rate (req/s)")
        a1.set_ylabel("output tok/s")
        a2.set_ylabel("TTFT median (s)")
        a1.legend()
        fig.tight_layout()
        path = out / "rate_sweep.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    return made


def token_plots(results: list[dict], out: Path, plt) -> list[Path]:
    """Output tokens against seconds from the traffic's start (window.py's timelines), one
    plot for each set of requests two or more runs with a timeline served (either routing:
    SGLang's offloader copies the same bytes whatever it), a line a run. Where the lines
    cross says more than a ratio of two windows' means: SGLang's offloader admits its queue
    before it decodes, a pool mode decodes from the first seconds."""
    groups: list[list[dict]] = []
    for r in results:
        if (r.get("timeline") or {}).get("points"):
            group = next((g for g in groups if same_requests(traffic_of(g[0]), traffic_of(r))), None)
            group.append(r) if group else groups.append([r])
    made = []
    for rs in sorted(groups, key=lambda g: str(traffic_of(g[0]))):
        traffic = traffic_of(rs[0])
        model, card, rate, num, gpu = traffic.model, traffic.card, traffic.rate, traffic.num, traffic.gpu
        if len(rs) < 2 or rate is None:  # phased traffic has no one rate to name it by
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        names = [r["name"] for r in rs]
        for r in sorted(rs, key=lambda r: (r["name"], r.get("code_digest") or "")):
            pts = [[0.0, 0]] + r["timeline"]["points"]
            # one run's name twice (the same setting at two server codes): the code tells them apart
            code = f", {r.get('code_digest') or '?'}" if names.count(r["name"]) > 1 else ""
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".",
                    label=f"{r['name']} ({r['timeline']['source']}{code})")
        ax.set_xlabel("s since the traffic's first request")
        ax.set_ylabel("output tokens")
        ax.set_title(f"output tokens as the traffic goes on: {describe(traffic, routing=False)}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"tokens_{model}_{card:g}GB_r{rate:g}_x{num}_{gpu}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--baseline")
    ap.add_argument("--plots")
    ap.add_argument("--floor-step-ms", type=float, nargs="?", const=FASTEST_STEP_MS,
                    help=f"add each run's traffic floor (makespan.py) at this fastest decode step "
                         f"(default {FASTEST_STEP_MS} ms, plain SGLang's at batch 1)")
    ap.add_argument("--lens", default=str(LENS), help="[prompt_len, output_len] per request, bench order")
    ap.add_argument("--targets", action="store_true",
                    help="issue 12's targets over these runs (targets.py): pairs, ratios, verdicts, code digests")
    ap.add_argument("--steps", action="store_true",
                    help="the decode steps elastic runs timed, by batch, beside their cost model's price")
    args = ap.parse_args()
    if args.floor_step_ms and not Path(args.lens).exists():  # else every run would read as another sample
        raise SystemExit(f"--floor-step-ms needs the lens file: {args.lens} does not exist (--lens FILE)")
    results = load(args.results)
    print(table(results))
    if tp := rank_table(results):  # runs at --tp-size > 1: each rank's card and trace
        print()
        print(tp)
    if any(r.get("phases") for r in results):
        print()
        print(phase_table(results, args.floor_step_ms or FASTEST_STEP_MS))
    if args.baseline:
        print()
        print(ratios(results, args.baseline))
    if args.floor_step_ms:
        print()
        print(floors(results, args.floor_step_ms, Path(args.lens)))
    if args.steps:
        print()
        print(steps(results))
    if args.targets:
        print()
        print(targets_table(results, args.floor_step_ms or FASTEST_STEP_MS, Path(args.lens)))
    if args.plots:
        for p in plots(results, Path(args.plots), args.floor_step_ms, Path(args.lens)):
            print("wrote", p)


if __name__ == "__main__":
    main()
