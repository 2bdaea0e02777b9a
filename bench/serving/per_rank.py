"""What a run at ``--tp-size N`` measures per rank (issue 14): each GPU's peak memory, and
whether every rank's adjuster applied the same orders.

* ``parse_smi``: nvidia-smi's per-GPU and per-process rows, by GPU index. A TP=2 server
  is one scheduler process per GPU, each its own emulated card, so the card check is
  per GPU (the largest one counts), not the machine's sum; on one GPU it is what the
  harness always read.
* ``rank_table``: the report's table, one row per run at TP > 1: each GPU's peak, and
  the ranks' adjuster traces as ``run_one.rank_traces`` compared them (rank ``k > 0``
  writes its trace beside rank 0's as ``TRACE.tpk``: the same orders line for line).
"""

from __future__ import annotations

SMI_GPUS = ["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"]
SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


def wants_trace(server_args: list[str]) -> bool:
    """Whether run_one asks the server for an adjuster trace: exactly when "elastic" is one of
    its flags (``--rimuru-mode elastic``). The rank table reads a missing trace by the same test."""
    return "elastic" in server_args


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
            agree = orders = "no trace" if wants_trace(r.get("server_args") or []) else "-"
        lines.append(f"| {r['name']} | {tp_size(r)} | {per_gpu(r.get('peak_gpu_mib_by_gpu'))} / {r['card_gib']:.0f} | "
                     f"{per_gpu(r.get('peak_process_mib_by_gpu'))} | {orders} | {agree} |")
    return "\n".join(lines)
