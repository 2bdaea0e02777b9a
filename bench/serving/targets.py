"""Issue 12's targets from run_one.py's JSON: each target, the runs it compares, the ratio, the verdict.

    python3 bench/serving/report.py RUN.json [...] --targets

Runs are paired by traffic (model, card, routing, rate or phases, requests, seed: the same
requests at the same arrival times) and by system, read from the run's name as
``bench/serving/h200.sh`` names them: ``off`` (plain SGLang), ``offload`` (SGLang's
``--cpu-offload-gb``), ``static``, ``elastic``, each ``q3``-prefixed for the Qwen3-30B-A3B
shape. Against several runs of one baseline system on a traffic, the best of them counts
(the issue's "best ``--cpu-offload-gb`` setting", "best static budget"). Throughput is
bench_serving's; where either side of a pair stopped at its budget (no bench_serving
summary), that side's pass record (pool modes) or SGLang decode-log mean stands in, set
against the other side's bench_serving figure if it finished, marked ``~`` with both
sources. A throughput target below its threshold says what the traffic allows
(``makespan.py``: no server beats the traffic's floor), where the baseline's traffic is the
lens file's. A target with no pair among the runs is listed as not measured. Where a
traffic has an ``elastic32copy`` run (the adjuster copying experts into load buffers), the
ablation row sets static (pool only), it (+ adjuster) and elastic (+ paged kernel) side by
side against plain. Against SGLang's offload settings that stopped, the pair is taken over the
same first seconds of the traffic where both runs have a timeline (``window.py``,
``offload_pair``), with the setting's fastest decode line beside. Each GPU's runs pair only
with each other (``gpu_of``). Where plain SGLang stopped on its traffic's last request
decoding alone and the elastic run finished, its whole-traffic throughput is bounded from
that request's remaining output (``lone_tail_ceiling``), which bounds the ratio from below.

The last lines say which server code each run ran (``code_digest.py``): the issue wants
its tables from runs at one commit, which one digest across the runs shows. A run from
before the digest existed shows the digest of the commit its folder or name records
(``code_digest.run_digest``), marked ``*``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from makespan import FASTEST_STEP_MS, LENS, LENS_SEED, floor, floor_of_run, load_outputs, load_requests
from offload_sweep import model_of, offload_gb, sweep
from window import along, same_window

SYSTEM = re.compile(r"^(?P<q3>q3)?(?P<system>offload|off|static|elastic)")


def system_of(r: dict) -> str | None:
    """The system a run's name says; ``elastic_copy`` for the ablation's middle step (h200.sh's
    ``elastic32copy``: the adjuster with offloaded experts copied into load buffers, no paged
    reads, no graphs), which is not elastic mode as shipped and so pairs with no target."""
    m = SYSTEM.match(r["name"])
    if not m:
        return None
    return "elastic_copy" if m.group("system") == "elastic" and "copy" in r["name"] else m.group("system")


def gpu_of(r: dict) -> str:
    """The GPU a run ran on, short (``H200``, ``H100``): run_one.py writes it since the
    twenty-seventh session; every run before ran on the H200 (their folders say so). A card
    emulated on an H100 is the same budget on slower memory and another host's PCIe, so its
    runs pair only with each other."""
    name = (r.get("gpu") or {}).get("name") or "H200"
    return m.group(0) if (m := re.search(r"[A-Z]\d{2,3}", name)) else name


class Traffic(NamedTuple):
    """What two runs must share to be compared: the requests and their arrival times (model,
    card, rate or phases, requests, seed), the GPU, and the routing (skewed or not, and the
    share of fresh draws in each token's router logits: ``--router-noise``)."""
    model: str
    card: float
    skew: bool
    rate: float | None
    phases: tuple | None
    num: int | None
    seed: int
    gpu: str
    noise: float = 0.0


def traffic_of(r: dict) -> Traffic:
    phases = tuple((p["rate"], p["num_prompts"]) for p in r.get("phases") or []) or None
    return Traffic(model_of(r), r["card_gib"], bool(r.get("router_skew")), r.get("rate"), phases,
                   r.get("num_prompts"), r.get("seed", 1), gpu_of(r), float(r.get("router_noise") or 0.0))


def same_requests(a: Traffic, b: Traffic) -> bool:
    """Two traffics (traffic_of) of the same requests at the same arrival times on one card,
    model and GPU, whatever their routing."""
    return a._replace(skew=False, noise=0.0) == b._replace(skew=False, noise=0.0)


def describe(traffic: Traffic, routing: bool = True) -> str:
    t = traffic
    load = ("phases " + ",".join(f"{p:g}:{n}" for p, n in t.phases)) if t.phases else (
        f"all at once x {t.num}" if t.rate == float("inf") else f"{t.rate:g} req/s x {t.num}")
    noise = ("" if not t.noise else " (independent routings)" if t.noise == 1 else f" (router noise {t.noise:g})")
    return (f"{t.card:g} GB, {'Qwen3-30B-A3B' if t.model == 'q3' else 'Qwen1.5-MoE'}, "
            + (f"{'skewed' if t.skew else 'uniform'}{noise}, " if routing else "")
            + load + (f", seed {t.seed}" if t.seed != 1 else "") + (f", on an {t.gpu}" if t.gpu != "H200" else ""))


def over_card(r: dict) -> bool:
    """The card emulation's check: the process's (or the GPU's) peak above the emulated card."""
    peak = max(r.get("peak_process_mib", 0), r.get("peak_gpu_mib") or 0)
    return r["card_gib"] > 0 and peak > r["card_gib"] * 1024


def done(r: dict) -> bool:
    return "output_throughput" in r.get("bench", {})


def never_served(r: dict) -> bool:
    """A run ended (its budget, or the device call's timeout) before its traffic held two
    requests at once: bench_serving's lone warm-up request at most. Its decode log's rate
    is that one request's, no measure of the system under the traffic, so no pair takes
    it (the twenty-seventh session's ``offload24_20``: 238 s of start left 34 s, which
    the warm-up took at 2.5 tok/s)."""
    return not done(r) and (r.get("num_prompts") or 0) > 1 and r.get("log", {}).get("peak_running", 0) <= 1


def no_traffic_rate(r: dict) -> bool:
    """A stopped run whose window held its traffic (two requests or more at once) but no
    decode of it: SGLang's decode log from the traffic's start is empty and there is no pass
    record (the twenty-eighth session's ``q3offload32_50_less2560_cap``: its 75 s of traffic
    went to prefill, ~1 s a 2,048-token pass, 466 requests admitted, none decoded yet). It
    has no rate to pair; its lone step still bounds what it could serve (``whole_run_ceiling``)."""
    return not done(r) and not never_served(r) and stopped_rate(r)[0] is None


def whole_run_floor(r: dict, lens: Path = LENS):
    """``makespan.floor`` of a stopped run's traffic at its own lone decode step (see
    whole_run_ceiling), or None where unknown."""
    step = (r.get("log") or {}).get("lone_step_ms")
    if not step or done(r) or r.get("rate") is None or r.get("seed", 1) != LENS_SEED:
        return None
    try:
        return floor(load_outputs(r["num_prompts"], lens), r["rate"], LENS_SEED, step)
    except (ValueError, OSError):
        return None


def whole_run_ceiling(r: dict, lens: Path = LENS) -> str:
    """What a stopped run's system could serve of its whole traffic at most, from its own
    lone decode step (run_one.py's ``lone_step_ms``: bench_serving's warm-up request decoded
    alone) where the traffic is the lens file's sample: no request finishes before its arrival
    plus its output tokens at that step (``makespan.py``), and no step is faster than the one
    with a single request, for a server whose every pass copies its offloaded weights whatever
    the batch (SGLang's ``--cpu-offload-gb``). bench_serving's throughput is over the whole
    traffic; the decode log's over a window, which this bounds from the other side. "" where
    unknown, else ``serves at most ...`` to follow the run's name."""
    f = whole_run_floor(r, lens)
    return "" if f is None else ceiling_text(r, f)


def ceiling_text(r: dict, f) -> str:
    """whole_run_ceiling's words for ``r``'s floor ``f`` (whole_run_floor's)."""
    return (f"serves at most {f.ceiling_tok_s:.0f} tok/s (its lone step {r['log']['lone_step_ms']:.0f} ms: "
            f"request #{f.binding}'s {f.binding_output} tokens end at {f.makespan_s:.0f} s at the earliest)")


#: tokens by which the server's count of a prompt may differ from the lens file's
LONE_SLACK = 2


def lone_tail_ceiling(r: dict, lens: Path = LENS) -> dict | None:
    """The most a stopped run could serve of its whole traffic where its log ended on one
    request decoding alone (``window.lone_tail``): that request held ``kv_tokens`` of KV, its
    prompt and what it had made, so it is one of the sample's requests whose prompt fits
    under that and whose prompt and output go past it; the fewest tokens any of them still
    had to make (``LONE_SLACK`` tokens short, for the tokenizer), at the fastest rate it
    decoded alone, end the traffic no earlier than ``end_s``. ``tok_s``: the sample's output
    over that. None where the run finished, has no lone tail, or its traffic is not the
    lens file's sample (another seed, more requests than the file holds)."""
    tail = (r.get("timeline") or {}).get("lone_tail")
    if not tail or not tail["tok_s"] or done(r) or r.get("seed", 1) != LENS_SEED or not Path(lens).exists():
        return None
    try:
        requests = load_requests(r["num_prompts"], lens)
    except ValueError:  # more requests than the file holds: not its sample
        return None
    kv = tail["kv_tokens"]
    left = [max(0, i + o - kv - LONE_SLACK) for i, o in requests if i - LONE_SLACK <= kv <= i + o + LONE_SLACK]
    if not left:
        return None
    end = tail["seconds"] + min(left) / tail["tok_s"]
    return {"tok_s": sum(o for _, o in requests) / end, "left": min(left), "end_s": end,
            "at_s": tail["seconds"], "alone_tok_s": tail["tok_s"]}


def whole_traffic_bound(el: dict, base: dict, lens: Path) -> tuple[str, float | None]:
    """Where ``el`` served its whole traffic and ``base`` stopped on a lone tail: the words
    for the measured cell and ``el``'s bench_serving throughput over ``base``'s ceiling (a
    floor on their whole-traffic ratio); ``("", None)`` otherwise."""
    c = lone_tail_ceiling(base, lens) if done(el) else None
    if c is None:
        return "", None
    bound = el["bench"]["output_throughput"] / c["tok_s"]
    return (f"; over the whole traffic {base['name']} serves at most {c['tok_s']:.0f} tok/s (its last request "
            f"alone at {c['alone_tok_s']:.0f} tok/s with >= {c['left']} tokens to go at {c['at_s']:.0f} s: "
            f"done no sooner than {c['end_s']:.0f} s), {el['name']} served it at "
            f"{el['bench']['output_throughput']:.0f}: **>= {bound:.2f}x**"), bound


def stopped_rate(r: dict) -> tuple[float | None, str]:
    """A stopped run's output rate and where it comes from: the pool modes' pass record
    (every token, the decodes their mixed prefill passes carry included), else SGLang's
    decode log (complete for a server that does not mix decodes into prefill passes)."""
    pt = r.get("pass_tokens") or {}
    if pt.get("tok_s"):
        return pt["tok_s"], "pass record"
    return r.get("log", {}).get("gen_tok_s_mean"), "decode log"


def rate_of(r: dict) -> tuple[float | None, str]:
    """A run's output rate for a ratio against a stopped run, and its source: bench_serving's
    where the run finished (every token from the first request to the last; a pass record's
    window may open at bench_serving's launch, ~25 s before its first request), else
    stopped_rate's."""
    return (r["bench"]["output_throughput"], "bench_serving") if done(r) else stopped_rate(r)


def tput_ratio(a: dict, b: dict) -> tuple[float | None, str]:
    """a's output throughput over b's, and where the two rates come from: bench_serving's if
    both finished (``""``), else each side's rate_of (``"bench_serving / decode log"``,
    ``"pass record / decode log"``), else None."""
    (x, xs), (y, ys) = rate_of(a), rate_of(b)
    if done(a) and done(b):
        return x / y, ""
    return (x / y, f"{xs} / {ys}") if x and y else (None, "")


def fmt(x: float | None, sources: str) -> str:
    """A ratio as the table says it: ``~`` and its sources where a side stopped at its budget."""
    return "-" if x is None else (f"~{x:.2f}x ({sources})" if sources else f"{x:.2f}x")


def tput(r: dict) -> float:
    """For picking the best of several baseline runs: rate_of's."""
    return rate_of(r)[0] or 0.0


def ceiling_over(base: dict, step_ms: float, lens: Path) -> float | None:
    """The most any server could serve on ``base``'s traffic, over ``base``'s throughput."""
    if not done(base):
        return None
    f = floor_of_run(base, step_ms, lens)
    return f.ceiling_tok_s / base["bench"]["output_throughput"] if f else None


def light_load(base: dict, cap: float | None, need: float) -> str | None:
    """Why the under-load targets (throughput, TTFT, running against plain) do not apply to
    this traffic, or None where they do: the traffic's ceiling over plain is under the
    throughput target (the arrivals, not the server, set the duration), or, where the ceiling
    is unknown (another sample), plain never had more requests waiting than running."""
    if cap is not None and cap < need:
        return f"light load: the traffic allows at most {cap:.2f}x"
    return never_queued(base) if cap is None else None


def never_queued(base: dict) -> str | None:
    """Why TTFT and running against plain do not apply (None where they do): plain never
    had more requests waiting than running, so there was no queue for a larger KV to cut."""
    q, running = base.get("log", {}).get("peak_queued"), base.get("log", {}).get("peak_running")
    if q is not None and running and q <= running:
        return f"light load: plain's queue peaked at {q}, its running at {running}"
    return None


def offload_elsewhere(by_traffic: dict, traffic: Traffic) -> list[dict]:
    """SGLang's --cpu-offload-gb runs that stand for this traffic's: it copies its offloaded
    layers whole every forward, whatever the routing (91 tok/s skewed, ~97 uniform at 24 GB),
    so the same requests under the other routing count as settings of this traffic's sweep;
    where neither routing has one, the same model and card on other traffic stands in
    (flagged by the caller)."""
    if traffic.phases:  # phased: its idle light phases are in any rate a stopped run's record gives
        return []
    def on(match) -> list[dict]:  # the same model, card and GPU, on traffic that ``match``es
        return [r for other, systems in by_traffic.items()
                if (other.model, other.card, other.gpu) == (traffic.model, traffic.card, traffic.gpu) and match(other)
                for r in systems.get("offload", [])]
    return on(lambda other: same_requests(other, traffic)) or on(lambda other: not other.phases)


def one_setting(el: dict, base: dict, offload: list[dict], x: float | None, need: float) -> str:
    """The offload verdict where the runs hold a single ``--cpu-offload-gb`` setting: the
    issue's baseline is the *best* setting, and SGLang's offloader copies every offloaded
    byte each pass, so a larger setting runs a larger batch on the same copies' cost
    (``offload_sweep.py``). Against one setting the pair says only that; the verdict is the
    ratio against offload_sweep's estimate of the best setting, marked as an estimate.
    ``base``: the best of ``offload``, which ``x`` (el's ratio to it) was taken against."""
    settings = {offload_gb(r["server_args"]) for r in offload}
    if len(settings) > 1 or x is None:
        return verdict(x, need, True)
    best = sweep(base)["best"]
    own = rate_of(base)[0]
    if not own or best["tok_s"] <= own:
        return verdict(x, need, True)
    est = rate_of(el)[0] / best["tok_s"]
    return (f"{'met' if x >= need else 'not met'} against the one setting measured ({settings.pop():g} GiB); "
            f"against offload_sweep.py's estimate of the best ({best['gb']:g} GiB, {best['tok_s']:.0f} tok/s): "
            f"~{est:.2f}x, {'met' if est >= need else '**not met**'} (estimated, not measured)")


def offload_pair(el: dict, offload: list[dict], traffic: Traffic, need: float, lens: Path) -> tuple[str, str, str]:
    """The offload target's runs, measured and verdict for ``el`` against SGLang's settings.

    Where ``el`` and a setting on its requests (either routing: offload_elsewhere) both have
    timelines (window.py) and the setting stopped at its budget, the pair is taken over the
    same first seconds of the traffic, against the setting ``el`` leads least there: each
    stopped run's mean is over its own window, and SGLang's offloader spends the start of one
    on prefill. Beside it, ``el``'s rate against the setting's fastest decode line (the most it
    showed, at full batch): the low end of the ratio, and the verdict says where it falls under
    the target. Otherwise the best setting by rate, the two rates' ratio as tput_ratio gives it."""
    windows = [(w, r) for r in offload if same_requests(traffic_of(r), traffic) and not done(r)
               and (w := same_window(el, r)) is not None]
    def ceiling(base: dict) -> str:
        """The baseline's whole-traffic ceiling, and where ``el`` served its whole traffic
        (bench_serving's figure) the ratio of the two: at least, as the ceiling is a bound."""
        f = whole_run_floor(base, lens)
        if f is None:
            return ""
        whole = (f"; {el['name']} served the whole traffic at {el['bench']['output_throughput']:.0f} tok/s: "
                 f">= {el['bench']['output_throughput'] / f.ceiling_tok_s:.2f}x that") if done(el) else ""
        return f"; over the whole traffic {base['name']} {ceiling_text(base, f)}{whole}"

    runs = lambda base: pair_of(el, base) + (
        "" if traffic_of(base) == traffic else f" (anchor on {describe(traffic_of(base))})")
    if not windows:
        base = max(offload, key=tput)
        x, sources = tput_ratio(el, base)
        return runs(base), fmt(x, sources) + ceiling(base), one_setting(el, base, offload, x, need)
    w, base = min(windows, key=lambda wr: wr[0]["ratio"])
    x, sources = tput_ratio(el, base)
    measured = (f"~{w['ratio']:.2f}x over the same first {w['seconds']:.0f} s of the traffic ({w['tokens']} against "
                f"{w['other_tokens']} tokens; at least {w['ratio_at_least']:.2f}x between the records' points); "
                f"means over each run's own window {fmt(x, sources)}")
    verdict_ = one_setting(el, base, offload, w["ratio"], need)
    best = (base.get("timeline") or {}).get("best_line")
    rate = rate_of(el)[0]
    if best and rate:
        full = rate / best["tok_s"]
        measured += (f"; {base['name']}'s fastest decode line {best['tok_s']:.0f} tok/s at {best['running']} running, "
                     f"{el['name']}'s rate {full:.2f}x that")
        if w["ratio"] >= need > full:
            verdict_ += f" over the window; below it ({full:.2f}x) against {base['name']} at full batch"
    return runs(base), measured + ceiling(base), verdict_


def pair_of(a: dict, b: dict) -> str:
    """``a / b``, flagged where the two ran different server code (both digests known): a
    table at one commit has no such pair."""
    da, db = a.get("code_digest"), b.get("code_digest")
    return f"{a['name']} / {b['name']}" + (" (two server codes)" if da and db and da != db else "")


class Table:
    def __init__(self):
        self.lines = ["| target | traffic | runs | measured | verdict |", "|---|---|---|---|---|"]
        self.seen: set[str] = set()

    def add(self, target: str, traffic: str, runs: str, measured: str, verdict: str) -> None:
        self.seen.add(target)
        self.lines.append(f"| {target} | {traffic} | {runs} | {measured} | {verdict} |")

    def missing(self, target: str) -> None:
        if target not in self.seen:
            self.add(target, "-", "-", "no pair among these runs", "not measured")


def verdict(value: float | None, threshold: float, higher: bool, cap: float | None = None) -> str:
    if value is None:
        return "no figure"
    if (value >= threshold) if higher else (value <= threshold):
        return "**met**"
    if cap is not None and higher and cap < threshold:
        return f"not met; the traffic allows at most {cap:.2f}x"
    return "not met"


def bound_verdict(bound: float | None, threshold: float) -> str | None:
    """A whole-traffic floor on the ratio (whole_traffic_bound) at or above the threshold
    meets it; below, the ratio of the two windows' rates decides (None)."""
    return "**met** (over the whole traffic, by the bound)" if bound is not None and bound >= threshold else None


def ablation(systems: dict[str, list[dict]]) -> tuple[str, str, str]:
    """The issue's ablation on one traffic (runs, measured, verdict): static (the pool, a fixed
    split), the adjuster copying offloaded experts in, elastic (+ the paged kernel's in-place
    reads and graphs); each against plain where it ran."""
    plain = max(systems["off"], key=tput) if systems.get("off") else None
    names, cells = [], []
    for key, label in (("static", "pool only"), ("elastic_copy", "+ adjuster"), ("elastic", "+ paged kernel")):
        if not systems.get(key):
            cells.append(f"{label}: not run")
            continue
        r = max(systems[key], key=tput)
        names.append(r["name"])
        x, sources = tput_ratio(r, plain) if plain else (None, "")
        cells.append(f"{label} ({r['name']}): {tput(r):.0f} tok/s" + (f", {fmt(x, sources)} plain" if plain else ""))
    runs = " / ".join(names) + (f" against {plain['name']}" if plain else "")
    return runs, "; ".join(cells), "measured" if len(names) == 3 else "incomplete"


def by_digest(results: list[dict]) -> dict[str, list[str]]:
    """Run names by the server code they ran; "*": a run from before code_digest.py, its digest
    recovered from the commit its folder or name records (code_digest.run_digest)."""
    digests: dict[str, list[str]] = defaultdict(list)
    for r in results:
        digests[r.get("code_digest") or "unknown (run before code_digest.py)"].append(
            r["name"] + ("*" if r.get("code_digest_source") else ""))
    return digests


def digest_line(results: list[dict]) -> str:
    """Which server code the runs ran. Where the pool modes ran one and only SGLang's own path
    (mode off, ``--cpu-offload-gb``: no pool change touches it, so its runs stand from
    another digest; bench/README.md) ran others, the line says so apart."""
    digests = by_digest(results)
    if len(digests) == 1:
        return "one digest, " + "; ".join(f"`{d}`: {', '.join(names)}" for d, names in digests.items())
    pool = by_digest([r for r in results if system_of(r) not in ("off", "offload")])
    sglang = by_digest([r for r in results if system_of(r) in ("off", "offload")])
    if len(pool) == 1 and sglang:
        (pool_digest, names), = pool.items()
        return (f"the pool modes at one digest, `{pool_digest}`: {', '.join(names)}; SGLang's own path (mode off, "
                f"`--cpu-offload-gb`) at " + "; ".join(f"`{d}`: {', '.join(n)}" for d, n in sglang.items()))
    return f"**{len(digests)} digests**: " + "; ".join(f"`{d}`: {', '.join(names)}" for d, names in digests.items())


def targets_table(results: list[dict], step_ms: float = FASTEST_STEP_MS, lens: Path = LENS) -> str:
    by_traffic: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    unserved, no_rate = [], []
    for r in results:
        if never_served(r):
            unserved.append(r["name"])
        elif no_traffic_rate(r):
            ceiling = whole_run_ceiling(r, lens)
            no_rate.append(r["name"] + (f": {ceiling}" if ceiling else ""))
        elif system_of(r):
            by_traffic[traffic_of(r)][system_of(r)].append(r)
    t = Table()
    PLAIN_TPUT, PLAIN_TTFT, PLAIN_RUN = ("32 GB Qwen1.5: throughput >= 1.3x plain (skewed), 1.15x (uniform)",
                                         "32 GB Qwen1.5: TTFT median <= 0.6x plain",
                                         "32 GB Qwen1.5: peak running >= 2x plain")
    LIGHT, FLOOR = "1 req/s: TPOT within 5 % of plain", "at no rate below 0.97x plain"
    OFF24, OFF_Q3 = ("24 GB Qwen1.5: >= 5x the best --cpu-offload-gb",
                     "32 GB Qwen3: >= 2x (uniform) / 3x (skewed) the best --cpu-offload-gb")
    STATIC = "elastic >= 1.3x the best static budget"
    ABLATION = "ablation: pool only, + adjuster, + paged kernel"
    for traffic, systems in sorted(by_traffic.items(), key=lambda kv: str(kv[0])):
        model, card, skew, rate = traffic[:4]
        where = describe(traffic)
        for el in systems.get("elastic", []):
            if systems.get("off"):
                base = max(systems["off"], key=tput)
                pair = pair_of(el, base)
                x, sources = tput_ratio(el, base)
                measured, dip = fmt(x, sources), ""
                if not (done(el) and done(base)) and (w := same_window(el, base)) is not None:
                    # a stopped pair: over the same first seconds (each mean is over its own
                    # window, and one may open on prefill alone), and the lowest on the way
                    lo_t, lo = min(along(el, base), key=lambda p: p[1])
                    measured = (f"~{w['ratio']:.2f}x over the same first {w['seconds']:.0f} s of the traffic "
                                f"({w['tokens']} against {w['other_tokens']} tokens), lowest along it {lo:.2f}x "
                                f"at {lo_t:.0f} s; means over each run's own window {measured}")
                    x, dip = w["ratio"], (f" over the window; below it ({lo:.2f}x) at {lo_t:.0f} s"
                                          if lo < 0.97 else "")
                cap = ceiling_over(base, step_ms, lens)
                need = 1.3 if skew else 1.15
                light, no_queue = light_load(base, cap, need), never_queued(base)
                whole, bound = whole_traffic_bound(el, base, lens)
                if model == "q15" and card == 32:
                    t.add(PLAIN_TPUT, where, pair, measured + whole,
                          light or bound_verdict(bound, need) or verdict(x, need, True, cap))
                    if done(el) and done(base):
                        ttft = el["bench"]["median_ttft_ms"] / base["bench"]["median_ttft_ms"]
                        t.add(PLAIN_TTFT, where, pair, f"{ttft:.2f}x", no_queue or verdict(ttft, 0.6, False))
                    running = el["log"]["peak_running"] / max(1, base["log"]["peak_running"])
                    t.add(PLAIN_RUN, where, pair, f"{running:.2f}x", no_queue or verdict(running, 2.0, True))
                if rate == 1 and done(el) and done(base):
                    tpot = el["bench"]["median_tpot_ms"] / base["bench"]["median_tpot_ms"]
                    t.add(LIGHT, where, pair, f"TPOT {tpot:.2f}x", verdict(tpot, 1.05, False))
                floor_verdict = bound_verdict(bound, 0.97) or verdict(x, 0.97, True)
                if dip and x >= 0.97 and not bound_verdict(bound, 0.97):  # trailed 0.97x on the way
                    floor_verdict += dip
                t.add(FLOOR, where, pair, measured + whole, floor_verdict)
            offload = offload_elsewhere(by_traffic, traffic)
            if offload and ((model == "q15" and card == 24) or (model == "q3" and card == 32)):
                need = 5.0 if model == "q15" else (3.0 if skew else 2.0)
                t.add(OFF24 if model == "q15" else OFF_Q3, where, *offload_pair(el, offload, traffic, need, lens))
            if systems.get("static"):
                # plain SGLang is the static budget that keeps every expert (static mode's own
                # such layout runs SGLang's MoE, within 1 % of it), so it is one of the budgets
                budgets = systems["static"] + systems.get("off", [])
                base = max(budgets, key=tput)
                x, sources = tput_ratio(el, base)
                cap = ceiling_over(base, step_ms, lens)
                plain = ", plain as every expert resident" if systems.get("off") else ""
                t.add(STATIC, where, f"{pair_of(el, base)} (best of {len(budgets)}{plain})",
                      fmt(x, sources), verdict(x, 1.3, True, cap))
        if systems.get("elastic_copy"):
            t.add(ABLATION, where, *ablation(systems))
    for target in (PLAIN_TPUT, PLAIN_TTFT, PLAIN_RUN, LIGHT, FLOOR, OFF24, OFF_Q3, STATIC, ABLATION):
        t.missing(target)
    over = [r["name"] for r in results if over_card(r)]
    lines = t.lines + ["", "- peak GPU memory within the card: " + (
        "every run" if not over else "**over the card**: " + ", ".join(over))]
    if unserved:
        lines.append("- left out, their traffic never ran (ended before two requests ran at once): "
                     + ", ".join(unserved))
    if no_rate:
        lines.append("- left out, no decode of their traffic within their window (prefill only): "
                     + "; ".join(no_rate))
    lines.append("- server code (code_digest.py): " + digest_line(results))
    if any(r.get("code_digest_source") for r in results):
        lines.append("- `*`: the run predates code_digest.py; its digest is that of the commit its folder's "
                     "CODE_DIGEST.json or its name's `_<commit>` tag records")
    return "\n".join(lines)
