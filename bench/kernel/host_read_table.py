"""A launch table for reading offloaded experts in place, from a ``zero_copy_scale.py --tiles`` run.

    python3 bench/kernel/host_read_table.py ZCS.json --out-dir DIR [--json FILE] [--min-gain 0.05]
    python3 bench/kernel/host_read_table.py --tables-from FILE --out-dir kernels/rimuru_kernels/configs

Why: on a GPU without a tuned table the kernel runs ``configs/default.json``, tuned for
nothing in particular (on the thirty-fourth session's H100s it read Qwen1.5's host pages at the
link's rate, 52 GB/s, as every tile variant did: bench/RESULTS.md). ``zero_copy_scale.py
--tiles`` times launch configs on a decode step whose experts are on host pages; this turns
the fastest into a table the server reads: for each token count T the run measured (the
``compact`` rows of the kernel's own configs, fused gate/up, the most experts out), the
variant with the shortest step, if it beats the table's own (``cfg``) by ``--min-gain`` and its
output was bit-equal to the all-in-HBM step, replaces the entry of the table's token count
nearest to T (the entry a batch of T reads): the spec's keys are set, BLOCK_SIZE_M and
GROUP_SIZE_M (the token alignment) only where the spec names them (a spec's BLOCK_SIZE_M also
sets how often an offloaded expert is read: once per BLOCK_SIZE_M of its tokens). Entries no
measured T reaches stay as they are. No down table: the down GEMM takes the gate/up config, as the run timed it.

Writes ``E=..,N=..,device_name=<the run's GPU>.json`` into ``--out-dir`` (a folder for
``RIMURU_KERNELS_CONFIG_DIR``, which ``code_digest.py`` counts as the server's code, or the
kernel's ``configs/``), and with ``--json`` the same table in a file whose name the device call
brings back (it does not bring back names holding ``=`` or ``,``); ``--tables-from`` writes
that file's table out here. Without a gain it writes nothing and says so. No GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru_kernels.moe_config import CONFIG_DIR, DEFAULT_CONFIG_FILE, config_file_name  # noqa: E402
from zero_copy_scale import SHAPES, with_override  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "serving"))
from code_digest import device_of  # noqa: E402


def winners(rows: list[dict], min_gain: float) -> dict[int, dict]:
    """Per token count, the fastest bit-equal ``compact`` variant of the kernel's configs
    (fused gate/up, the largest k measured) where it beats ``cfg`` by ``min_gain``:
    {T: {"spec", "step_ms", "cfg_ms", "GBps"}}."""
    out = {}
    ours = [r for r in rows if r.get("layout") == "compact" and r.get("configs", "kernel") == "kernel"
            and r.get("w13", "fused") == "fused" and r.get("out_set", "random") == "random"]
    for T in sorted({r["T"] for r in ours}):
        k = max(r["k"] for r in ours if r["T"] == T)
        at = [r for r in ours if r["T"] == T and r["k"] == k]
        cfg = [r for r in at if r.get("stages", "cfg") == "cfg"]
        if not cfg:
            continue  # nothing to beat
        best = min((r for r in at if r.get("equal")), key=lambda r: r["step_ms"], default=None)
        if best is None or best.get("stages", "cfg") == "cfg" or best["step_ms"] > cfg[0]["step_ms"] * (1 - min_gain):
            continue
        out[T] = {"spec": best["stages"], "k": k, "step_ms": round(best["step_ms"], 2),
                  "cfg_ms": round(cfg[0]["step_ms"], 2), "GBps": round(best["GBps"], 1)}
    return out


def table_with(base: dict[int, dict], picked: dict[int, dict]) -> dict[int, dict]:
    """``base`` with the entry nearest to each picked T set to that T's spec."""
    table = {k: dict(v) for k, v in base.items()}
    for T, w in picked.items():
        key = min(table, key=lambda m: abs(m - T))
        table[key] = with_override(table[key], None, w["spec"])[0]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("zcs", nargs="?", help="zero_copy_scale.py's JSON of a --tiles run")
    ap.add_argument("--out-dir", required=True, help="where the table goes (RIMURU_KERNELS_CONFIG_DIR or configs/)")
    ap.add_argument("--json", help="also write the table here, under a name the device call brings back")
    ap.add_argument("--tables-from", help="a --json file of an earlier run: write its table to --out-dir")
    ap.add_argument("--base", help="the table the run's cfg rows read (default: the kernel's default.json)")
    ap.add_argument("--min-gain", type=float, default=0.05, help="the step a variant must save over cfg")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    if args.tables_from:
        made = json.loads(Path(args.tables_from).read_text())
    else:
        if not args.zcs:
            raise SystemExit("host_read_table.py: a zero_copy_scale.py JSON, or --tables-from")
        run = json.loads(Path(args.zcs).read_text())
        base_path = Path(args.base) if args.base else CONFIG_DIR / DEFAULT_CONFIG_FILE
        if not args.base and any(Path(f).name != DEFAULT_CONFIG_FILE for f in run.get("configs_read", [])):
            raise SystemExit(f"host_read_table.py: the run read {run['configs_read']}, not default.json: "
                             "pass that table as --base")
        picked = winners(run["rows"], args.min_gain)
        for T, w in picked.items():
            print(f"T={T}, k={w['k']}: {w['spec']} {w['step_ms']} ms against the table's {w['cfg_ms']} "
                  f"({w['GBps']} GB/s)")
        if not picked:
            print("host_read_table.py: no variant beats the table's own configs by "
                  f"{args.min_gain:.0%}: no table written")
            return
        E, _, I, _ = SHAPES[run["shape"]]
        base = {int(k): v for k, v in json.loads(base_path.read_text()).items()}
        made = {"file": config_file_name(E, I, device_of(run["device"])), "picked": picked,
                "base": base_path.name, "table": {str(k): v for k, v in sorted(table_with(base, picked).items())}}
        if args.json:
            Path(args.json).write_text(json.dumps(made, indent=1))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / made["file"]).write_text(json.dumps(made["table"], indent=4) + "\n")
    print(f"wrote {out_dir / made['file']}")


if __name__ == "__main__":
    main()
