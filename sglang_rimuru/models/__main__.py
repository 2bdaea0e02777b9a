"""python -m sglang_rimuru.models {list | write NAME|all [--out DIR] [--seed N] | ensure NAME}

Paths of written models go to stdout, one per line; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .specs import MODELS, UnknownModelError, get_spec, moe_shape
from .store import DEFAULT_SEED, ensure_model, is_current, model_dir_name, models_dir, write_model


class _StderrHandler(logging.Handler):
    """One plain line per record, to whatever sys.stderr is at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), file=sys.stderr)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def cmd_list(_: argparse.Namespace) -> int:
    print(f"{'name':<18} {'architecture':<20} {'layers':>6} {'experts':>9} {'expert':>9} {'all experts':>11} {'KV/token':>9}  weights  cached")
    for name, spec in MODELS.items():
        shape = moe_shape(spec.config)
        cached = models_dir() / model_dir_name(name)
        print(
            f"{name:<18} {spec.architecture:<20} {shape.num_layers:>6} {f'{shape.num_experts}/top-{shape.top_k}':>9} "
            f"{_size(shape.expert_bytes):>9} {_size(shape.routed_expert_bytes):>11} {_size(shape.kv_bytes_per_token):>9}  "
            f"{'random ' if spec.has_weights else 'none   '}  {cached if is_current(cached, name) else '-'}"
        )
    return 0


def cmd_write(args: argparse.Namespace) -> int:
    names = list(MODELS) if args.name == "all" else [args.name]
    for name in names:
        if args.out is None:
            target = models_dir() / model_dir_name(name, args.seed if get_spec(name).has_weights else DEFAULT_SEED)
        else:
            target = Path(args.out) / name if args.name == "all" else Path(args.out)
        print(write_model(name, target, seed=args.seed))
    return 0


def cmd_ensure(args: argparse.Namespace) -> int:
    print(ensure_model(args.name, args.cache_dir, seed=args.seed))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_rimuru.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="known models, their sizes and cache state").set_defaults(func=cmd_list)
    w = sub.add_parser("write", help="(re)generate a model; NAME 'all' writes every model")
    w.add_argument("name", metavar="NAME", help=f"one of: all, {', '.join(MODELS)}")
    w.add_argument("--out", help="model directory (for 'all': parent directory); default: the cache")
    w.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed of the tiny models (default %(default)s)")
    w.set_defaults(func=cmd_write)
    e = sub.add_parser("ensure", help="print the cached model's path, generating it if missing")
    e.add_argument("name", metavar="NAME")
    e.add_argument("--cache-dir", help=f"parent directory (default {models_dir()})")
    e.add_argument("--seed", type=int, default=DEFAULT_SEED)
    e.set_defaults(func=cmd_ensure)
    args = parser.parse_args(argv)

    log = logging.getLogger(__package__)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        log.addHandler(_StderrHandler())
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        return args.func(args)
    except UnknownModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
