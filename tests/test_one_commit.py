"""bench/serving/one_commit.py: issue 12's one-commit list, read from the stored runs.

The list spans device calls and sessions; which of its lines stand at a server code decides
what the next call runs, so the names it expects must be the ones h200.sh writes, and a line
stands only where all its runs are in one call's folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "serving"))
try:
    import one_commit as oc
finally:
    sys.path.pop(0)

H100 = {"name": "NVIDIA H100 80GB HBM3", "total_mib": 81559}


def _run(folder: Path, name: str, digest: str = "d1", num: int = 500, seed: int = 1, whole: bool = True,
         gpu: dict = H100, ready_s: float = 100.0, traffic_s: float = 120.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({
        "name": name, "server_args": [], "code_digest": digest, "num_prompts": num, "seed": seed, "gpu": gpu,
        "bench": {"output_throughput": 1000.0} if whole else {}, "cut": False, "ready_s": ready_s,
        "traffic_s": traffic_s}))


def test_the_names_are_the_ones_h200_sh_writes():
    """h200.sh's `one`: -skew, -ind, _rRATE (not at 10 req/s, not phased), _ph, _cap, in that order."""
    assert oc.run_name("elastic32", {"SKEW": "1", "NOISE": "1", "RATE": "20"}) == "elastic32-skew-ind_r20"
    assert oc.run_name("off32", {"RATE": "10"}) == "off32"
    assert oc.run_name("off32", {"RATE": "inf"}) == "off32_rinf"
    assert oc.run_name("static24", {"PHASES": "1:45,20:300,1:45", "SKEW": "1", "RATE": "20"}) == "static24-skew_ph"
    assert oc.run_name("q3elastic32d", {"SKEW": "1", "CARD_CAP": "1"}) == "q3elastic32d-skew_cap"
    assert oc.requests_of({"PHASES": "1:45,20:300,1:45"}) == 390
    assert oc.requests_of({"NUM": "60", "SEED": "2"}) == 60 and oc.requests_of({}) == 500
    # every run of every line is one h200.sh knows (its case patterns, a prefix before any number)
    cases = (ROOT / "bench" / "serving" / "h200.sh").read_text()
    for line in oc.LINES:
        for run in line.runs:
            assert f"    {run})" in cases or f"    {run.rstrip('0123456789')}*)" in cases, run


def test_the_command_is_the_h200_sh_line_of_the_readme():
    line = oc.Line({"RANKING": "R.json", "SKEW": "1", "RATE": "5", "NUM": "200", "START_S": "150", "BUDGET": "80"},
                   ("off32", "elastic32"), "x")
    assert oc.command(line) == ('RANKING=R.json SKEW=1 RATE=5 NUM=200 RUNS="off32 elastic32" START_S=150 '
                                'BUDGET=80 bash bench/serving/h200.sh')
    assert oc.command(oc.Line({"PHASES": "1:45,20:300,1:45", "START_S": "200", "BUDGET": "330"}, ("static24",), "x")) \
        == "PHASES=1:45,20:300,1:45 RUNS=static24 START_S=200 BUDGET=330 bash bench/serving/h200.sh"


def test_a_line_stands_only_with_all_its_runs_in_one_folder_at_the_digest(tmp_path):
    pair = oc.Line({"RATE": "20"}, ("off32", "elastic32"), "pair")
    lone = oc.Line({"NUM": "150", "NOISE": "1"}, ("elastic24dcpuauto",), "split", standing=oc.OFFLOAD24, whole=True)
    # the pair split across two calls (two machines) at d1; whole in a later call; another digest's
    _run(tmp_path / "device_h100_2026-12-07a", "off32_r20")
    _run(tmp_path / "device_h100_2026-12-07b", "elastic32_r20")
    _run(tmp_path / "device_h100_2026-12-07c", "elastic32_r20", digest="d0")
    _run(tmp_path / "device_h100_2026-12-07c", "off32_r20", digest="d0")
    # the split: stopped at d1; run on other requests (500) and at another seed; the offload baselines
    _run(tmp_path / "device_h100_2026-12-07b", "elastic24dcpuauto-ind", num=150, whole=False)
    _run(tmp_path / "device_h100_2026-12-07c", "elastic24dcpuauto-ind", num=500)
    _run(tmp_path / "device_h100_2026-12-07c", "elastic24dcpuauto-ind", num=150, seed=2)
    _run(tmp_path / "device_h100_2026-12-06", "offload24_16", digest="old", num=150, whole=False)
    _run(tmp_path / "device_h100_2026-12-06", "offload24_8", digest="old", num=150, whole=False)
    _run(tmp_path / "serving_h200_2026-12-02e", "offload24-skew", digest="older", num=150, gpu={})
    _run(tmp_path / "device_h200_2026-12-04e", "offload24-skew", digest="old", num=150, gpu={"name": "NVIDIA H200"})
    _run(tmp_path / "device_h100_2026-12-06", "offload24_16_long", digest="old", num=150)
    everywhere = oc.load_runs(tmp_path)
    at = [r for r in everywhere if r["code_digest"] == "d1"]
    assert oc.line_status(pair, at, everywhere) == (
        "partly", "device_h100_2026-12-07a (H100): off32_r20 whole (not the whole line in one call); "
                  "device_h100_2026-12-07b (H100): elastic32_r20 whole (not the whole line in one call)")
    baselines = ("baseline standing: H100: offload24_16 (device_h100_2026-12-06), offload24_8 "
                 "(device_h100_2026-12-06); H200: offload24-skew (device_h200_2026-12-04e)")
    assert oc.line_status(lone, at, everywhere) == (
        "partly", "device_h100_2026-12-07b (H100): elastic24dcpuauto-ind stopped "
                  "(the line wants the whole traffic served); " + baselines)
    _run(tmp_path / "device_h100_2026-12-07d", "elastic32_r20")
    _run(tmp_path / "device_h100_2026-12-07d", "off32_r20", whole=False)
    _run(tmp_path / "device_h100_2026-12-07d", "elastic24dcpuauto-ind", num=150)
    everywhere = oc.load_runs(tmp_path)
    at = [r for r in everywhere if r["code_digest"] == "d1"]
    assert oc.line_status(pair, at, everywhere) == (
        "stands", "device_h100_2026-12-07d (H100): off32_r20 stopped, elastic32_r20 whole")
    assert oc.line_status(lone, at, everywhere) == (
        "stands", "device_h100_2026-12-07d (H100): elastic24dcpuauto-ind whole; " + baselines)
    assert oc.line_status(pair, [r for r in everywhere if r["code_digest"] == "d0"], everywhere)[0] == "stands"
    assert oc.line_status(pair, [], everywhere) == ("owed", "")


def test_the_stored_runs_at_the_frozen_digest(capsys, monkeypatch):
    """The forty-fifth session's three pairs at bdf5365403d3 stand; the rest is owed, each with its line."""
    monkeypatch.setattr(sys, "argv", ["one_commit.py", "bdf5365403d3"])
    oc.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "one_commit: server code bdf5365403d3, 3 of 21 lines stand, 6 runs at it"
    standing = [ln for ln in out if ln[3:9] == "stands"]
    assert [ln[:9] for ln in standing] == [" 1 stands", " 2 stands", " 3 stands"]
    assert out[out.index(standing[2]) + 1] == ("          device_h100_2026-12-07d (H100): off32 stopped, "
                                               "elastic32 stopped")
    assert 'NOISE=1 NUM=150 RUNS=elastic24dcpuauto START_S=150 BUDGET=300 bash bench/serving/h200.sh' \
        in [ln.strip() for ln in out]
    assert out[-1].startswith("then: python3 bench/serving/report.py bench/results/device_h100_2026-12-07d/")
    # the six, and SGLang's offload runs stored on an H100 (any digest: no pool change touches them)
    assert out[-1].endswith(" --targets") and out[-1].count(".json") == 9
    assert "bench/results/device_h100_2026-12-06/offload24_16.json" in out[-1]
    assert "bench/results/device_h100_2026-12-05f/q3offload32_50_less2560_cap.json" in out[-1]
    assert "device_h200" not in out[-1]


def test_a_lines_device_time_comes_from_its_stored_runs_and_a_session_takes_what_fits(tmp_path):
    """Each run as long as its latest stored run of that name and requests took (start and
    traffic), else its START_S + BUDGET limit, plus the call's own ~60 s; a session's plan takes
    the owed lines in order, passing over one that does not fit what is left or a call's 600 s."""
    _run(tmp_path / "device_h100_2026-12-06", "off32_r5", digest="old", num=200, ready_s=90.0, traffic_s=80.0)
    _run(tmp_path / "device_h100_2026-12-07a", "off32_r5", digest="old", num=200, ready_s=100.0, traffic_s=85.4)
    _run(tmp_path / "device_h100_2026-12-07a", "elastic32_r5", digest="old", num=500)  # other requests
    everywhere = oc.load_runs(tmp_path)
    pair = oc.Line({"RATE": "5", "NUM": "200", "START_S": "150", "BUDGET": "80"}, ("off32", "elastic32"), "x")
    assert oc.seconds(pair, everywhere) == (60 + 185 + 10 + 150 + 80 + 10, "by its limits: elastic32_r5; stored runs otherwise")
    long = oc.Line({"START_S": "300", "BUDGET": "330"}, ("static24",), "y")  # 700 s: past a call
    short = oc.Line({"START_S": "150", "BUDGET": "100"}, ("off32",), "z")  # 320 s
    assert oc.seconds(long, everywhere)[0] == 700 and oc.seconds(short, everywhere)[0] == 320
    owed = [(4, oc.seconds(pair, everywhere)[0]), (5, 700), (6, 320), (7, oc.seconds(pair, everywhere)[0])]
    assert oc.plan(owed, 1000) == [4, 6]
    assert oc.plan(owed[:1], 400) == []
