"""The paged MoE GEMM and SGLang's fused_moe_kernel compiled for sm_90 on this host (no GPU), SASS compared.

Each kernel gets the specialization a launch on an H100/H200 gives it: the
launcher's own code (our ``_launch_gemm``, SGLang's ``invoke_fused_moe_kernel``)
runs on meta tensors with a recorder in place of the kernel, and the recorded
arguments go through Triton's binder (``create_function_from_signature``) and
``JITFunction._pack_args`` on a ``GPUTarget("cuda", 90, 64)`` backend, then
``triton.compile``. ptxas's ``-v`` log gives registers and spills; nvdisasm
(with the line info Triton emits) gives the SASS, split at the K loop's back
edge into setup / K-loop body / writeback, its global loads attributed to the
source statement that issued them (A tile, B tile, page table, expert id).

Compiled at the Qwen3-30B-A3B shape (E=128, top-8, H=2048, I=768, bf16):

* ours: the fused gate/up and the down GEMM with the shipped H200 tables
  (``configs/``), the unfused gate/up with SGLang's config; each with
  TILE_IN_PAGE as the launcher picks it ("tip": one scalar page lookup per
  tile) and forced False ("col": the per-column lookup);
* SGLang's fused_moe_kernel, gate/up and down, with its tuned H200 table and
  the arguments its unquantized bf16 path passes (no TMA, filter_expert False).

"per tile" = setup + K-loop body x cdiv(K, BLOCK_K) + writeback: static SASS
instructions per thread for one output tile (every instruction counted once,
taken or not), a proxy for issue work, not a timing.

    source /root/.cache/rimuru/venv/bin/activate      # or bench/device/setup_device.sh
    python3 bench/kernel/compile_sm90.py [--tokens 4096] \\
        [--out-dir DIR] [--json FILE] [--only NAME ...]

Writes NAME.ptx / NAME.sass per kernel and the JSON (default
OUT_DIR/compile_sm90.json); prints a markdown table. Needs the ptxas and
nvdisasm the triton wheel ships (triton/backends/nvidia/bin; TRITON_PTXAS_PATH
/ TRITON_NVDISASM_PATH override). ~25 s on CPU: SGLang's import ~12 s, ptxas
most of the rest.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import paged_rig as rig  # noqa: E402 (puts the checkout's kernels/ on the path if needed)
from rimuru_kernels import paged_moe  # noqa: E402
from rimuru_kernels.align import AlignedTokens  # noqa: E402
from rimuru_kernels.moe_config import load_configs, load_down_configs  # noqa: E402

SM90 = GPUTarget("cuda", 90, 64)
SHAPE_NAME = "Qwen3-30B-A3B"
DEVICE_NAME = "NVIDIA_H200"  # whose tuned tables (ours and SGLang's) are read
# SGLang's H200 entry at 4096 tokens, for when its JSON is not installed
SGLANG_FALLBACK = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=16,
                       num_warps=8, num_stages=4)


class ToolMissing(RuntimeError):
    pass


def nvidia_tools() -> dict[str, str]:
    """{"ptxas": path, "nvdisasm": path} as Triton resolves them, else ToolMissing."""
    tools = {}
    for name in ("ptxas", "nvdisasm"):
        try:
            tool = getattr(knobs.nvidia, name)
        except Exception:
            tool = None
        if tool is None or not os.access(tool.path, os.X_OK):
            raise ToolMissing(
                f"{name} not found: Triton looks at $TRITON_{name.upper()}_PATH, then "
                f"{os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', name)} "
                "(shipped in the triton wheel); install that wheel or point the variable at a CUDA toolkit's")
        tools[name] = tool.path
    return tools


# ---------------------------------------------------------------------------
# What a launch passes: the launchers run on meta tensors, the kernel recorded
# ---------------------------------------------------------------------------


def meta(*shape, dtype=torch.bfloat16):
    """Shape, strides and dtype without memory. data_ptr() is 0: 16-byte aligned, as
    every CUDA allocation is, so pointer specialization matches a real launch."""
    return torch.empty(shape, dtype=dtype, device="meta")


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextlib.contextmanager
def recording(module, name):
    real = getattr(module, name)
    rec = _Recorder()
    setattr(module, name, rec)
    try:
        yield rec
    finally:
        setattr(module, name, real)


@dataclass
class Launch:
    name: str  # file stem and JSON key
    label: str  # the table's first column
    fn: JITFunction
    args: tuple
    kwargs: dict
    k_iters: int  # trips of the K loop: cdiv(K, BLOCK_SIZE_K)


def _cfg_str(kw: dict) -> str:
    return (f"{kw['BLOCK_SIZE_M']}x{kw['BLOCK_SIZE_N']}x{kw['BLOCK_SIZE_K']} g{kw['GROUP_SIZE_M']} "
            f"w{kw.get('num_warps', '-')} s{kw.get('num_stages', '-')}")


def our_configs(T: int) -> dict[str, dict]:
    """The shipped tables (what get_paged_moe_config reads on an H200), nearest entry to T."""
    s = rig.SHAPES[SHAPE_NAME]
    up = rig.nearest(load_configs(s["E"], s["I"], DEVICE_NAME), T)
    down_table = load_down_configs(s["E"], s["I"], DEVICE_NAME)
    return {"fused_gateup": up, "down": rig.nearest(down_table, T) if down_table else up}


def sglang_config(T: int) -> tuple[dict, str]:
    """(config, where from): SGLang's tuned H200 JSON under triton_<running version>/ (as its
    get_moe_configs looks first) or triton_3_6_0/, else the literal. Both of its GEMMs take
    it: a ``_down`` table would select its TMA down path, not modelled here (none for this shape)."""
    import importlib.util

    s = rig.SHAPES[SHAPE_NAME]
    spec = importlib.util.find_spec("sglang")
    if spec is not None:
        root = os.path.join(os.path.dirname(spec.origin), "srt/layers/moe/moe_runner/triton_utils/configs")
        for v in dict.fromkeys(["triton_" + "_".join(triton.__version__.split(".")[:3]), "triton_3_6_0"]):
            path = os.path.join(root, v, f"E={s['E']},N={s['I']},device_name={DEVICE_NAME}.json")
            if os.path.isfile(path):
                with open(path) as f:
                    return rig.nearest({int(t): c for t, c in json.load(f).items()}, T), os.path.relpath(path, root)
    return dict(SGLANG_FALLBACK), "literal (no SGLang JSON found)"


def our_launches(T: int, configs: dict[str, dict]) -> list[Launch]:
    s = rig.SHAPES[SHAPE_NAME]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    n = T * k
    page_elems = I * H
    pool = meta(3 * E * page_elems)
    table = meta(E, 3, dtype=torch.int32)
    topk_w = meta(n, dtype=torch.float32)

    def aligned(bm):
        if T == 1:  # paged_fused_moe's slot blocks: the flat topk_ids, no alignment
            return meta(n, dtype=torch.int32)
        # moe_align_block_size_triton's buffers: EM is their length at launch
        padded = n + min(n, E) * (bm - 1)
        return AlignedTokens(meta(padded, dtype=torch.int32), meta(triton.cdiv(padded, bm), dtype=torch.int32),
                             meta(1, dtype=torch.int32))

    # paged_fused_moe's GEMM calls: (name, label, config, a, c, the rest of _launch_gemm's arguments)
    fused = paged_moe.fit_fused_config(configs["fused_gateup"], 2)
    calls = [("fused_gateup", "fused gate/up", fused, meta(T, H), meta(n, I),
              dict(N=I, K=H, rows_per_page=I, slot_base=0, top_k=k, mul_routed_weight=False, fuse_silu=True)),
             ("down", "down", configs["down"], meta(n, I), meta(n, H),
              dict(N=H, K=I, rows_per_page=H, slot_base=2, top_k=1, mul_routed_weight=True)),
             ("unfused_gateup", "unfused gate/up", configs["unfused_gateup"], meta(T, H), meta(n, 2 * I),
              dict(N=2 * I, K=H, rows_per_page=I, slot_base=0, top_k=k, mul_routed_weight=False))]
    out = []
    for name, label, cfg, a, c, kw in calls:
        with recording(paged_moe, "_paged_moe_gemm_kernel") as rec:
            paged_moe._launch_gemm(a, c, pool, table, topk_w, aligned(cfg["BLOCK_SIZE_M"]), page_elems=page_elems,
                                   config=cfg, options=paged_moe._checked_config(name, cfg), upcast=False, **kw)
        (args, kwargs), = rec.calls
        iters = triton.cdiv(kw["K"], cfg["BLOCK_SIZE_K"])
        # The launcher's pick, then the per-column path forced (if the pick was not already it)
        for tip in dict.fromkeys([kwargs["TILE_IN_PAGE"], False]):
            tag = "tip" if tip else "col"
            out.append(Launch(f"ours_{name}_{tag}", f"ours {label}, {tag}", paged_moe._paged_moe_gemm_kernel,
                              args, {**kwargs, "TILE_IN_PAGE": tip}, iters))
    return out


def sglang_launches(T: int, cfg: dict) -> list[Launch]:
    """fused_experts_impl's two invoke_fused_moe_kernel calls, unquantized bf16 (no TMA)."""
    import warnings

    with warnings.catch_warnings():  # its import chain warns that this host has no GPU
        warnings.simplefilter("ignore", UserWarning)
        import sglang.kernels.ops.moe.fused_moe_triton_kernels as fk

    s = rig.SHAPES[SHAPE_NAME]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    n = T * k
    bm = cfg["BLOCK_SIZE_M"]
    # SGLang's moe_align_block_size buffers
    padded = n * bm if n < E + 1 else n + (E + 1) * (bm - 1)
    sorted_ids, expert_ids = meta(padded, dtype=torch.int32), meta(triton.cdiv(padded, bm), dtype=torch.int32)
    num_post = meta(1, dtype=torch.int32)
    topk_w, topk_ids = meta(T, k, dtype=torch.float32), meta(T, k, dtype=torch.int32)
    quant = dict(compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                 use_int4_w4a16=False, per_channel_quant=False, block_shape=None)
    with recording(fk, "fused_moe_kernel") as rec:
        # gate/up: intermediate_cache1 [n, 2I]; no routing weight (apply_router_weight_on_input False)
        fk.invoke_fused_moe_kernel(meta(T, H), meta(E, 2 * I, H), None, meta(n, 2 * I), None, None, None,
                                   topk_w, topk_ids, sorted_ids, expert_ids, num_post, False, k, cfg,
                                   c_sorted=False, filter_expert=False, **quant)
        # down: intermediate_cache3 [T, k, H], routing weight applied here
        fk.invoke_fused_moe_kernel(meta(n, I), meta(E, H, I), None, meta(T, k, H), None, None, None,
                                   topk_w, topk_ids, sorted_ids, expert_ids, num_post, True, 1, cfg,
                                   a_use_tma=False, b_use_tma=False, filter_expert=False,
                                   fuse_sum_all_reduce=False, router_topk=k, **quant)
    (up_args, up_kw), (down_args, down_kw) = rec.calls
    return [Launch("sglang_gateup", "SGLang gate/up", fk.fused_moe_kernel, up_args, up_kw,
                   triton.cdiv(H, cfg["BLOCK_SIZE_K"])),
            Launch("sglang_down", "SGLang down", fk.fused_moe_kernel, down_args, down_kw,
                   triton.cdiv(I, cfg["BLOCK_SIZE_K"]))]


# ---------------------------------------------------------------------------
# Compile as JITFunction.run would, without a device
# ---------------------------------------------------------------------------


def compile_sm90(fn: JITFunction, args: tuple, kwargs: dict):
    """(CompiledKernel, ptxas -v log) for ``fn[grid](*args, **kwargs)`` on sm_90.

    JITFunction.run's steps after it asks the driver for the target: the same
    binder (pointer alignment, int divisibility by 16, == 1) and _pack_args."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True  # a cache hit would skip ptxas, and its log with it
        knobs.compilation.disable_line_info = False  # the SASS's line info attributes loads to statements
        knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v's log
        kernel = triton.compile(src, target=SM90, options=options.__dict__)
    return kernel, log.getvalue()


# ---------------------------------------------------------------------------
# SASS analysis
# ---------------------------------------------------------------------------

_LOC = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTR = re.compile(r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<text>[^;]*);")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_PRED = re.compile(r"^@!?U?P\w+\s+")


@dataclass
class Instr:
    addr: int
    op: str  # opcode with modifiers, predicate stripped: LDGSTS.E.BYPASS.128
    src: tuple[str, int] | None  # (file, line) from the line info
    target: str | int | None  # a branch's label while parsing, then its address


def parse_sass(text: str) -> list[Instr]:
    """nvdisasm -c -g output as instructions, branch targets resolved from labels to addresses."""
    instrs, labels, loc = [], {}, None
    for line in text.splitlines():
        if m := _LOC.search(line):
            loc = (m["file"], int(m["line"]))
        elif m := _LABEL.match(line):
            labels[m[1]] = len(instrs)  # the next instruction's index
        elif m := _INSTR.search(line):
            body = m["text"].strip()
            branch = _BRANCH.search(body)
            instrs.append(Instr(int(m["addr"], 16), _PRED.sub("", body).split()[0], loc, branch and branch[1]))
    for ins in instrs:
        if ins.target is not None:  # a label past the last instruction: no address (never a loop)
            at = labels.get(ins.target, len(instrs))
            ins.target = instrs[at].addr if at < len(instrs) else None
    return instrs


def _is_mma(op: str) -> bool:
    return op.startswith(("HGMMA", "HMMA"))  # wgmma (sm_90), mma.sync (small tiles)


def k_loop(instrs: list[Instr]) -> tuple[int, int]:
    """(first, last address) of the K loop: the back edge whose body holds the most
    MMA instructions (the widest, for a kernel without any)."""
    loops = [(i.target, i.addr) for i in instrs if i.op == "BRA" and i.target is not None and i.target <= i.addr]
    if not loops:
        raise ValueError("no backward branch: no K loop found")
    return max(loops, key=lambda lp: (sum(lp[0] <= i.addr <= lp[1] and _is_mma(i.op) for i in instrs),
                                      lp[1] - lp[0]))


@functools.lru_cache(maxsize=None)
def _statements(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, text) of each simple statement of a source file."""
    try:
        with open(path) as f:
            src = f.read()
    except OSError:
        return []
    return [(n.lineno, n.end_lineno, ast.get_source_segment(src, n)) for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.stmt) and not hasattr(n, "body")]


def statement_at(src: tuple[str, int] | None) -> str:
    if src is None:
        return ""
    spans = [s for s in _statements(src[0]) if s[0] <= src[1] <= s[1]]
    return min(spans, key=lambda s: s[1] - s[0])[2] if spans else ""


# Which tensor a global load reads, from the statement that loads it
LOAD_KINDS = {
    "a": re.compile(r"tl\.load\(\s*a_ptrs\b"),
    "b": re.compile(r"tl\.load\(\s*b(_up)?_ptrs\b"),
    "page_table": re.compile(r"tl\.load\(\s*(page_table_ptr|pt_row)\b"),
    "expert_id": re.compile(r"tl\.load\(\s*expert_ids_ptr\b"),
}


def _is_global_load(op: str) -> bool:
    return op.startswith("LDG") and not op.startswith("LDGDEPBAR")


def _loads(instrs: list[Instr], kind: str) -> str:
    c = collections.Counter(i.op for i in instrs
                            if _is_global_load(i.op) and LOAD_KINDS[kind].search(statement_at(i.src)))
    return ", ".join(f"{n}x {op}" for op, n in sorted(c.items())) or "-"


def analyze(launch: Launch, kernel, ptxas_log: str, sass: str) -> dict:
    instrs = parse_sass(sass)
    first, last = k_loop(instrs)
    end = max(i.addr for i in instrs if i.op == "EXIT")  # past it: the trailing self-branch and NOPs
    setup = [i for i in instrs if i.addr < first]
    body = [i for i in instrs if first <= i.addr <= last]
    writeback = [i for i in instrs if last < i.addr <= end]

    def num(pattern):
        m = re.search(pattern, ptxas_log)
        return int(m[1]) if m else None

    ptx = kernel.asm["ptx"]
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.\w+\.(\w+)\.\w+", ptx)))
    mma = ", ".join(f"wgmma {shape} {ty}" for shape, ty in wgmma)
    if not mma:
        mma = ", ".join("mma.sync " + shape for shape in
                        sorted(set(re.findall(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))) or "none"
    kw = launch.kwargs
    return dict(
        name=launch.name, label=launch.label, kernel=launch.fn.fn.__name__,
        tile_in_page=kw.get("TILE_IN_PAGE"), config=_cfg_str(kw),
        registers=num(r"Used (\d+) registers"),
        spill_store_bytes=num(r"(\d+) bytes spill stores"), spill_load_bytes=num(r"(\d+) bytes spill loads"),
        stack_frame_bytes=num(r"(\d+) bytes stack frame"),
        shared_bytes=kernel.metadata.shared,
        mma=mma,
        mma_per_iter=sum(_is_mma(i.op) for i in body),  # HGMMA / HMMA instructions
        a_loads_per_iter=_loads(body, "a"), b_loads_per_iter=_loads(body, "b"),
        page_table_loads=_loads(instrs, "page_table"), expert_id_loads=_loads(instrs, "expert_id"),
        setup=len(setup), k_loop=len(body), writeback=len(writeback), k_iters=launch.k_iters,
        per_tile=len(setup) + launch.k_iters * len(body) + len(writeback),
    )


def compile_and_analyze(launch: Launch, nvdisasm: str, out_dir: str) -> dict:
    kernel, log = compile_sm90(launch.fn, launch.args, launch.kwargs)
    cubin = os.path.join(out_dir, launch.name + ".cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    # -c: code only; -g: the line info as comments
    sass = subprocess.run([nvdisasm, "-c", "-g", cubin], check=True, capture_output=True, text=True).stdout
    os.remove(cubin)
    for ext, text in (("ptx", kernel.asm["ptx"]), ("sass", sass)):
        with open(os.path.join(out_dir, f"{launch.name}.{ext}"), "w") as f:
            f.write(text)
    return analyze(launch, kernel, log, sass)


# ---------------------------------------------------------------------------


COLUMNS = [("kernel", "label"), ("config", "config"), ("regs", "registers"), ("spill st/ld B", None),
           ("smem B", "shared_bytes"), ("MMA", "mma"), ("MMA/iter", "mma_per_iter"),
           ("A loads/iter", "a_loads_per_iter"), ("B loads/iter", "b_loads_per_iter"),
           ("page-table loads", "page_table_loads"), ("expert-id loads", "expert_id_loads"),
           ("setup", "setup"), ("K loop", "k_loop"), ("writeback", "writeback"), ("iters", "k_iters"),
           ("per tile", "per_tile")]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"{r['spill_store_bytes']}/{r['spill_load_bytes']}" if key is None else str(r[key])
                 for _, key in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="T: picks the configs and sizes the buffers")
    ap.add_argument("--out-dir", default=None, help=".ptx/.sass per kernel and the JSON (default: a temp dir)")
    ap.add_argument("--json", default=None, help="JSON output (default: OUT_DIR/compile_sm90.json)")
    ap.add_argument("--only", nargs="*", default=None, help="kernels whose name contains one of these")
    args = ap.parse_args(argv)

    t0 = time.time()
    if paged_moe.INTERPRETED:
        print("compile_sm90: TRITON_INTERPRET=1 makes the kernels interpreted functions; unset it", file=sys.stderr)
        return 2
    try:
        tools = nvidia_tools()
    except ToolMissing as exc:
        print(f"compile_sm90: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="compile_sm90_")
    os.makedirs(out_dir, exist_ok=True)
    json_path = args.json or os.path.join(out_dir, "compile_sm90.json")

    def wanted(name):
        return not args.only or any(o in name for o in args.only)

    configs = our_configs(args.tokens)
    sgl_cfg, sgl_src = sglang_config(args.tokens)
    configs["unfused_gateup"] = sgl_cfg
    launches = [lc for lc in our_launches(args.tokens, configs) if wanted(lc.name)]
    sglang_error = None
    if wanted("sglang_gateup") or wanted("sglang_down"):
        try:
            launches += [lc for lc in sglang_launches(args.tokens, sgl_cfg) if wanted(lc.name)]
        except Exception as exc:  # ImportError and whatever SGLang's import chain raises on this host
            sglang_error = f"{type(exc).__name__}: {exc}"
            print(f"compile_sm90: SGLang's fused_moe_kernel not importable ({sglang_error}); "
                  "its rows are left out", file=sys.stderr)

    rows = []
    for launch in launches:
        t = time.time()
        rows.append(compile_and_analyze(launch, tools["nvdisasm"], out_dir))
        print(f"compiled {launch.name} ({_cfg_str(launch.kwargs)}) in {time.time() - t:.1f} s", file=sys.stderr)

    s = rig.SHAPES[SHAPE_NAME]
    result = dict(target="sm_90", shape=dict(name=SHAPE_NAME, **s, dtype="bfloat16"), tokens=args.tokens,
                  triton=triton.__version__, tools=tools,
                  configs=dict(ours=configs, sglang=sgl_cfg, sglang_source=sgl_src), sglang_error=sglang_error,
                  out_dir=out_dir, elapsed_s=round(time.time() - t0, 1), kernels=rows)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{SHAPE_NAME} (E={s['E']}, top-{s['k']}, H={s['H']}, I={s['I']}, bf16), T={args.tokens}, sm_90, "
          f"triton {triton.__version__}; SGLang config: {sgl_src}\n")
    print(markdown(rows))
    print(f"\nper tile = setup + K loop x iters + writeback (static SASS instructions per thread). "
          f"Files in {out_dir}; JSON {json_path}; {result['elapsed_s']} s")
    return 1 if sglang_error else 0


if __name__ == "__main__":
    sys.exit(main())
