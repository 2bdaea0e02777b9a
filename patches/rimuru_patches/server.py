"""The launcher behind ``python -m sglang_rimuru.launch_server``.

Order matters: the device is known before SGLang is imported (on CPU the
process environment and the ``sgl_kernel`` stand-in must be in place first);
then SGLang's parser and the project's parse one command line together;
then cheap checks that would otherwise surface as stack traces deep inside
SGLang (a missing model, a busy port, a missing seam target) end the start
with one line and a non-zero exit, before any weight is loaded.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys

from rimuru_patches.context import ProcessContext

PROG = "python -m sglang_rimuru.launch_server"

logger = logging.getLogger("sglang_rimuru")


class LaunchError(Exception):
    """A problem with the command line or the machine, reported in one line."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (not SGLang's 400-flag usage dump)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise LaunchError(f"{message} (see --help)")


def _peek(argv: list[str]) -> argparse.Namespace:
    """The few flags needed before SGLang may be imported."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--device", default=None)
    peek.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    peek.add_argument("--model-path", "--model", default=None)
    try:
        known, _ = peek.parse_known_args(argv)
    except SystemExit:  # malformed values are reported by the full parser
        known = argparse.Namespace(device=None, tp_size=1, model_path=None)
    return known


def _detect_device(requested: str | None) -> str:
    if requested:
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_model_path(path: str) -> None:
    """A local directory, or a hub id (``org/name``) when a hub is reachable."""
    if os.path.isdir(path):
        return
    is_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None and not os.path.exists(path.split("/")[0])
    if not is_hub_id or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise LaunchError(f"--model-path {path!r} does not exist (no such directory)")


def _check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"--port {port}: address {host}:{port} is already in use") from None
            raise LaunchError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


#: SGLang features the pool modes do not support: (flag, is it set, what it is). Each would
#: otherwise fail later, inside a scheduler (a quantized KV cache, quantized experts)
#: or in ways the pool never saw (a second model beside it, another owner of the KV).
_UNSUPPORTED = (
    ("--ep-size", lambda a: (a.ep_size or 1) > 1, "expert parallelism"),
    ("--pp-size", lambda a: (a.pp_size or 1) > 1, "pipeline parallelism"),
    ("--enable-dp-attention", lambda a: a.enable_dp_attention, "data-parallel attention"),
    ("--moe-a2a-backend", lambda a: a.moe_a2a_backend not in (None, "none"), "expert-parallel all-to-all"),
    ("--enable-two-batch-overlap", lambda a: a.enable_two_batch_overlap, "two-batch overlap"),
    ("--speculative-algorithm", lambda a: a.speculative_algorithm, "speculative decoding (a draft model beside the pool)"),
    ("--quantization", lambda a: a.quantization, "quantized weights (the paged kernel reads bf16/fp16 expert pages)"),
    ("--kv-cache-dtype", lambda a: a.kv_cache_dtype not in ("auto", "bf16", "bfloat16", "fp16", "float16"),
     "a quantized KV cache"),
    ("--enable-hierarchical-cache", lambda a: a.enable_hierarchical_cache, "SGLang's host KV tier (HiCache)"),
    ("--cpu-offload-gb", lambda a: a.cpu_offload_gb, "SGLang's own weight offloading (the pool offloads experts itself)"),
)


def _check_pool_plan(args: argparse.Namespace, config) -> None:
    """The pool checks that must fail before any weight loads."""
    from sglang_rimuru.plan import ModelFacts, PlanError, check_host_memory, plan_pool

    for flag, is_set, what in _UNSUPPORTED:
        if is_set(args):
            value = getattr(args, flag[2:].replace("-", "_"))
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            raise LaunchError(f"{shown}: --rimuru-mode {config.mode} does not support {what}")
    if args.page_size is None:
        args.page_size = 1
    try:
        facts = ModelFacts.from_model_path(args.model_path)
        plan_pool(
            facts,
            config,
            tp_size=args.tp_size,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            context_len=args.context_length,
        )
        if config.expert_ranking is not None:
            from sglang_rimuru.experts import load_ranking

            load_ranking(config.expert_ranking, facts.moe_shape())
        if args.device != "cpu":  # on CPU every weight is in host memory in any mode
            available = mem_available_bytes()
            if available is not None:
                check_host_memory(facts, available)
    except (PlanError, ValueError) as exc:
        raise LaunchError(str(exc)) from None


def _check_cpu_split(args: argparse.Namespace, config, device: str) -> None:
    """``--rimuru-cpu-experts``: what the split cannot serve, refused before any weight loads
    (the worker checks the same at build, where it also knows the host store is pinned)."""
    problems = config.cpu_split_problems(device, args.tp_size, getattr(args, "enable_deterministic_inference", False))
    if problems:
        raise LaunchError(f"--rimuru-cpu-experts {config.cpu_experts}: " + "; ".join(problems))


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to a new process (None if unknown)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def build_parser() -> argparse.ArgumentParser:
    """SGLang's flags and the project's, in one parser (imports SGLang)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_rimuru.config import RimuruConfig

    parser = _OneLineParser(
        prog=PROG,
        description="SGLang's HTTP / OpenAI-compatible server for MoE models, with "
        "sglang-rimuru's unified expert/KV page pool. Every SGLang flag works unchanged.",
    )
    ServerArgs.add_cli_args(parser)
    RimuruConfig.add_cli_args(parser)
    return parser


def prepare(argv: list[str]):
    """Parse and check the command line; install this process's seams.

    Returns ``(server_args, rimuru_config)``; raises :class:`LaunchError`.
    """
    peek = _peek(argv)
    device = _detect_device(peek.device)
    argv = list(argv)
    if peek.device is None:
        argv += ["--device", device]
    if peek.model_path is None and not any(a in ("-h", "--help") for a in argv):
        from sglang_rimuru.models import default_model_path

        argv += ["--model-path", str(default_model_path())]
    from sglang_rimuru.config import RimuruConfig

    ctx = ProcessContext(device=device, tp_size=peek.tp_size)
    if ctx.on_cpu:
        from rimuru_patches import cpu_platform

        argv += cpu_platform.default_cli_args(argv)
    # Publish before importing SGLang: spawned children inherit the environment.
    ctx.publish()
    from rimuru_patches import seams
    from rimuru_patches.bootstrap import bootstrap_process

    try:
        bootstrap_process(ctx)
    except seams.SeamTargetMissing as exc:
        raise LaunchError(str(exc)) from None

    parser = build_parser()
    args = parser.parse_args(argv)  # --help prints and exits here
    try:
        config = RimuruConfig.from_cli_args(args)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    ctx = ProcessContext(device=device, tp_size=args.tp_size, rimuru=config.to_dict())
    ctx.publish()
    try:  # the seams the spawned processes will install for this config
        seams.verify(ctx)
    except seams.SeamTargetMissing as exc:
        raise LaunchError(str(exc)) from None

    _check_model_path(args.model_path)
    _check_port(args.host, args.port)
    if config.enabled:
        _check_pool_plan(args, config)
    if config.cpu_experts:
        _check_cpu_split(args, config, device)

    if config.record_routing and not args.disable_cuda_graph and device != "cpu":
        # The recorder counts on the host after every pass; a replayed graph runs no Python.
        args.disable_cuda_graph = True
        print(f"{PROG}: --rimuru-record-routing records eager passes only (--disable-cuda-graph)",
              file=sys.stderr)

    from sglang.srt.server_args import ServerArgs

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    try:
        server_args = ServerArgs.from_cli_args(args)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        raise LaunchError(f"invalid server arguments: {exc}") from None
    return server_args, config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        server_args, config = prepare(argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    from rimuru_patches import start_errors

    error_file = start_errors.publish_error_file()  # before SGLang spawns its children

    def child_failed(line: str) -> None:
        # A scheduler found a budget that cannot work (start_errors.py): one line, no traceback.
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(start_errors.EXIT_CODE)

    start_errors.watch(error_file, child_failed)
    logger.info("sglang-rimuru: mode=%s device=%s tp=%d", config.mode, server_args.device, server_args.tp_size)
    try:
        run_server(server_args)
    except BaseException:
        line = start_errors.read(error_file)
        if line is None:
            raise
        child_failed(line)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
        try:
            os.unlink(error_file)
        except OSError:
            pass
    return 0
