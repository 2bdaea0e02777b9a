"""What the TP agreement check (``sglang_rimuru/adjuster/agreement.py``) costs per round, on CPU at TP=2.

Two measurements, written to ``--out`` (JSON) and printed:

* ``micro``: two processes over a gloo group, as two TP ranks' schedulers.
  Per call: SGLang's ``broadcast_pyobj([])`` (what every scheduler round at
  TP > 1 already pays to share the received requests), ``TPAgreement.check``
  with the production gather (``rimuru_patches.elastic.tp_agreement``), and
  ``planned`` with a typical order (digest of its encoding).
* ``server``: a TP=2 ``--rimuru-mode elastic`` server (tiny model, the
  elastic tests' flags) serving a burst of 16 requests twice, as served
  (``check``) or with the controller's ``agreement`` removed (``nocheck``); a
  bench-only ``sitecustomize`` times, on each rank, every ``check`` (which
  includes waiting for the later rank), in ``probe`` runs the same all-gather
  repeated right after it (``gather_again``: no wait in it, the check's own
  cost), and the wall time between round hooks (``forward``: rounds that run
  a forward pass; ``other``: rounds that do not, mostly SGLang's idle spin).

    python bench/tp_agreement.py --out bench/results/tp_agreement_cpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _micro_rank(rank: int, store: str, n: int, out) -> None:
    import torch.distributed as dist
    from sglang.srt.utils.common import broadcast_pyobj

    from rimuru_patches.elastic import tp_agreement
    from sglang_rimuru.adjuster import ExpertMove, MigrationOrder, encode

    limit = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=limit)
    group = dist.new_group([0, 1], backend="gloo", timeout=limit)
    import types

    agreement = tp_agreement(types.SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=group))
    order = MigrationOrder(1, 1, 7, tuple(ExpertMove(l, e, (3 * (8 * l + e), 3 * (8 * l + e) + 1, 3 * (8 * l + e) + 2))
                                          for l in range(2) for e in range(3)), (), "kv_short: R_b=17 F_b=2 in_flight_pages=0")
    encoded = encode(order)
    result = {}
    for name, fn in (("broadcast_pyobj_empty_us", lambda: broadcast_pyobj([], rank, group, src=0)),
                     ("check_us", agreement.check),
                     ("planned_us", lambda: agreement.planned(7, order, encoded))):
        for _ in range(n // 10):
            fn()
        dist.barrier(group)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        result[name] = (time.perf_counter() - t) / n * 1e6
        if name == "planned_us":
            agreement.check()  # (both ranks) the digest of those plans, once
    out.put((rank, result))
    dist.destroy_process_group()


def micro(n: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_micro_rank, args=(r, f"{tmp}/store", n, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return {"calls": n, "ranks": results}


TIMING_SHIM = textwrap.dedent(
    """
    # bench only: per-rank timing of the round hook and its TP agreement check
    import json, os, time
    from sglang_rimuru.adjuster import agreement as _agreement
    from sglang_rimuru.adjuster import controller as _controller

    _OUT = os.environ["RIMURU_BENCH_OUT"]
    _CHECK = os.environ["RIMURU_BENCH_MODE"] != "nocheck"
    _AGAIN = os.environ["RIMURU_BENCH_MODE"] == "probe"
    _s = {"forward": [0, 0.0], "other": [0, 0.0], "check": [0, 0.0], "gather_again": [0, 0.0]}
    _last = [None, None]
    _check = _agreement.TPAgreement.check
    _round = _controller.ElasticController.round

    def check(self):
        t = time.perf_counter()
        _check(self)
        _s["check"][0] += 1
        _s["check"][1] += time.perf_counter() - t
        if _AGAIN:
            # the same all-gather once more, right after: the ranks just met, so this
            # one has no wait for a late rank in it (what the check costs by itself)
            t = time.perf_counter()
            self._gather((0, 0, 0))
            _s["gather_again"][0] += 1
            _s["gather_again"][1] += time.perf_counter() - t

    def round(self, *, forward_follows, waiting=0, busy=True):
        if not _CHECK:
            self.agreement = None
        now = time.perf_counter()
        if _last[0] is not None:  # the previous round, hook to hook
            k = "forward" if _last[1] else "other"
            _s[k][0] += 1
            _s[k][1] += now - _last[0]
        _last[:] = [now, forward_follows]
        out = _round(self, forward_follows=forward_follows, waiting=waiting, busy=busy)
        if (_s["forward"][0] + _s["other"][0]) % 100 == 0:
            import torch.distributed as dist
            with open(f"{_OUT}.tp{dist.get_rank()}", "w") as f:
                json.dump(_s, f)
        return out

    _agreement.TPAgreement.check = check
    _controller.ElasticController.round = round
    """
)


def server(model_path: str, log: Path, mode: str) -> dict:
    from sglang_rimuru.serving import start_local_server

    burst = [f"request {i}: " + "word " * 30 for i in range(16)]

    def generate(url, text):
        import requests

        body = {"text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
        requests.post(url + "/generate", json=body, timeout=600).raise_for_status()

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(TIMING_SHIM)
        stats = Path(tmp) / "stats"
        env = {"PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]),
               "RIMURU_BENCH_OUT": str(stats), "RIMURU_BENCH_MODE": mode}
        args = ["--rimuru-mode", "elastic", "--rimuru-expert-offload-limit", "4", "--max-total-tokens", "200",
                "--context-length", "512", "--model-path", model_path, "--tp-size", "2"]
        srv = start_local_server(args, log, timeout=600, env=env)
        try:
            t = time.perf_counter()
            for _ in range(2):
                with cf.ThreadPoolExecutor(len(burst)) as ex:
                    list(ex.map(lambda p: generate(srv.url, p), burst))
            burst_s = (time.perf_counter() - t) / 2
            time.sleep(5)  # idle rounds
        finally:
            srv.stop()
        ranks = {}
        for r in (0, 1):
            s = json.loads(Path(f"{stats}.tp{r}").read_text())
            ranks[r] = {k: {"rounds": n, "mean_us": 1e6 * total / max(n, 1)} for k, (n, total) in s.items()}
    return {"mode": mode, "burst_wall_s": burst_s, "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/tp_agreement_cpu.json"))
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--server-runs", default="probe,check,nocheck,check,nocheck",
                    help="servers to run, in order: check (as served), nocheck (agreement removed) or probe "
                         "(check + gather_again); empty: none")
    args = ap.parse_args()
    from sglang_rimuru.models import ensure_model

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "micro": micro(args.calls)}
    runs = [c for c in args.server_runs.split(",") if c]
    if runs:
        model = str(ensure_model("tiny-qwen3-moe"))
        result["server"] = [server(model, Path(args.out).with_suffix(f".{i}.{mode}.log"), mode)
                            for i, mode in enumerate(runs)]
    result["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "patches"), str(ROOT / "kernels")]
    main()
