"""What a run at ``--tp-size N`` measures per rank (issue 14): each GPU's peak memory, and
whether every rank's adjuster applied the same orders.

* ``parse_smi``: nvidia-smi's per-GPU and per-process rows, by GPU index. A TP=2 server
  is one scheduler process per GPU, each its own emulated card, so the card check is
  per GPU (the largest one counts), not the machine's sum; on one GPU it is what the
  harness always read.
* ``rank_traces``: at TP > 1 rank ``k > 0`` writes its adjuster trace beside rank 0's
  as ``TRACE.tpk`` (``patches/rimuru_patches/unified_pool/runtime.py``). The ranks plan
  deterministically and the round hook checks their agreement (``TPAgreement``); the
  traces are the after-the-fact record that each applied the same orders: the same seq,
  evictions, restores and resident sets, line for line.
* ``rank_table``: the report's table of both, one row per run at TP > 1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SMI_GPUS = ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"]
SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


def parse_smi(gpus: str, apps: str) -> tuple[dict[int, int], dict[int, int]]:
    """(memory used on each GPU, the largest process's on each GPU), MiB by GPU index, from
    the outputs of ``SMI_GPUS`` and ``SMI_APPS``. A value nvidia-smi does not give (``[N/A]``)
    is left out rather than read as 0."""
    used: dict[int, int] = {}
    index_of: dict[str, int] = {}
    for line in gpus.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        index_of[parts[1]] = int(parts[0])
        if parts[2].isdigit():
            used[int(parts[0])] = int(parts[2])
    largest: dict[int, int] = {}
    for line in apps.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or parts[1] not in index_of or not parts[2].isdigit():
            continue
        gpu = index_of[parts[1]]
        largest[gpu] = max(largest.get(gpu, 0), int(parts[2]))
    return used, largest


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _order(line: dict) -> tuple:
    """What must be equal on every rank: the order (its seq, what left and came back) and the
    resident sets it left; the wall time and the round counter are each rank's own."""
    return line["seq"], line["evicted"], line["restored"], line["resident_sets"]


def rank_traces(trace: Path) -> dict | None:
    """The ranks' traces side by side (None at TP = 1: no ``TRACE.tpk`` beside ``trace``).
    ``compared`` lines, the shortest rank's: at the server's stop a rank may not yet have
    written its line for the last order. ``first_difference_seq``: rank 0's seq at the first
    line where a rank differs (None: identical)."""
    rank = re.compile(re.escape(trace.name) + r"\.tp(\d+)$")
    others = sorted((int(m.group(1)), p) for p in trace.parent.glob(trace.name + ".tp*")
                    if (m := rank.match(p.name)))
    if not others:
        return None
    ranks = [_read(trace), *(_read(p) for _, p in others)]
    compared = min(len(r) for r in ranks)
    first = next((ranks[0][i]["seq"] for i in range(compared)
                  if any(_order(r[i]) != _order(ranks[0][i]) for r in ranks[1:])), None)
    return {"ranks": 1 + len(others), "rounds": [len(r) for r in ranks], "compared": compared,
            "orders_identical": first is None, "first_difference_seq": first}


def tp_size(r: dict) -> int:
    """The run's ``--tp-size`` (``--tp``), from the flags it passed the server; 1 without."""
    args = r.get("server_args") or []
    for i, a in enumerate(args[:-1]):
        if a in ("--tp-size", "--tp"):
            return int(args[i + 1])
    return 1


def rank_table(results: list[dict]) -> str | None:
    """One row per run at TP > 1 (None if there is none): each GPU's peak and its largest
    process's against the card, the ranks' adjuster trace lines and whether they agree."""
    runs = [r for r in results if tp_size(r) > 1]
    if not runs:
        return None
    lines = ["| system | TP | peak GPU GiB per GPU / card | largest process GiB per GPU "
             "| adjuster trace lines per rank | orders identical on every rank |", "|---|---|---|---|---|---|"]

    def per_gpu(d: dict | None) -> str:
        return " / ".join(f"{v / 1024:.1f}" for _, v in sorted((d or {}).items(), key=lambda kv: int(kv[0]))) or "-"

    for r in runs:
        ranks = r.get("tp_traces")
        if ranks:
            agree = (f"yes, {ranks['compared']} lines" if ranks["orders_identical"]
                     else f"**no**: first at seq {ranks['first_difference_seq']}")
            orders = " / ".join(str(n) for n in ranks["rounds"])
        else:
            agree = orders = "-" if "elastic" not in " ".join(r.get("server_args") or []) else "no trace"
        lines.append(f"| {r['name']} | {tp_size(r)} | {per_gpu(r.get('peak_gpu_mib_by_gpu'))} / {r['card_gib']:.0f} | "
                     f"{per_gpu(r.get('peak_process_mib_by_gpu'))} | {orders} | {agree} |")
    return "\n".join(lines)
