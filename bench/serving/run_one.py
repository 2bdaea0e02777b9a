"""One system, one setting, real ShareGPT traffic: start the server, send the traffic, write JSON.

    python3 bench/serving/run_one.py --name elastic32 --model /tmp/models/q15 --card-gb 32 \\
        --rate 10 --num-prompts 500 --out OUT_DIR [--dataset FILE] [--budget-s 420] \\
        -- --rimuru-mode elastic --rimuru-expert-offload-limit 20

Everything after ``--`` goes to ``python -m sglang_rimuru.launch_server`` (mode off
takes plain SGLang flags, e.g. ``--cpu-offload-gb 8``). The harness adds what every
system gets the same way: ``--load-format dummy``, the card emulated as SGLang sizes a
real one (``--mem-fraction-static`` = 0.886 x card / the GPU's total, unless given;
``--chunked-prefill-size 2048``), CUDA graphs on, SGLang's own defaults otherwise
(``DEVICE_FLAGS`` adds only what the lent H200 needs: triton attention, pytorch
sampling, no grammar backend). In elastic mode it adds ``--rimuru-adjuster-trace``.

Traffic: SGLang's ``bench_serving`` with the ShareGPT file of ``../shared/data``
(bench_serving's sampling, ``--seed 1``, context 8192, the Qwen tokenizer of the model
directory), Poisson arrivals at ``--rate``; its process (``warm_bench.py``, one a phase) starts
with the server and imports SGLang while the server starts, so that the traffic follows the
server's readiness by its tokenizer, data and warmup request alone. While it runs: nvidia-smi every 0.5 s (the
GPU's and each process's memory), and the server log for running/queued requests.

Writes OUT_DIR/NAME.json: bench_serving's summary, peak running and queued requests,
retractions, decode steps counted from the log, peak GPU memory (whole GPU and the
largest process; by GPU too, for ``--tp-size 2``'s two cards), the server's peak
resident host memory (all its processes, from readiness on: the page-locked experts),
the card budget, the adjuster trace's summary (at TP > 1 each rank's trace set beside
rank 0's: rank_traces), and whether every request completed. Prints a short table.
``--budget-s`` stops the traffic (and says so) if the run would outlast a device call.
bench_serving writes its numbers only when all its requests are done, so a stopped run
keeps the server-side numbers (log, memory, trace) and no latency or throughput figures.
A run ended by SIGTERM (the ``timeout`` of a device call whose server started slowly)
writes the same, marked ``"cut"``. With ``--card-cap`` the JSON's ``card_cap_log`` says
what the cap did: at start, how far what lay outside torch grew and the cap followed it
down.

A CPU dry run of the whole path (tests/server/test_bench_serving.py does one):
``--device-flags "--device cpu --disable-cuda-graph" --card-gb 0`` and the KV cap
after ``--``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_rimuru.adjuster.cost import step_record_path  # noqa: E402
from sglang_rimuru.serving import start_local_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from code_digest import device_of, tree_digest  # noqa: E402
from decode_log import log_stats, read_lines  # noqa: E402
from per_rank import SMI_APPS, SMI_GPUS, parse_smi, wants_trace  # noqa: E402
from phases import aggregate, parse_phases, phase_datasets, phase_summary  # noqa: E402
from warmup_reads import lone_warmup  # noqa: E402
from window import line_tokens, timeline  # noqa: E402

#: what the lent H200 needs (no flashinfer there; bench/device/setup_device.sh)
DEVICE_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
H200_MIB = 143_771
DEFAULT_DATASET = "../shared/data/sharegpt_1000_seed1_ctx8192.json.gz"


def card_fraction(card_gib: float, total_mib: float = H200_MIB) -> float:
    """SGLang's static fraction on a real card of ``card_gib``, emulated on this GPU."""
    return round(0.886 * card_gib * 1024 / total_mib, 4)


def this_gpu() -> dict:
    """The first GPU's name and total MiB by nvidia-smi: the card rule's denominator, so that
    an H100 lent for the H200 (81,559 MiB) emulates the same card. Without nvidia-smi (a CPU
    dry run) the H200's, as every run before this was."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
        name, total = (x.strip() for x in line.rsplit(",", 1))
        return {"name": name, "total_mib": int(total)}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"name": None, "total_mib": H200_MIB}


def tree_rss_mib(pid: int) -> int:
    """Resident host memory of process ``pid`` and its children (page-locked expert
    weights are resident), MiB; 0 if it is gone (or psutil is missing)."""
    try:
        import psutil  # SGLang's own dependency
    except ImportError:
        return 0

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total >> 20


class GpuSampler(threading.Thread):
    """nvidia-smi every ``period`` s: each GPU's memory and each process's (by GPU: at
    ``--tp-size 2`` every rank is its own emulated card, per_rank.py); and the server's
    host memory (``watch(pid)``), GPU or not."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.peak_gpu_mib_by_gpu: dict[int, int] = {}
        self.peak_process_mib_by_gpu: dict[int, int] = {}
        self.peak_host_rss_mib = 0
        self.pid: int | None = None
        self.samples: list[tuple[float, int]] = []  # (s, the fullest GPU's MiB)
        self._stop = threading.Event()
        self._gpu = True

    @property
    def peak_gpu_mib(self) -> int:
        """The fullest GPU's peak (the card check counts the worst rank)."""
        return max(self.peak_gpu_mib_by_gpu.values(), default=0)

    @property
    def peak_process_mib(self) -> int:
        return max(self.peak_process_mib_by_gpu.values(), default=0)

    def watch(self, pid: int) -> None:
        self.pid = pid

    def run(self) -> None:
        t0 = time.time()
        while not self._stop.is_set():
            if self.pid is not None:
                self.peak_host_rss_mib = max(self.peak_host_rss_mib, tree_rss_mib(self.pid))
            if self._gpu:
                self._sample_gpu(t0)
            self._stop.wait(self.period)

    def _sample_gpu(self, t0: float) -> None:
        try:
            gpus, apps = (subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
                          for cmd in (SMI_GPUS, SMI_APPS))
        except Exception:  # noqa: BLE001 - no nvidia-smi (CPU dry run): nothing to sample
            self._gpu = False
            return
        self.add_sample(round(time.time() - t0, 1), *parse_smi(gpus, apps))

    def add_sample(self, t: float, used: dict[int, int], largest: dict[int, int]) -> None:
        for peaks, now in ((self.peak_gpu_mib_by_gpu, used), (self.peak_process_mib_by_gpu, largest)):
            for gpu, mib in now.items():
                peaks[gpu] = max(peaks.get(gpu, 0), mib)
        if used:
            self.samples.append((t, max(used.values())))

    def stop(self) -> None:
        self._stop.set()


def card_cap_log(log: str) -> dict | None:
    """What the emulated card's cap did (``--card-cap``; patches/rimuru_patches/card_cap.py's
    log lines): the cap at start and what lay outside torch then, how far what lies outside
    torch grew and the cap followed it down. None without a cap. The process's peak is at most
    the lowest cap plus the most outside torch, plus what changed within a second."""
    start = re.search(r"torch's allocator capped at ([0-9.]+) MiB of the \d+ MiB card \(([0-9.]+) MiB in use "
                      r"outside it", log)
    if not start:
        return None
    cap, outside = float(start.group(1)), float(start.group(2))
    follows = [(float(o), float(c)) for o, c in re.findall(
        r"([0-9.]+) MiB now in use outside torch's allocator; its cap follows to ([0-9.]+) MiB", log)]
    return {"cap_mib_start": cap, "outside_mib_start": outside,
            "outside_mib_max": max([outside, *(o for o, _ in follows)]),
            "cap_mib_min": min([cap, *(c for _, c in follows)]), "follows": len(follows)}


class _Cut(Exception):
    """The run's outer time limit arrived (``timeout`` sends SIGTERM): write what was measured."""


def _cut(signum, frame):
    raise _Cut()


def read_jsonl(path: Path) -> list[dict] | None:
    """The lines of a JSON-lines file the server writes (the adjuster trace, one object per
    order; its step record, ``step_record_path`` of the trace, one per dump), or None when
    the run wrote none."""
    return read_lines(path) if path.exists() else None


def step_summary(lines: list[dict] | None, width: int = 8) -> list[list] | None:
    """The decode steps the cost-aware adjuster timed (the step record's ``lines``,
    read_jsonl of ``step_record_path`` of its trace; None: the run wrote none) by batch, in
    buckets of ``width`` requests: [first batch, last batch, steps, median ms, mean batch,
    mean expected offloaded reads, median GPU ms of the decode passes of that batch (the
    record's ``"gpu"`` rows; None without)]."""
    if lines is None:
        return None
    buckets: dict[int, list] = {}
    for b, ms, reads in (s for line in lines for s in line["steps"]):
        buckets.setdefault((b - 1) // width, []).append((b, ms, reads))
    gpu: dict[int, list] = {}
    for b, ms in (g for line in lines for g in line.get("gpu", [])):
        gpu.setdefault((b - 1) // width, []).append(ms)
    return [[k * width + 1, (k + 1) * width, len(xs), round(statistics.median(x[1] for x in xs), 2),
             round(sum(x[0] for x in xs) / len(xs), 1), round(sum(x[2] for x in xs) / len(xs), 1),
             round(statistics.median(gpu[k]), 2) if k in gpu else None]
            for k, xs in sorted(buckets.items())]


def pass_tokens(lines: list[dict] | None, t_from: float) -> dict | None:
    """Output tokens the timed passes made after ``t_from`` (wall clock), from the step
    record's ``"gpu"`` (decode: one token per request) and ``"passes"`` rows (extend and
    mixed: one per request, so at most one too many per pass for the request whose
    prompt chunk was not its last): a run stopped at its budget has no bench_serving
    figures, and with prefill passes carrying the decodes SGLang's decode log misses them.
    ``seconds`` runs from ``t_from`` to the last record written. ``lines``: the step
    record's, as step_summary's."""
    lines = [x for x in lines or [] if x["t"] > t_from]
    if not lines:
        return None
    kinds = [kind for x in lines for kind, _, _ in x.get("passes", [])]
    tokens = sum(line_tokens(x) for x in lines)
    seconds = lines[-1]["t"] - t_from
    return {"tokens": tokens, "seconds": round(seconds, 1), "tok_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "decode_passes": sum(len(x.get("gpu", [])) for x in lines), "mixed_passes": kinds.count("mixed"),
            "extend_passes": kinds.count("extend")}


def pass_memory(lines: list[dict] | None) -> dict | None:
    """What the caching allocator did per pass (the step record's ``"memory"`` rows:
    ``[kind, batch, peak allocated MiB, reserved MiB]``, ``pass_timer.py``): by pass kind,
    the largest batch, the highest peak and the batch it came with, and the reserved
    MiB after the last pass and at most. Reserved past the peaks is the allocator's cache
    (blocks of earlier sizes kept); peaks growing with the batch are live tensors. None
    without rows (no trace, not CUDA, or a record from before ``"memory"``). ``lines``: the
    step record's, as step_summary's."""
    rows = [r for x in lines or [] for r in x.get("memory", [])]
    if not rows:
        return None
    kinds = {}
    for kind, batch, peak, reserved in rows:
        k = kinds.setdefault(kind, {"passes": 0, "max_batch": 0, "peak_mib": -1, "peak_at_batch": None})
        k["passes"] += 1
        k["max_batch"] = max(k["max_batch"], batch)
        if peak > k["peak_mib"]:
            k["peak_mib"], k["peak_at_batch"] = peak, batch
    return {"by_kind": kinds, "reserved_mib_last": rows[-1][3], "reserved_mib_max": max(r[3] for r in rows),
            "peak_mib_max": max(r[2] for r in rows)}


def trace_summary(lines: list[dict] | None) -> dict | None:
    """The adjuster trace's ``lines`` (read_jsonl; None: the run wrote none) in brief."""
    if lines is None:
        return None
    return {
        "rounds": len(lines),
        "evicted": sum(len(x["evicted"]) for x in lines),
        "restored": sum(len(x["restored"]) for x in lines),
        "min_resident": min((x["resident"] for x in lines), default=None),
        "final_resident": lines[-1]["resident"] if lines else None,
        "cost_ms": lines[-1].get("cost_ms") if lines else None,  # the last order's prices
        "series": [(round(x["t"] - lines[0]["t"], 2), x["resident"], x.get("waiting", 0),
                    x.get("pool", {}).get("kv_split_expert_pages", 0)) for x in lines],
    }


def _order(line: dict) -> tuple:
    """What must be equal on every rank: the order (its seq, what left and came back) and the
    resident sets it left; the wall time and the round counter are each rank's own."""
    return line["seq"], line["evicted"], line["restored"], line["resident_sets"]


def rank_traces(trace: Path, rank0: list[dict] | None) -> dict | None:
    """At TP > 1 rank ``k > 0`` writes its adjuster trace beside rank 0's as ``TRACE.tpk``
    (``patches/rimuru_patches/unified_pool/runtime.py``). The ranks plan deterministically
    and the round hook checks their agreement (``TPAgreement``); the traces are the
    after-the-fact record that each applied the same orders, line for line. None at TP = 1
    (no ``TRACE.tpk``). ``compared`` lines, the shortest rank's: at the server's stop a rank
    may not yet have written its line for the last order. ``first_difference_seq``: rank
    0's seq at the first line where a rank differs (None: identical). ``rank0``: the lines
    of ``trace`` itself, as the caller read them for trace_summary."""
    rank = re.compile(re.escape(trace.name) + r"\.tp(\d+)$")
    others = sorted((int(m.group(1)), p) for p in trace.parent.glob(trace.name + ".tp*")
                    if (m := rank.match(p.name)))
    if not others:
        return None
    ranks = [rank0 or [], *(read_jsonl(p) or [] for _, p in others)]
    compared = min(len(r) for r in ranks)
    first = next((ranks[0][i]["seq"] for i in range(compared)
                  if any(_order(r[i]) != _order(ranks[0][i]) for r in ranks[1:])), None)
    return {"ranks": 1 + len(others), "rounds": [len(r) for r in ranks], "compared": compared,
            "orders_identical": first is None, "first_difference_seq": first}


#: what bench_serving prints after its warmup request, one second (its sleep) before its traffic
MAIN_RUN = "Starting main benchmark run"


def warm_bench() -> subprocess.Popen:
    """A bench_serving process importing SGLang now (``warm_bench.py``: ~20 s on the device),
    beside the server's start, waiting for ``bench_serving`` to hand it its arguments."""
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("warm_bench.py"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each line as printed


def end_unused(hosts: list) -> None:
    """Kill the ``warm_bench`` processes the traffic did not use (a run stopped or failed first)."""
    for proc in hosts:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def bench_serving(argv: list[str], timeout: float, began: list, proc: subprocess.Popen | None = None
                  ) -> tuple[str, str]:
    """Runs bench_serving with ``argv`` in ``proc`` (a ``warm_bench``; a new one if None) to its
    end or ``timeout`` (then ``TimeoutExpired``, the child killed, as ``subprocess.run`` does);
    returns its stdout and stderr. Appends to ``began`` the wall time its requests began, read
    from its ``MAIN_RUN`` line as it is printed: it loads its tokenizer and data and sends a
    warmup request first (~5 s once imported), and a rate taken from its launch counts that
    as serving time."""
    proc = warm_bench() if proc is None else proc
    try:
        proc.stdin.write(json.dumps(argv) + "\n")
        proc.stdin.close()
    except BrokenPipeError:  # it died importing: its stderr says why, and no result is written
        pass
    out_lines: list[str] = []
    err_lines: list[str] = []

    def read_out() -> None:
        for line in proc.stdout:
            if MAIN_RUN in line and not began:
                began.append(time.time() + 1.0)
            out_lines.append(line)

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    finally:  # the budget, or the call's SIGTERM (_Cut): bench_serving must not outlive it
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join(timeout=5)
    return "".join(out_lines), "".join(err_lines)


def run_traffic(args, phases, datasets, port: str, out: Path, t0: float, results: list, bench_logs: list,
                began: list, hosts: list | None = None) -> bool:
    """bench_serving once per phase against the server on ``port``, within ``--budget-s`` of
    ``t0``, phase ``i`` in ``hosts[i]`` (``warm_bench`` processes started with the server; new
    ones where None); appends each phase's summary to ``results`` and its output to
    ``bench_logs``, and to ``began`` the wall time the first phase's requests began. Returns
    whether the budget stopped the traffic."""
    stopped = False
    for i, ((rate, num), data) in enumerate(zip(phases, datasets)):
        bench_out = out / (f"{args.name}_bench.jsonl" if not args.phases else f"{args.name}_bench_phase{i + 1}.jsonl")
        bench_out.unlink(missing_ok=True)
        cmd = ["--backend", "sglang", "--host", "127.0.0.1",
               "--port", port, "--dataset-name", "sharegpt", "--dataset-path", str(data),
               "--num-prompts", str(num), "--request-rate", str(rate), "--seed", str(args.seed),
               "--sharegpt-context-len", str(args.context_len), "--tokenizer", args.model,
               "--output-file", str(bench_out), "--disable-tqdm", *(["--output-details"] if args.phases else [])]
        left = args.budget_s - (time.time() - t0)
        try:
            if left <= 0:
                raise subprocess.TimeoutExpired(cmd, 0)
            stdout, stderr = bench_serving(cmd, left, began, hosts[i] if hosts and i < len(hosts) else None)
            bench_logs.append(stdout[-3000:] + stderr[-2000:])
        except subprocess.TimeoutExpired:
            stopped = True
            bench_logs.append(f"stopped after {args.budget_s} s")
        result = json.loads(bench_out.read_text().splitlines()[-1]) if bench_out.exists() else {}
        # bench_serving writes its result before it exits; one that finished the traffic and
        # only overran the budget while exiting (or loading its tokenizer) was not stopped
        stopped = stopped and result.get("completed") != num
        results.append(result)
        if stopped:
            break
    return stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--card-gb", type=float, required=True, help="the card to emulate, GiB")
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dataset", default=DEFAULT_DATASET)
    ap.add_argument("--context-len", type=int, default=8192,
                    help="bench_serving's ShareGPT context filter (the anchors': 8192)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=420, help="stop the traffic after this long")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=160)
    ap.add_argument("--device-flags", default=" ".join(DEVICE_FLAGS))
    ap.add_argument("--skew", type=float, default=0.0,
                    help="skew the dummy routers: bias -s*log(1+rank) per layer (bench/serving/skew)")
    ap.add_argument("--router-noise", type=float, default=0.0,
                    help="0 to 1: that share of each token's router logits drawn fresh every forward (1: "
                         "independent routings; dummy weights route by the token alone: bench/serving/skew)")
    ap.add_argument("--phases", default=None, metavar="RATE:NUM,...",
                    help="phased traffic (bench/serving/phases.py): one bench_serving run per phase against "
                         "the same server, each from its own slice of the dataset; overrides --rate and "
                         "--num-prompts; --budget-s covers all phases")
    ap.add_argument("--card-cap", action="store_true",
                    help="hold torch's allocator in every server process to the card (SGLANG_RIMURU_CARD_MIB, "
                         "patches/rimuru_patches/card_cap.py): cache given back at the card's size, as on the card")
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    server_args = [a for a in args.server_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        phases = parse_phases(args.phases) if args.phases else [(args.rate, args.num_prompts)]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    num_prompts = sum(n for _, n in phases)
    if not 0 <= args.router_noise <= 1:
        raise SystemExit(f"--router-noise {args.router_noise}: the share of fresh draws in each token's logits, 0 to 1")

    dataset = Path(args.dataset)
    if dataset.suffix == ".gz":  # bench_serving reads plain JSON
        plain = Path("/tmp") / dataset.name[:-3]
        if not plain.exists():
            with gzip.open(dataset) as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
        dataset = plain
    datasets = phase_datasets(dataset, [n for _, n in phases], Path("/tmp")) if args.phases else [dataset]

    flags = ["--model-path", args.model, "--load-format", "dummy", "--chunked-prefill-size", "2048",
             "--cuda-graph-max-bs", str(args.cuda_graph_max_bs), *args.device_flags.split()]
    gpu = this_gpu()
    fraction = card_fraction(args.card_gb, gpu["total_mib"])
    if "--mem-fraction-static" not in server_args and args.card_gb > 0:
        flags += ["--mem-fraction-static", str(fraction)]
    trace = out / f"{args.name}_trace.jsonl"
    if wants_trace(server_args):
        flags += ["--rimuru-adjuster-trace", str(trace)]
    log_path = out / f"{args.name}.log"
    sampler = GpuSampler()
    sampler.start()
    t_launch = time.time()
    env = {}
    if args.skew > 0 or args.router_noise > 0:
        path = os.environ.get("PYTHONPATH", "")
        env = {"PYTHONPATH": f"{Path(__file__).parent / 'skew'}:{path}", "RIMURU_BENCH_ROUTER_SKEW": str(args.skew),
               "RIMURU_BENCH_ROUTER_NOISE": str(args.router_noise),
               "RIMURU_BENCH_DEVICE_SITE": "1" if "bench/device/site" in path else "0"}
    if args.card_cap:
        if args.card_gb <= 0:
            raise SystemExit("--card-cap needs --card-gb above 0")
        env["SGLANG_RIMURU_CARD_MIB"] = str(int(args.card_gb * 1024))
    # bench_serving's imports, one process per phase, while the server starts (warm_bench.py)
    hosts = [warm_bench() for _ in phases]
    try:
        srv = start_local_server([*flags, *server_args], log_path, timeout=600, env=env)
    except BaseException:
        end_unused(hosts)
        raise
    sampler.watch(srv.proc.pid)  # from here on (the weights are loaded: what stays resident)
    ready_s = time.time() - t_launch
    port = srv.url.rsplit(":", 1)[1]
    t0 = time.time()
    results, bench_logs, began = [], [], []  # began: when bench_serving's first requests went out
    cut = False
    # A device call's `timeout` may end the run before its budget (a slow start); the numbers
    # the server has logged so far are still written, marked "cut"
    signal.signal(signal.SIGTERM, _cut)
    try:
        stopped = run_traffic(args, phases, datasets, port, out, t0, results, bench_logs, began, hosts)
    except _Cut:
        stopped = cut = True
        if len(results) < len(phases):
            results.append({})  # the phase it was in
        bench_logs.append(f"cut by SIGTERM after {time.time() - t0:.0f} s of traffic")
    finally:
        end_unused(hosts)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    bench_log = "\n".join(bench_logs)
    traffic_s = time.time() - t0
    sampler.stop()
    log = log_path.read_text(errors="replace")
    srv.stop()
    result = aggregate(results) if args.phases else results[0]
    # the adjuster trace and the elastic step record beside it, each read once for every figure below
    trace_lines, step_lines = read_jsonl(trace), read_jsonl(Path(step_record_path(str(trace))))
    # a launch table under trial, read by the server before the kernel's own (code_digest.py counts it)
    config_dir = os.environ.get("RIMURU_KERNELS_CONFIG_DIR") or None
    res = {
        "name": args.name, "server_args": server_args, "card_gib": args.card_gb, "card_cap": args.card_cap,
        "router_skew": args.skew, "router_noise": args.router_noise,
        # the server code this run ran (code_digest.py: the device has no .git to name a commit)
        "code_digest": tree_digest(device=device_of(gpu["name"]), config_dirs=config_dir),
        "kernel_config_dir": config_dir, "model": Path(args.model).name,
        # a phased run has no one rate (report.py leaves it out of rate plots and traffic floors)
        "gpu": gpu, "fraction": fraction, "rate": None if args.phases else args.rate,
        "num_prompts": num_prompts, "seed": args.seed,
        **({"phases": [phase_summary(rate, num, r) for (rate, num), r in zip(phases, results)]} if args.phases else {}),
        "ready_s": round(ready_s, 1), "traffic_s": round(traffic_s, 1), "stopped_at_budget": stopped, "cut": cut,
        "all_completed": result.get("completed") == num_prompts,
        "bench": {k: v for k, v in result.items() if not isinstance(v, list)},
        # the decode rate from the traffic's first request on (the warm-up's lines apart: lone_step_ms)
        "log": log_stats(log, began[0] if began else None),
        "peak_gpu_mib": sampler.peak_gpu_mib, "peak_process_mib": sampler.peak_process_mib,
        "peak_host_rss_mib": sampler.peak_host_rss_mib,
        # by GPU index (JSON keys are strings): at --tp-size 2 one emulated card per rank
        "peak_gpu_mib_by_gpu": sampler.peak_gpu_mib_by_gpu, "peak_process_mib_by_gpu": sampler.peak_process_mib_by_gpu,
        "card_mib": args.card_gb * 1024, "gpu_mem_series": sampler.samples[::4],
        "trace": trace_summary(trace_lines),
        "tp_traces": rank_traces(trace, trace_lines),  # TP > 1: every rank's trace beside rank 0's, line for line
        "steps": step_summary(step_lines),
        # from the first request (bench_serving's own start is no serving time), else from t0
        "traffic_began_s": round(began[0] - t0, 1) if began else None,
        "traffic_began_wall": round(began[0], 1) if began else None,
        "pass_tokens": pass_tokens(step_lines, began[0] if began else t0),
        "pass_memory": pass_memory(step_lines),
        # the batch-1 steps before the traffic: the same work in every run of one model and
        # card, so their time is the machine's (warmup_reads.py: two H100s differed 1.54x)
        "warmup": lone_warmup(step_lines, began[0]) if began and step_lines else None,
        # output tokens as the traffic goes on, for comparing two stopped runs over the same
        # first seconds (window.py): the pass record's where the server wrote one, else SGLang's log
        "timeline": timeline(step_lines, log, began[0]) if began else None,
        "card_cap_log": card_cap_log(log),
        "tracebacks": log.count("Traceback"),
        "bench_log_tail": bench_log[-1500:],
    }
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    b = res["bench"]
    print(f"{args.name}: completed {b.get('completed')}/{num_prompts} in {b.get('duration', 0):.1f} s; "
          f"out {b.get('output_throughput', 0):.0f} tok/s; TTFT med {b.get('median_ttft_ms', 0):.0f} "
          f"p99 {b.get('p99_ttft_ms', 0):.0f} ms; TPOT med {b.get('median_tpot_ms', 0):.2f} "
          f"p99 {b.get('p99_tpot_ms', 0):.2f} ms; peak running {res['log']['peak_running']}; "
          f"peak GPU {res['peak_gpu_mib']} MiB (process {res['peak_process_mib']}, card {res['card_mib']:.0f}); "
          f"host RSS {res['peak_host_rss_mib']} MiB; "
          f"ready {res['ready_s']} s; tracebacks {res['tracebacks']}"
          + (f"; warm-up step {wu['median_ms']} ms ({wu['reads']} expected reads)" if (wu := res["warmup"]) else "")
          + (f"; trace: {res['trace']['evicted']} out / {res['trace']['restored']} in, min resident "
             f"{res['trace']['min_resident']}" if res["trace"] else "")
          + (f" ; STOPPED AT BUDGET (SGLang's decode log: mean {res['log']['gen_tok_s_mean']} tok/s over "
             f"{res['log']['gen_tok_s_lines']} lines)" if stopped else "")
          + (f"; pass record: {pt['tokens']} tokens in {pt['seconds']} s = {pt['tok_s']} tok/s "
             f"({pt['decode_passes']} decode, {pt['mixed_passes']} mixed, {pt['extend_passes']} extend passes)"
             if (pt := res["pass_tokens"]) else "")
          + (f"; allocator: peak {pm['peak_mib_max']} MiB, reserved up to {pm['reserved_mib_max']} MiB ("
             + ", ".join(f"{k} peak {v['peak_mib']} MiB at batch {v['peak_at_batch']}, largest batch {v['max_batch']}"
                         for k, v in pm["by_kind"].items()) + ")"
             if (pm := res["pass_memory"]) else "")
          + (f"; card cap: {cc['cap_mib_start']:.0f} MiB at start, followed to {cc['cap_mib_min']:.0f} "
             f"(outside torch {cc['outside_mib_start']:.0f} -> up to {cc['outside_mib_max']:.0f} MiB)"
             if (cc := res["card_cap_log"]) else "")
          + (f"; TP ranks: peak GPU MiB by GPU {res['peak_gpu_mib_by_gpu']}, trace lines {tt['rounds']}, orders "
             + (f"identical over {tt['compared']}" if tt["orders_identical"]
                else f"DIFFER from seq {tt['first_difference_seq']}") if (tt := res["tp_traces"]) else "")
          + ("; CUT by SIGTERM (the call's time) before the budget" if cut else ""), flush=True)


if __name__ == "__main__":
    main()
