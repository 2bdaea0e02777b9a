"""The seam registry: targets resolve in the pinned SGLang; a missing one fails loudly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rimuru_patches.context import ProcessContext
from rimuru_patches.seams import Seam, SeamTargetMissing
from tests.conftest import warm_run


def _seam(target: str) -> Seam:
    return Seam(name="test.seam", target=target, why="test", build=lambda o, c: o, applies=lambda c: True)


def test_missing_module_names_the_seam():
    with pytest.raises(SeamTargetMissing, match=r"seam 'test.seam': cannot import no_such_module_xyz"):
        _seam("no_such_module_xyz:thing").resolve()


def test_missing_attribute_names_the_seam_and_target():
    with pytest.raises(SeamTargetMissing, match=r"seam 'test.seam': target json:JSONDecoder.no_such_method"):
        _seam("json:JSONDecoder.no_such_method").resolve()


def test_resolve_returns_owner_and_original():
    import json

    owner, attr, original = _seam("json:JSONDecoder.decode").resolve()
    assert owner is json.JSONDecoder and attr == "decode" and original is json.JSONDecoder.decode


def test_context_round_trips_through_the_environment(monkeypatch):
    ctx = ProcessContext(device="cpu", tp_size=2, rimuru={"mode": "off"})
    # setenv first so monkeypatch restores the variable after publish(): a leaked TP=2 context
    # would reach every server a later test starts (its launcher bootstraps from the environment)
    monkeypatch.setenv("SGLANG_RIMURU_CONTEXT", "")
    monkeypatch.delenv("SGLANG_RIMURU_CONTEXT")
    assert ProcessContext.from_env() is None
    ctx.publish()
    assert ProcessContext.from_env() == ctx


def test_every_seam_resolves_and_installs_in_the_pinned_sglang():
    # In a child process: installing imports SGLang with the CPU stand-in.
    code = textwrap.dedent(
        """
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        from rimuru_patches import seams
        bootstrap_process(ProcessContext(device="cpu", tp_size=2))
        import sglang.srt.models.qwen2_moe as q2
        assert q2.fused_gate_sigmoid_mul_add is not seams.original("cpu.qwen2_moe_shared_expert_gate")
        print(sorted(seams.installed()))
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        sorted(["cpu.no_pynccl", "cpu.qwen2_moe_shared_expert_gate", "cpu.xgrammar_grammar", "cpu.xgrammar_backend",
                "http.request_validation"])
    )


def test_cuda_context_installs_no_cpu_seams():
    code = textwrap.dedent(
        """
        from rimuru_patches import all_seams, seams
        from rimuru_patches.context import ProcessContext
        all_seams.load()
        print(sorted(s.name for s in seams.REGISTRY if s.applies(ProcessContext(device="cuda"))))
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['http.request_validation']"


def test_sampling_param_type_check():
    from rimuru_patches.request_validation import check_sampling_params

    check_sampling_params({"max_new_tokens": 8, "temperature": 0, "top_p": 0.9})
    check_sampling_params(None)
    with pytest.raises(ValueError, match=r"sampling_params.max_new_tokens must be an integer, got 'many'"):
        check_sampling_params({"max_new_tokens": "many"})
    with pytest.raises(ValueError, match=r"sampling_params.temperature must be a finite number"):
        check_sampling_params({"temperature": float("nan")})
    with pytest.raises(ValueError, match=r"sampling_params.n must be an integer, got True"):
        check_sampling_params({"n": True})


def test_grammar_check_refuses_what_the_server_cannot_serve():
    from rimuru_patches.request_validation import check_grammar

    for ok in ({"regex": "[0-9]{3}"}, {"ebnf": 'root ::= "a" | "b"'}, {"json_schema": '{"type": "object"}'},
               {"json_schema": "$$ANY$$"}, {"regex": "", "json_schema": None}, {"max_new_tokens": 4}, None):
        check_grammar(ok, "xgrammar")
    refused = [  # params, the start of the message (then xgrammar's own reason, pinned 0.2.1)
        ({"regex": "["}, "sampling_params.regex is not a valid regex: Regex parsing error at position 2: Unclosed '['"),
        ({"json_schema": '{"type": "nosuch"}'}, 'sampling_params.json_schema is not a valid JSON schema: '
                                                'Unsupported type "nosuch"'),
        ({"ebnf": 'rule ::= "a"'}, "sampling_params.ebnf is not a valid EBNF grammar: "),
        ({"json_schema": {"type": "object"}}, "sampling_params.json_schema must be a string"),
        ({"regex": ["a"]}, "sampling_params.regex must be a string, got list"),
        ({"regex": "a", "ebnf": "b"}, "sampling_params: set at most one of json_schema, regex, ebnf, structural_tag; "
                                      "got regex, ebnf"),
    ]
    for params, message in refused:
        with pytest.raises(ValueError) as err:
            check_grammar(params, "xgrammar")
        assert str(err.value).startswith(message), (params, str(err.value))
    with pytest.raises(ValueError, match=r"sampling_params.regex: constrained decoding is off on this server "
                                         r"\(--grammar-backend none\)"):
        check_grammar({"regex": "[0-9]"}, "none")
    # other backends: the type checks only; the scheduler's compile refuses the rest with its own 400
    check_grammar({"regex": "["}, "outlines")
    with pytest.raises(ValueError, match="must be a string"):
        check_grammar({"ebnf": 3}, "llguidance")


def test_cpu_xgrammar_bitmask_is_unpinned_and_applied_on_cpu():
    # SGLang's own classes after the CPU seams: a regex grammar masks CPU logits to its digits
    code = textwrap.dedent(
        """
        import torch, xgrammar as xgr
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        bootstrap_process(ProcessContext(device="cpu"))
        from sglang.srt.constrained import xgrammar_backend as xb
        from sglang.srt.constrained.base_grammar_backend import GrammarMask

        vocab = [chr(c) for c in range(ord("0"), ord("z") + 1)]  # 75 one-character tokens
        ctx = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab)).compile_regex("[0-9]+")
        grammar = xb.XGrammarGrammar(xgr.GrammarMatcher(ctx), len(vocab), ctx, None)
        mask = grammar.allocate_vocab_mask(vocab_size=len(vocab), batch_size=2, device="cpu")
        assert mask.shape == (2, 3) and not mask.is_pinned() and bool((mask == -1).all())
        grammar.fill_vocab_mask(mask, 0)  # row 1 stays unconstrained
        logits = torch.zeros(2, len(vocab))
        GrammarMask(grammar, grammar.move_vocab_mask(mask, "cpu")).apply(logits)
        allowed = [vocab[i] for i in torch.isfinite(logits[0]).nonzero().flatten().tolist()]
        assert allowed == list("0123456789"), allowed
        assert bool(torch.isfinite(logits[1]).all())
        # the backend's static pair (strict-thinking token filter) goes the same way
        backend_mask = xb.XGrammarGrammarBackend.allocate_vocab_mask(len(vocab), 1, "cpu")
        backend_mask[0].zero_()
        xb.XGrammarGrammarBackend.apply_vocab_mask(logits[1:], backend_mask)
        assert bool(torch.isinf(logits[1]).all())
        print("ok")
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_pool_seams_resolve_when_the_pool_mode_is_on():
    code = textwrap.dedent(
        """
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        from rimuru_patches import seams
        ctx = ProcessContext(device="cpu", rimuru={"mode": "static"})
        bootstrap_process(ctx)
        print(sorted(s.name for s in seams.verify(ctx)))
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        sorted(
            [
                "cpu.no_pynccl",
                "cpu.qwen2_moe_shared_expert_gate",
                "cpu.xgrammar_grammar",
                "cpu.xgrammar_backend",
                "http.request_validation",
                "pool.build",
                "pool.kv_budget",
                "pool.kv_capacity",
                "pool.kv_buffers",
                "pool.kv_allocator",
                "pool.kv_affinity_extend",
                "pool.kv_affinity_decode",
                "experts.forward_pass",
                "experts.moe_core",
                "experts.prefill_graphs",
                "experts.host_load",
                "experts.host_weights",
                "experts.dummy_weights",
                "scheduler.mix_decodes",
            ]
        )
    )


# ---------------------------------------------------------------------------------------
# experts.kernel_hooks: SGLang's fused-MoE functions for the paged kernel (used on CUDA)


def test_kernel_hook_targets_exist_in_the_pinned_sglang_source():
    # silu_and_mul and moe_sum_reduce are bound only in a CUDA process, so on CPU the
    # module's source is checked: every target is bound at its top level (any branch).
    import ast
    import importlib.util
    from pathlib import Path

    from rimuru_patches.unified_pool.sglang_moe import FUSED_MOE, TARGETS

    # the file, found without importing SGLang's packages
    root = Path(importlib.util.find_spec("sglang").origin).parent
    tree = ast.parse((root.parent / (FUSED_MOE.replace(".", "/") + ".py")).read_text())
    bound = set()

    def bind(statements):  # module level, through if/try branches, not into functions
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                bind(node.body + node.orelse + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    bind(handler.body)

    bind(tree.body)
    assert set(TARGETS) <= bound, sorted(set(TARGETS) - bound)


def test_sglangs_own_lookup_says_where_it_has_a_tuned_table():
    """sglang_has_tuned_table asks SGLang's get_moe_configs as try_get_optimal_moe_config
    does: SGLang 0.5.17 ships an H100 table for Qwen3-30B-A3B (E=128, N=768; an older Triton's
    folder) and none for Qwen1.5-MoE-A2.7B (E=60, N=1408) on either GPU. In a child (the
    lookup reads SGLang's published config; the device name is set as a GPU would give it)."""
    code = textwrap.dedent(
        """
        import torch
        from rimuru_patches.bootstrap import bootstrap_process
        from rimuru_patches.context import ProcessContext
        bootstrap_process(ProcessContext(device="cpu", tp_size=1))
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs
        from sglang_rimuru.models import ensure_model
        from rimuru_patches.unified_pool import sglang_moe
        import importlib
        publish(ServerArgs(model_path=str(ensure_model("tiny-qwen3-moe")), device="cpu"), role="test")
        module = importlib.import_module(sglang_moe.CONFIG_MODULE)
        for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
            module.get_device_name = lambda gpu=gpu: gpu
            print(gpu, [sglang_moe.sglang_has_tuned_table(e, n, torch.bfloat16) for e, n in ((128, 768), (60, 1408))])
        """
    )
    out = warm_run(["-c", code])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-2:] == ["NVIDIA H100 80GB HBM3 [True, False]", "NVIDIA H200 [True, False]"]


def test_kernel_hook_target_missing_names_itself(monkeypatch):
    from rimuru_patches.unified_pool import sglang_moe

    monkeypatch.setattr(sglang_moe, "FUSED_MOE", "json")
    with pytest.raises(SeamTargetMissing, match=r"seam 'experts.kernel_hooks': json has no \['try_get_optimal"):
        sglang_moe.resolve_targets()


def test_kernel_hooks_follow_fused_experts_impl_branches(monkeypatch):
    import torch

    from rimuru_patches.unified_pool import sglang_moe

    calls = []
    table = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    down = dict(table, BLOCK_SIZE_K=128, USE_TMA=True)

    def get_config(w1_shape, w2_shape, top_k, dtype, M, return_down_config=False):
        calls.append(("config", w1_shape, w2_shape, top_k, dtype, M, return_down_config))
        return table, (dict(down), 16)

    fakes = {
        "try_get_optimal_moe_config": get_config,
        "get_config_dtype_str": lambda dtype: None,
        "silu_and_mul": object(),
        "_use_moe_sum_reduce_torch_compile": lambda n: n <= 32,
        "moe_sum_reduce_torch_compile": lambda x, out, s: calls.append(("compiled", x.shape[0], s)),
        "moe_sum_reduce": lambda x, out, s: calls.append(("sgl_kernel", x.shape[0], s)),
    }
    monkeypatch.setattr(sglang_moe, "resolve_targets", lambda: fakes)

    def hooks(scale=None):
        return sglang_moe.sglang_kernel_hooks(num_experts=8, hidden=64, inter=32, top_k=2,
                                              dtype=torch.bfloat16, routed_scaling_factor=scale)

    h = hooks()
    assert h.act_and_mul is fakes["silu_and_mul"]
    up, dn = h.configs(300)
    assert calls.pop() == ("config", (8, 64, 64), (8, 64, 32), 2, None, 300, True)
    assert up == table and up is not table and dn == dict(table, BLOCK_SIZE_K=128)  # USE_TMA popped
    assert "USE_TMA" not in table

    x = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).view(2, 3, 4)
    out = torch.empty(2, 4, dtype=torch.bfloat16)
    h.combine(x[:, :1], out)
    assert torch.equal(out, x[:, 0]) and not calls  # k=1: SGLang's down GEMM wrote the output
    h.combine(x[:, :2], out)
    assert torch.equal(out, x[:, 0] + x[:, 1]) and not calls  # k=2: torch.add
    h.combine(x, out)
    assert calls.pop() == ("compiled", 2, 1.0)  # k=3, T<=32
    h.combine(torch.zeros(33, 3, 4, dtype=torch.bfloat16), torch.empty(33, 4, dtype=torch.bfloat16))
    assert calls.pop() == ("sgl_kernel", 33, 1.0)
    hooks(2.5).combine(x[:, :2], out)  # a scaling factor: never the k<=2 shortcuts
    assert calls.pop() == ("compiled", 2, 2.5)
    with pytest.raises(ValueError, match="bf16/fp16"):
        sglang_moe.sglang_kernel_hooks(num_experts=8, hidden=64, inter=32, top_k=2, dtype=torch.float32)


def _moe_layers(*scales):
    from types import SimpleNamespace

    return {i: (SimpleNamespace(moe_runner_config=SimpleNamespace(routed_scaling_factor=s)), None)
            for i, s in enumerate(scales)}


def test_moe_kernel_fast_leaves_the_kernel_its_own_defaults(monkeypatch):
    import torch

    from rimuru_kernels import moe_config
    from rimuru_patches.unified_pool import sglang_moe
    from rimuru_patches.unified_pool.runtime import RimuruRuntime
    from sglang_rimuru.config import RimuruConfig
    from sglang_rimuru.experts import KernelHooks, MoEShape

    monkeypatch.delenv("RIMURU_KERNELS_CONFIG_DIR", raising=False)
    monkeypatch.setattr(moe_config, "device_name", lambda device: "NVIDIA_H200")
    monkeypatch.setattr(moe_config, "device_shared_bytes", lambda device: H200_SHARED_BYTES)
    monkeypatch.setattr(sglang_moe, "resolve_targets", lambda: pytest.fail("fast must not use SGLang's functions"))
    fast = RimuruConfig(mode="static", moe_kernel="fast")
    q15 = MoEShape(num_experts=60, hidden=2048, inter=1408, top_k=4, layer_ids=(0, 1), dtype=torch.bfloat16)
    hooks, words = RimuruRuntime.kernel_hooks(fast, _moe_layers(None, None), q15, None, torch.device("cuda"))
    assert hooks == KernelHooks()
    assert words == ("fast (configs E=60,N=1408,device_name=NVIDIA_H200.json + "
                     "E=60,N=1408,device_name=NVIDIA_H200_down.json; SiLU*up fused, Triton top-k sum)")
    tp2 = MoEShape(num_experts=60, hidden=2048, inter=704, top_k=4, layer_ids=(0, 1), dtype=torch.bfloat16)
    _, words = RimuruRuntime.kernel_hooks(fast, _moe_layers(1.0), tp2, None, torch.device("cuda"))
    assert words.startswith("fast (configs default.json;")  # no table for this shape: the default one
    with pytest.raises(RuntimeError, match=r"--rimuru-moe-kernel fast: .* routed_scaling_factor 2.5, .* use "
                                           r"--rimuru-moe-kernel exact"):
        RimuruRuntime.kernel_hooks(fast, _moe_layers(2.5, 2.5), q15, None, torch.device("cuda"))


#: a block's opt-in shared memory on the H200 and H100 (Triton's max_shared_mem), and on Ada
H200_SHARED_BYTES, ADA_SHARED_BYTES = 232_448, 101_376


def test_moe_kernel_auto_in_elastic_mode(monkeypatch):
    """auto: elastic runs the fast kernel with its tuned table (Qwen1.5-MoE on the H200); for
    a shape without one, exact where SGLang has a tuned table, else the fast kernel on its
    default table where that fits the GPU's shared memory (exact where it does not: an Ada
    card's 99 KiB); exact under SGLang's deterministic inference."""
    from types import SimpleNamespace

    import torch

    from rimuru_kernels import moe_config
    from rimuru_patches.unified_pool import sglang_moe
    from rimuru_patches.unified_pool.runtime import RimuruRuntime
    from sglang_rimuru.config import RimuruConfig
    from sglang_rimuru.experts import KernelHooks, MoEShape

    monkeypatch.delenv("RIMURU_KERNELS_CONFIG_DIR", raising=False)
    monkeypatch.setattr(moe_config, "device_name", lambda device: "NVIDIA_H200")
    shared, sglang_tuned = [H200_SHARED_BYTES], [False]
    monkeypatch.setattr(moe_config, "device_shared_bytes", lambda device: shared[0])
    monkeypatch.setattr(sglang_moe, "sglang_has_tuned_table", lambda e, n, dtype: sglang_tuned[0])
    fakes = {"try_get_optimal_moe_config": None, "get_config_dtype_str": lambda dtype: None, "silu_and_mul": object(),
             "_use_moe_sum_reduce_torch_compile": None, "moe_sum_reduce_torch_compile": None, "moe_sum_reduce": None}
    monkeypatch.setattr(sglang_moe, "resolve_targets", lambda: fakes)
    elastic = RimuruConfig(mode="elastic")
    q15 = MoEShape(num_experts=60, hidden=2048, inter=1408, top_k=4, layer_ids=(0, 1), dtype=torch.bfloat16)
    args = SimpleNamespace(enable_fused_moe_sum_all_reduce=False, enable_deterministic_inference=False)
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None, None), q15, args, torch.device("cuda"))
    assert hooks == KernelHooks()
    tables = "E=60,N=1408,device_name=NVIDIA_H200.json + E=60,N=1408,device_name=NVIDIA_H200_down.json"
    assert words == (f"auto -> elastic mode with a tuned table ({tables}): fast (configs {tables}; "
                     "SiLU*up fused, Triton top-k sum)")
    tp2 = MoEShape(num_experts=60, hidden=2048, inter=704, top_k=4, layer_ids=(0, 1), dtype=torch.bfloat16)
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None), tp2, args, torch.device("cuda"))
    assert hooks == KernelHooks() and words.startswith(
        "auto -> no tuned table for this shape on this GPU, here or in SGLang: the kernel's default table (")
    assert words.endswith(": fast (configs default.json; SiLU*up fused, Triton top-k sum)")
    sglang_tuned[0] = True  # SGLang's own table for the shape (Qwen3-30B-A3B on an H100): its tuned tiles
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None), tp2, args, torch.device("cuda"))
    assert hooks != KernelHooks() and words.startswith(
        "auto -> no tuned table of the fast kernel for this shape on this GPU; SGLang has one: exact (")
    sglang_tuned[0] = False
    shared[0] = ADA_SHARED_BYTES  # default.json's BM 16 x BN 128 x BK 128 tiles, two stages, fused: 136 KiB
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None), tp2, args, torch.device("cuda"))
    assert hooks != KernelHooks() and words.startswith(
        "auto -> the fast kernel's table (the default table) has tiles larger than this GPU's shared memory: exact (")
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None), q15, args, torch.device("cuda"))
    assert hooks != KernelHooks() and "(E=60,N=1408,device_name=NVIDIA_H200.json + " in words  # 192 KiB tiles
    shared[0] = H200_SHARED_BYTES
    args.enable_deterministic_inference = True
    hooks, words = RimuruRuntime.kernel_hooks(elastic, _moe_layers(None), q15, args, torch.device("cuda"))
    assert hooks != KernelHooks() and words.startswith("auto -> --enable-deterministic-inference: ")


def test_moe_kernel_exact_gives_the_kernel_sglang_functions(monkeypatch):
    from types import SimpleNamespace

    import torch

    from rimuru_patches.unified_pool import sglang_moe
    from rimuru_patches.unified_pool.runtime import RimuruRuntime
    from sglang_rimuru.config import RimuruConfig
    from sglang_rimuru.experts import MoEShape

    silu = object()
    fakes = {"try_get_optimal_moe_config": None, "get_config_dtype_str": lambda dtype: None, "silu_and_mul": silu,
             "_use_moe_sum_reduce_torch_compile": None, "moe_sum_reduce_torch_compile": None, "moe_sum_reduce": None}
    monkeypatch.setattr(sglang_moe, "resolve_targets", lambda: fakes)
    shape = MoEShape(num_experts=8, hidden=64, inter=32, top_k=2, layer_ids=(0,), dtype=torch.bfloat16)
    args = SimpleNamespace(enable_fused_moe_sum_all_reduce=False)
    hooks, words = RimuruRuntime.kernel_hooks(RimuruConfig(mode="static", moe_kernel="exact"), _moe_layers(None),
                                              shape, args, torch.device("cuda"))
    assert hooks.act_and_mul is silu and hooks.configs is not None and hooks.combine is not None
    assert words.startswith("exact (SGLang's configs, silu_and_mul and top-k sum")
    # the default, auto, is exact in static mode and says so
    monkeypatch.setattr("rimuru_kernels.moe_config.device_name", lambda device: "NVIDIA_H200")
    monkeypatch.setattr("rimuru_kernels.moe_config.device_shared_bytes", lambda device: H200_SHARED_BYTES)
    hooks, words = RimuruRuntime.kernel_hooks(RimuruConfig(mode="static"), _moe_layers(None), shape, args,
                                              torch.device("cuda"))
    assert hooks.act_and_mul is silu
    assert words.startswith("auto -> static mode: outputs equal --rimuru-mode off: exact (SGLang's configs")
    with pytest.raises(RuntimeError, match="different routed_scaling_factor values"):
        RimuruRuntime.kernel_hooks(RimuruConfig(mode="static"), _moe_layers(None, 2.0), shape, args,
                                   torch.device("cuda"))


def test_the_ledger_lists_exactly_the_registered_seams():
    """patches/README.md's ledger and the registry are one list: every registered seam
    has a row naming its target, and every row named like a seam is registered."""
    import re

    from rimuru_patches import all_seams, seams

    all_seams.load()
    ledger = (Path(__file__).parents[1] / "patches" / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9_]+\.[a-z0-9_.]+)` \| ([^|]*)\|", ledger, re.M)}
    registered = {s.name: s.target for s in seams.REGISTRY}
    # rows for SGLang functions the project calls without replacing anything
    called_only = {name for name, row in rows.items() if name not in registered and "nothing replaced" in ledger.split(f"| `{name}` |")[1].split("\n")[0]}
    assert sorted(set(rows) - called_only) == sorted(registered)
    for name, target in registered.items():
        module, _, attr = target.partition(":")
        last = attr.split(".")[-1]
        # the row names the target, in full or with SGLang's module path shortened by "…"
        assert last in rows[name] and (module in rows[name] or "…" in rows[name]), (name, target, rows[name])


def test_cpu_launch_defaults_cap_the_kv_pool_and_sleep_on_idle_unless_given():
    from rimuru_patches.cpu_platform import DEFAULT_MAX_TOTAL_TOKENS, default_cli_args

    assert default_cli_args(["--model-path", "m"]) == ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS),
                                                      "--sleep-on-idle"]
    assert default_cli_args(["--max-total-tokens=512", "--sleep-on-idle"]) == []
    assert default_cli_args(["--max-total-tokens", "512"]) == ["--sleep-on-idle"]
