"""Issue 12's one-commit list: which of its runs stand at one server code, and what is owed.

    python3 bench/serving/one_commit.py bdf5365403d3 [--results bench/results] [--plan SECONDS]

The issue wants its tables "from runs at one commit"; a device call runs one or two systems,
so the list spans calls and sessions, and any change to the server's code (``code_digest.py``)
starts it again. ``LINES`` is the list: each line one device call's ``h200.sh`` command, in the
order its runs are owed. A line stands where every run it names is stored (``--results``, any
folder) at the digest, on its traffic (name, requests, seed), all in one folder: one call, so
one machine, which on an H100 is what pairs a pool mode with its plain run (the H200 and H100
differ too much for a pair across them; bench/README.md). A line that pairs with SGLang's own
``--cpu-offload-gb`` (whose path no pool change touches) names the baseline runs that stand on
each GPU at any digest (``standing``). The last line printed is ``report.py --targets`` over
every stored run at the digest and those baselines on the digest's GPUs: the tables the issue
wants, once every line stands. Each owed line's device time is read off its runs' latest stored
starts and traffic (``seconds``); ``--plan`` (status's ``budget_left_s``) picks the lines a
session takes, in order.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple

from targets import done, gpu_of

ROOT = Path(__file__).resolve().parents[2]
#: the measured rankings h200.sh's RANKING points at: Qwen1.5 on the dummy routers' shared
#: routings and on independent ones (--router-noise 1), and Qwen3's
R = "bench/results/serving_h200_2026-12-02c/ranking_q15_skew1_d99c5cf.json"
R_IND = "bench/results/device_h100_2026-12-06d/ranking_q15_skew1_ind.json"
R3 = "bench/results/serving_h200_2026-12-02e/ranking_q3_skew1_7f20a2d.json"
#: SGLang's --cpu-offload-gb runs (h200.sh's offload24_GB, q3offload32_GB[_lessMIB]_cap): any
#: routing counts, since SGLang copies every offloaded expert whatever the router picks
OFFLOAD24 = r"offload24(_\d+)?(-skew)?(-ind)?$"
Q3OFFLOAD = r"q3offload32_\d+(_less\d+)?(-skew)?(-ind)?_cap$"


class Line(NamedTuple):
    """One device call: ``h200.sh``'s variables and RUNS, what the line measures, for a pool
    mode measured against SGLang's offload the regex of the baseline's run names, and whether
    the line stands only where its runs served the whole traffic (not stopped at the budget)."""
    env: dict
    runs: tuple
    what: str
    standing: str | None = None
    whole: bool = False


LINES = (
    Line({"RANKING": R_IND, "SKEW": "1", "NOISE": "1", "RATE": "20", "START_S": "150", "BUDGET": "160"},
         ("off32", "elastic32"), "32 GB skewed 20 req/s, independent routings: >= 1.3x plain"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "20", "START_S": "150", "BUDGET": "160"},
         ("off32", "elastic32"), "32 GB skewed 20 req/s: >= 1.3x plain"),
    Line({"START_S": "150", "BUDGET": "125"}, ("off32", "elastic32"), "32 GB uniform 10 req/s: >= 1.15x plain"),
    Line({"NOISE": "1", "NUM": "150", "START_S": "150", "BUDGET": "300"}, ("elastic24dcpuauto",),
         "24 GB uniform, the CPU split, whole: >= 5x SGLang's best offload", standing=OFFLOAD24, whole=True),
    Line({"CARD_CAP": "1", "START_S": "300", "BUDGET": "150"}, ("q3elastic32d",),
         "32 GB Qwen3 uniform: >= 2x SGLang's best offload", standing=Q3OFFLOAD),
    Line({"CARD_CAP": "1", "START_S": "300", "BUDGET": "150"}, ("q3elastic32dcpuautoc512",),
         "32 GB Qwen3 uniform, the CPU split on the copy path", standing=Q3OFFLOAD),
    Line({"RANKING": R3, "SKEW": "1", "CARD_CAP": "1", "START_S": "300", "BUDGET": "150"}, ("q3elastic32d",),
         "32 GB Qwen3 skewed: >= 3x SGLang's best offload", standing=Q3OFFLOAD),
    Line({"RATE": "5", "NUM": "200", "START_S": "150", "BUDGET": "80"}, ("off32", "elastic32"),
         "32 GB uniform 5 req/s: no worse than 0.97x plain"),
    Line({"RATE": "20", "START_S": "150", "BUDGET": "125"}, ("off32", "elastic32"),
         "32 GB uniform 20 req/s: no worse than 0.97x plain"),
    Line({"RATE": "inf", "START_S": "175", "BUDGET": "110"}, ("off32", "elastic32"),
         "32 GB uniform, all at once: no worse than 0.97x plain"),
    Line({"RATE": "1", "NUM": "60", "SEED": "2", "START_S": "150", "BUDGET": "100"}, ("off32", "elastic32"),
         "32 GB uniform 1 req/s (the anchors' light load): TPOT within 5 % of plain"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "1", "NUM": "60", "SEED": "2", "START_S": "150", "BUDGET": "100"},
         ("off32", "elastic32"), "32 GB skewed 1 req/s: TPOT within 5 % of plain"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "5", "NUM": "200", "START_S": "150", "BUDGET": "80"},
         ("off32", "elastic32"), "32 GB skewed 5 req/s: no worse than 0.97x plain"),
    Line({"RANKING": R, "SKEW": "1", "START_S": "150", "BUDGET": "125"}, ("off32", "elastic32"),
         "32 GB skewed 10 req/s: >= 1.3x plain"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "20", "START_S": "185", "BUDGET": "125"}, ("static32", "elastic32"),
         "32 GB skewed 20 req/s: >= 1.3x the best static (the ablation's pool alone)"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "20", "START_S": "185", "BUDGET": "125"}, ("elastic32copy", "elastic32"),
         "32 GB skewed 20 req/s: the ablation's adjuster without the paged kernel"),
    Line({"RANKING": R, "SKEW": "1", "NUM": "150", "START_S": "110", "BUDGET": "120"}, ("elastic24d", "static24"),
         "24 GB skewed: elastic against the best static, and SGLang's offload", standing=OFFLOAD24),
    Line({"RANKING": R, "SKEW": "1", "RATE": "inf", "START_S": "175", "BUDGET": "100"}, ("off32", "elastic32"),
         "32 GB skewed, all at once: no worse than 0.97x plain"),
    Line({"RANKING": R, "SKEW": "1", "RATE": "inf", "START_S": "185", "BUDGET": "100"}, ("static32", "elastic32"),
         "32 GB skewed, all at once: elastic against the best static (50 of 60 resident; 44 was worse)"),
    Line({"PHASES": "1:45,20:300,1:45", "RANKING": R, "SKEW": "1", "START_S": "200", "BUDGET": "330"},
         ("elastic24d",), "24 GB skewed, phased 1/20/1 req/s: elastic (the next line on the same warm machine)"),
    Line({"PHASES": "1:45,20:300,1:45", "RANKING": R, "SKEW": "1", "START_S": "200", "BUDGET": "330"},
         ("static24",), "24 GB skewed, phased 1/20/1 req/s: the best static, against the line before"),
)


def run_name(run: str, env: dict) -> str:
    """The name ``h200.sh``'s ``one`` gives RUN under ENV (its suffixes, in its order)."""
    name = run + ("-skew" if env.get("SKEW", "0") != "0" else "") + ("-ind" if env.get("NOISE", "0") != "0" else "")
    if not env.get("PHASES") and env.get("RATE", "10") != "10":
        name += "_r" + env["RATE"]
    if env.get("PHASES"):
        name += "_ph"
    return name + ("_cap" if env.get("CARD_CAP") else "")


def requests_of(env: dict) -> int:
    """The requests a run of ENV serves: NUM (500), or the phases' sum."""
    if env.get("PHASES"):
        return sum(int(p.split(":")[1]) for p in env["PHASES"].split(","))
    return int(env.get("NUM", "500"))


def command(line: Line) -> str:
    """LINE as the shell line bench/README.md lists (RUNS before the start and budget)."""
    env = dict(line.env)
    tail = {k: env.pop(k) for k in ("START_S", "BUDGET") if k in env}
    env = {**env, "RUNS": " ".join(line.runs), **tail}
    return " ".join(f'{k}="{v}"' if " " in v else f"{k}={v}" for k, v in env.items()) + " bash bench/serving/h200.sh"


def folder_key(folder: str | Path) -> tuple[str, str]:
    """A results folder's place in time: the date its name ends with (``serving_h200_2026-12-02e``,
    ``device_h100_2026-12-07d``: a session's calls get the letters in turn), then the name."""
    name = Path(folder).name
    m = re.search(r"\d{4}-\d{2}-\d{2}[a-z]?$", name)
    return (m.group(0) if m else "", name)


def load_runs(results: Path) -> list[dict]:
    """Every run_one.py JSON under ``results`` (one folder deep), oldest folder first, its path
    kept as ``_path``."""
    runs = []
    for path in sorted(results.glob("*/*.json"), key=lambda p: (folder_key(p.parent), p.name)):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and "name" in r and "server_args" in r:
            runs.append({**r, "_path": str(path)})
    return runs


def matches(r: dict, name: str, env: dict) -> bool:
    return (r["name"] == name and r.get("num_prompts") == requests_of(env)
            and r.get("seed", 1) == int(env.get("SEED", "1")))


def state(r: dict) -> str:
    return "whole" if done(r) else "cut" if r.get("cut") else "stopped"


def line_status(line: Line, at_digest: list[dict], everywhere: list[dict]) -> tuple[str, str]:
    """``(stands | partly | owed, what was found)`` for LINE among the runs at one digest."""
    names = [run_name(run, line.env) for run in line.runs]
    folders: dict[str, dict[str, dict]] = {}
    for r in at_digest:
        for name in names:
            if matches(r, name, line.env):
                folders.setdefault(str(Path(r["_path"]).parent), {})[name] = r
    complete = sorted((f for f, got in folders.items() if len(got) == len(names)), key=folder_key)
    if complete:  # the latest folder holding the whole line
        got = folders[complete[-1]]
        found = f"{Path(complete[-1]).name} ({gpu_of(got[names[0]])}): " + ", ".join(
            f"{n} {state(got[n])}" for n in names)
        status = "stands"
        if line.whole and not all(done(r) for r in got.values()):
            found, status = found + " (the line wants the whole traffic served)", "partly"
    elif folders:
        found = "; ".join(f"{Path(f).name} ({gpu_of(next(iter(got.values())))}): " + ", ".join(
            f"{n} {state(r)}" for n, r in got.items()) + " (not the whole line in one call)"
            for f, got in sorted(folders.items(), key=lambda fg: folder_key(fg[0])))
        status = "partly"
    else:
        found, status = "", "owed"
    if line.standing:
        found += ("; " if found else "") + "baseline standing: " + standing(line, everywhere)
    return status, found


#: what a device call spends outside its runs: h200.sh's setup (the carry's install on a fresh
#: machine, the models' unpacking) and the tool's transfers (the forty-fifth session's three
#: calls: 1,605 s of device time for 1,552 s of calls); bench_serving's end and the JSON after each run
CALL_S, RUN_END_S = 60, 10


def seconds(line: Line, everywhere: list[dict]) -> tuple[int, str]:
    """LINE's device time: each run's start and traffic as its latest stored run of that name
    and requests took them (any digest, any GPU), else its START_S + BUDGET limit; and how."""
    total, guessed = CALL_S, []
    for run in line.runs:
        name = run_name(run, line.env)
        past = [r for r in everywhere if matches(r, name, line.env) and r.get("ready_s") is not None]
        if past:
            total += round(past[-1]["ready_s"] + past[-1].get("traffic_s", 0)) + RUN_END_S
        else:
            total += int(line.env.get("START_S", 200)) + int(line.env.get("BUDGET", 300)) + RUN_END_S
            guessed.append(name)
    return total, ("by its limits: " + ", ".join(guessed) + "; " if guessed else "") + "stored runs otherwise"


def plan(owed: list[tuple[int, int]], budget_s: int, call_s: int = 600) -> list[int]:
    """The owed lines, ``(number, seconds)`` in the list's order, that a session of ``budget_s``
    device seconds takes, each a call of at most ``call_s``: a line that does not fit what is
    left is passed over for a later, shorter one."""
    chosen, left = [], budget_s
    for i, s in owed:
        if s <= min(left, call_s):
            chosen.append(i)
            left -= s
    return chosen


def baselines(line: Line, everywhere: list[dict]) -> dict[str, dict[str, dict]]:
    """The stored runs of LINE's baseline on its requests, by GPU and name, the latest folder's."""
    by_gpu: dict[str, dict[str, dict]] = {}
    if line.standing:
        for r in everywhere:  # oldest folder first: a later one replaces it
            if re.match(line.standing, r["name"]) and r.get("num_prompts") == requests_of(line.env):
                by_gpu.setdefault(gpu_of(r), {})[r["name"]] = r
    return by_gpu


def standing(line: Line, everywhere: list[dict]) -> str:
    """LINE's baseline runs as a line: ``H100: NAME (FOLDER), ...; H200: ...``."""
    return "; ".join(f"{gpu}: " + ", ".join(f"{n} ({Path(r['_path']).parent.name})" for n, r in sorted(names.items()))
                     for gpu, names in sorted(baselines(line, everywhere).items())) or "none stored"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("digest", help="the server code (code_digest.py) the list is held at")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--plan", type=int, metavar="SECONDS",
                    help="the owed lines a session with this much device time left takes (status's budget_left_s)")
    args = ap.parse_args()
    everywhere = load_runs(Path(args.results))
    at_digest = [r for r in everywhere if r.get("code_digest") == args.digest]
    statuses = [line_status(line, at_digest, everywhere) for line in LINES]
    print(f"one_commit: server code {args.digest}, {sum(s == 'stands' for s, _ in statuses)} of {len(LINES)} "
          f"lines stand, {len(at_digest)} runs at it")
    owed: dict[int, int] = {}  # line number -> its device seconds
    for i, (line, (status, found)) in enumerate(zip(LINES, statuses), 1):
        print(f"{i:2d} {status:6s} {line.what}" + (f"\n          {found}" if found else ""))
        if status != "stands":
            owed[i], how = seconds(line, everywhere)
            print(f"          {command(line)}\n          ~{owed[i]} s of device time ({how})"
                  + (": past a call's 600 s, split it" if owed[i] > 600 else ""))
    if args.plan is not None:
        chosen = plan(list(owed.items()), args.plan)
        print(f"plan for {args.plan} s: " + (", ".join(f"line {i}" for i in chosen) + f" (~{sum(owed[i] for i in chosen)} s)"
                                             if chosen else "no owed line fits"))
    if at_digest:  # with the SGLang offload runs stored on the GPUs the digest's runs ran on
        gpus = {gpu_of(r) for r in at_digest}
        paths = [r["_path"] for r in at_digest]
        for line in LINES:
            paths += [r["_path"] for gpu, names in baselines(line, everywhere).items() if gpu in gpus
                      for r in names.values() if r["_path"] not in paths]
        print("then: python3 bench/serving/report.py " + " ".join(
            str(Path(p).relative_to(ROOT)) if Path(p).is_relative_to(ROOT) else p for p in paths) + " --targets")


if __name__ == "__main__":
    main()
