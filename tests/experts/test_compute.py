"""ExpertManager.compute_cpu is bit-identical to SGLang 0.5.17's moe_forward_native,
with experts read from scattered pool pages and from load-buffer pages; the paged
Triton kernel path (compute_cuda) agrees with it within bf16 tolerance."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from sglang_rimuru.experts import ExpertManager, ExpertNotPreparedError, ExpertRanking

from .rig import make_rig, tiny_shape


# ---------------------------------------------------------------------------------------
# SGLang's code, for comparison only. ``moe_forward_native`` below is copied verbatim from
# sglang 0.5.17, python/sglang/srt/layers/moe/fused_moe_native.py (Apache-2.0);
# test_reference_is_sglangs_verbatim checks it against the installed file. Its imports are
# replaced by the stand-ins right here: SiluAndMul's torch path (activation.py,
# forward_native); GeluAndMul / SituAndMul / swiglu_gpt_oss_sigmoid_alpha are never
# reached with activation="silu", gemm1_alpha=None.
class SiluAndMul:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


GeluAndMul = SituAndMul = swiglu_gpt_oss_sigmoid_alpha = None
StandardTopKOutput = MoeRunnerConfig = object


def moe_forward_native(
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_output: StandardTopKOutput,
    moe_runner_config: MoeRunnerConfig,
) -> torch.Tensor:

    if moe_runner_config.apply_router_weight_on_input:
        raise NotImplementedError()

    topk_weights, topk_ids, _ = topk_output

    # Ref code from https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/e0828e3cc0a03408724b80c3cc92c8e072db8d01/modeling_deepseek.py#L589
    len_experts = layer.num_experts

    cnts = topk_ids.new_zeros((topk_ids.shape[0], len_experts))
    cnts.scatter_(1, topk_ids.to(torch.int64), 1)
    tokens_per_expert = cnts.sum(dim=0)
    idxs = topk_ids.view(-1).argsort()

    sorted_tokens = x[idxs // topk_ids.shape[1]]
    tokens_per_expert = tokens_per_expert.cpu().numpy()

    if moe_runner_config.activation == "silu":
        act = SiluAndMul()
    elif moe_runner_config.activation == "gelu":
        act = GeluAndMul()
    elif moe_runner_config.activation == "situ":
        situ_beta = (
            moe_runner_config.gemm1_alpha
            if moe_runner_config.gemm1_alpha is not None
            else 4.0
        )
        situ_linear_beta = moe_runner_config.gemm1_clamp_limit
        act = SituAndMul(beta=situ_beta, linear_beta=situ_linear_beta)
    else:
        raise ValueError(f"Unsupported activation: {moe_runner_config.activation=}")

    # Get bias terms if available
    w13_bias = getattr(layer, "w13_weight_bias", None)
    w2_bias = getattr(layer, "w2_weight_bias", None)
    outputs = []
    start_idx = 0
    for i, num_tokens in enumerate(tokens_per_expert):
        end_idx = start_idx + num_tokens
        if num_tokens == 0:
            continue
        tokens_for_this_expert = sorted_tokens[start_idx:end_idx]

        layer_w13_weight = layer.w13_weight[i]
        layer_w2_weight = layer.w2_weight[i]

        # Store original dtype
        original_dtype = tokens_for_this_expert.dtype

        # Get bias terms if available for this expert
        layer_w13_bias = w13_bias[i] if w13_bias is not None else None
        layer_w2_bias = w2_bias[i] if w2_bias is not None else None

        # Apply w13 linear
        gate_up = F.linear(tokens_for_this_expert, layer_w13_weight)

        # Add bias if present (for models like GPT-OSS)
        if layer_w13_bias is not None:
            gate_up_fp32 = gate_up.float() + layer_w13_bias
            gate_up = gate_up_fp32.to(original_dtype)

        # Apply activation
        if (
            moe_runner_config.activation == "silu"
            and moe_runner_config.gemm1_alpha is not None
        ):
            assert moe_runner_config.gemm1_clamp_limit is not None
            gate_up = swiglu_gpt_oss_sigmoid_alpha(
                gate_up,
                moe_runner_config.gemm1_alpha,
                moe_runner_config.gemm1_clamp_limit,
            )
        else:
            gate_up = act(gate_up)

        # Apply w2 linear
        expert_out = F.linear(gate_up, layer_w2_weight)

        # Add bias if present (for models like GPT-OSS)
        if layer_w2_bias is not None:
            expert_out = expert_out.float() + layer_w2_bias
            expert_out = expert_out.to(original_dtype)

        outputs.append(expert_out)
        start_idx = end_idx

    outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
    new_x = torch.empty_like(outs)

    new_x[idxs] = outs
    final_out = (
        new_x.view(*topk_ids.shape, -1)
        .type(topk_weights.dtype)
        .mul_(topk_weights.unsqueeze(dim=-1))
        .sum(dim=1)
        .type(new_x.dtype)
    )
    return final_out
# End of SGLang's code.
# ---------------------------------------------------------------------------------------

SILU = SimpleNamespace(apply_router_weight_on_input=False, activation="silu",
                       gemm1_alpha=None, gemm1_clamp_limit=None)


def sglang_reference(rig, layer: int, x, topk_weights, topk_ids) -> torch.Tensor:
    stub = SimpleNamespace(num_experts=rig.shape.num_experts, w13_weight=rig.w13[layer],
                           w2_weight=rig.w2[layer])
    return moe_forward_native(stub, x, (topk_weights, topk_ids, None), SILU)


def route(T: int, E: int, k: int, g: torch.Generator):
    """SGLang-style routing: float32 softmax weights (renormalized), int32 ids."""
    logits = torch.randn(T, E, generator=g)
    w, i = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w / w.sum(-1, keepdim=True), i.to(torch.int32)


CASES = [  # (T, k, E, I, H)
    (1, 1, 8, 4, 8),
    (3, 2, 8, 4, 8),
    (17, 2, 8, 8, 16),
    (40, 4, 16, 8, 16),
    (64, 8, 16, 16, 32),
    (129, 6, 32, 8, 24),
]


@pytest.mark.parametrize("T, k, E, I, H", CASES)
def test_compute_cpu_is_bit_identical_to_sglang(T, k, E, I, H) -> None:
    g = torch.Generator().manual_seed(1000 * T + E)
    shape = tiny_shape(E=E, I=I, H=H, k=k)
    perm = {l: torch.randperm(E, generator=g).tolist() for l in shape.layer_ids}
    ranking = ExpertRanking(E, perm, {l: [1.0 / E] * E for l in perm})
    limit = E // 2
    rig = make_rig(shape, ranking=ranking, limit=limit, resident=E - limit,
                   pages=3 * E + 6 * limit + 8, fragment=True, gates="random", seed=T)
    m = rig.manager
    m.begin_forward()
    for layer in shape.layer_ids:
        x = (torch.randn(T, H, generator=g)).to(torch.bfloat16)
        w, i = route(T, E, k, g)
        m.prefetch_next(layer, x)
        table = m.prepare_layer(layer, i)
        out = m.compute_cpu(layer, x, w, i, table)
        ref = sglang_reference(rig, layer, x, w, i)
        assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == (T, H)
        assert torch.equal(out, ref), (layer, (out.float() - ref.float()).abs().max())
        assert torch.equal(m.compute(layer, x, w, i, table), ref)
    m.end_forward()
    s = m.stats()
    if T >= 17:  # enough tokens that offloaded experts were routed, from both paths
        assert s.on_demand_loads > 0 and s.prefetch_hits > 0


def test_zero_tokens() -> None:
    m = make_rig().manager
    m.begin_forward()
    ids = torch.zeros(0, 2, dtype=torch.int32)
    table = m.prepare_layer(0, ids)
    out = m.compute_cpu(0, torch.zeros(0, 8, dtype=torch.bfloat16), torch.zeros(0, 2), ids, table)
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16


def test_unprepared_offloaded_expert_is_read_from_the_host() -> None:
    # The home table points offloaded experts at their host pages: no copy, no sync,
    # the same output as after prepare_layer copied them (what CUDA graphs replay).
    rig = make_rig()
    m = rig.manager
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.tensor([[3, 2], [7, 6], [2, 0]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=torch.Generator().manual_seed(2))
    assert m.table(0)[2].tolist() == [-8, -9, -10]  # host pages 6, 7, 8 of layer 0
    zero_copy = m.compute_cpu(0, x, w, ids, m.table(0))
    m.begin_forward()
    copied = m.compute_cpu(0, x, w, ids, m.prepare_layer(0, ids))
    m.end_forward()
    assert torch.equal(zero_copy, copied)
    assert m.table(0)[2].tolist() == [-8, -9, -10]  # the copy path never touches the home table


def test_unprepared_expert_without_host_reads_is_an_error() -> None:
    rig = make_rig()
    m = ExpertManager(rig.shape, rig.buffer, rig.residency, rig.host, rig.buffers, None, "cpu", host_reads=False)
    assert m.table(0)[2].tolist() == [-1, -1, -1]
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ExpertNotPreparedError, match=r"expert 2 is routed but its table row is"):
        m.compute_cpu(0, x, torch.ones(1, 2), torch.tensor([[3, 2]], dtype=torch.int32), m.table(0))


def test_reference_is_sglangs_verbatim() -> None:
    """The copy above is the installed SGLang's function, statement for statement."""
    spec = importlib.util.find_spec("sglang")  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt/layers/moe/fused_moe_native.py"
    theirs = next(n for n in ast.parse(path.read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name == "moe_forward_native")
    ours = ast.parse(inspect.getsource(moe_forward_native)).body[0]
    assert ast.dump(ours) == ast.dump(theirs)


# ---------------------------------------------------------------------------------------
# compute_cuda: the paged Triton kernel over the same pool and table.


def _kernel_matches_cpu(device: str, T: int = 24) -> None:
    g = torch.Generator().manual_seed(7)
    shape = tiny_shape(E=8, I=16, H=32, k=2)
    rig = make_rig(shape, limit=3, resident=5, gates="random", fragment=True)
    if device != "cpu":
        from sglang_rimuru.experts import ExpertManager, HostExpertStore
        from sglang_rimuru.pool import PoolBuffer

        host = HostExpertStore(shape, pin_memory=True)  # pinned: the copies are async
        assert host.pinned
        for l in shape.layer_ids:
            host.put_fused(l, rig.w13[l], rig.w2[l])
        buf = PoolBuffer(rig.buffer.geometry, device, zero=True)
        gates = {l: t.to(device) for l, t in rig.gates.items()}
        m = ExpertManager(shape, buf, rig.residency, host, rig.buffers, gates, device)
        m.upload_resident()
    else:
        m = rig.manager
    m.begin_forward()
    for layer in shape.layer_ids:
        x = torch.randn(T, 32, generator=g).to(torch.bfloat16)
        w, i = route(T, 8, 2, g)
        xd, wd, idd = x.to(device), w.to(device), i.to(device)
        m.prefetch_next(layer, xd)
        table = m.prepare_layer(layer, idd)
        out = m.compute_cuda(layer, xd, wd, idd, table).cpu().float()
        ref = sglang_reference(rig, layer, x, w, i).float()
        # bf16 outputs rounded at other points than SGLang's native path (fp32
        # top-k sum, one rounding): a few bf16 ulps of the largest value apart.
        assert (out - ref).abs().max().item() <= 0.03 * ref.abs().max().item() + 1e-3
    m.end_forward()
    assert m.stats().on_demand_loads + m.stats().prefetch_hits > 0


def _interpreter_only(cuda_reason: str) -> None:
    """Skip unless the paged kernel runs under the Triton interpreter in this session."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(cuda_reason)
    import rimuru_kernels.paged_moe as pm

    if not pm.INTERPRETED:
        pytest.skip("rimuru_kernels was imported without TRITON_INTERPRET=1 in this session")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, inside the interpreter
def test_compute_cuda_kernel_wiring_under_the_interpreter() -> None:
    _interpreter_only("CUDA present: the gpu-marked test covers compute_cuda")
    _kernel_matches_cpu("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compute_cuda_on_gpu_with_streams() -> None:
    _kernel_matches_cpu("cuda", T=300)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, inside the interpreter
def test_compute_cuda_passes_the_manager_kernel_hooks() -> None:
    _interpreter_only("CUDA present: tests/kernels/test_gpu_sglang_exact.py covers the hooks on the GPU")
    import rimuru_kernels.paged_moe as pm

    from sglang_rimuru.experts import KernelHooks

    T, k, E, I, H = 10, 2, 8, 16, 32
    shape = tiny_shape(E=E, I=I, H=H, k=k)
    rig = make_rig(shape, limit=3, resident=5, gates="random", fragment=True)
    m = rig.manager
    assert m.kernel_hooks == KernelHooks()  # the kernel's own defaults until someone sets them
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1}
    calls = []

    def configs(num_tokens):
        calls.append(("configs", num_tokens))
        return dict(cfg), dict(cfg, BLOCK_SIZE_N=16)

    def act_and_mul(x, out):
        calls.append(("act", tuple(x.shape), tuple(out.shape)))
        pm._silu_and_mul(x, out)

    def combine(intermediate, out):
        calls.append(("combine", tuple(intermediate.shape), tuple(out.shape)))
        torch.sum(intermediate, dim=1, out=out)

    m.kernel_hooks = KernelHooks(configs=configs, act_and_mul=act_and_mul, combine=combine)
    g = torch.Generator().manual_seed(11)
    layer = shape.layer_ids[0]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, i = route(T, E, k, g)
    m.begin_forward()
    table = m.prepare_layer(layer, i)
    out = m.compute_cuda(layer, x, w, i, table).float()
    m.end_forward()
    assert calls == [("configs", T), ("act", (T * k, 2 * I), (T * k, I)), ("combine", (T, k, H), (T, H))]
    ref = sglang_reference(rig, layer, x, w, i).float()
    assert (out - ref).abs().max().item() <= 0.02 * ref.abs().max().item() + 1e-3

    # An explicit config wins over hooks.configs; act_and_mul and combine still apply.
    calls.clear()
    m.compute_cuda(layer, x, w, i, table, config=dict(cfg))
    assert [c[0] for c in calls] == ["act", "combine"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pin", ["register", "hugepage"])
def test_in_place_host_reads_from_registered_host_memory(pin, monkeypatch) -> None:
    """The host store's memory comes from ``pinned_empty`` (plain host memory,
    cudaHostRegister'ed, exactly sized; or 2 MiB-aligned huge-page memory); the
    paged kernel reads offloaded experts at their host addresses through the home
    table, as decode graphs do."""
    from sglang_rimuru.experts import HostExpertStore
    from sglang_rimuru.experts.host_store import PIN_ENV, pinned_empty

    monkeypatch.setenv(PIN_ENV, pin)
    t = pinned_empty((5, 3, 7), torch.bfloat16)
    assert t.is_pinned() and t.numel() == 5 * 3 * 7
    if pin == "register":
        assert t.untyped_storage().nbytes() == 5 * 3 * 7 * 2  # not rounded to a power of two
    g = torch.Generator().manual_seed(11)
    shape = tiny_shape(E=8, I=16, H=32, k=2)
    rig = make_rig(shape, limit=3, resident=5, gates="random", fragment=True)
    host = HostExpertStore(shape, pin_memory=True)
    assert host.pinned
    for l in shape.layer_ids:
        host.put_fused(l, rig.w13[l], rig.w2[l])
    m = _read_in_place_like_the_reference(rig, host, g)
    assert m.stats().on_demand_loads == 0  # nothing copied: offloaded experts were read in place


def _read_in_place_like_the_reference(rig, host, g):
    """A CUDA manager over ``host`` (pinned, filled with the rig's experts): every layer
    computed through its home table (offloaded experts read in place) within the
    tolerance of SGLang's reference. Returns the manager."""
    from sglang_rimuru.experts import ExpertManager
    from sglang_rimuru.pool import PoolBuffer

    shape = rig.shape
    buf = PoolBuffer(rig.buffer.geometry, "cuda", zero=True)
    gates = {l: t.to("cuda") for l, t in rig.gates.items()}
    m = ExpertManager(shape, buf, rig.residency, host, rig.buffers, gates, "cuda")
    assert m.host_reads
    m.upload_resident()
    m.begin_forward()
    for layer in shape.layer_ids:
        x = torch.randn(4, shape.hidden, generator=g).to(shape.dtype)
        w, i = route(4, shape.num_experts, shape.top_k, g)
        out = m.compute(layer, x.cuda(), w.cuda(), i.cuda(), m.table(layer)).cpu().float()
        ref = sglang_reference(rig, layer, x, w, i).float()
        assert (out - ref).abs().max().item() <= 0.03 * ref.abs().max().item() + 1e-3
    m.end_forward()
    return m


@pytest.mark.parametrize("huge", [False, True])
def test_aligned_host_memory_is_aligned_exact_writable_and_outlives_its_makers(huge, monkeypatch) -> None:
    import gc

    from sglang_rimuru.experts.host_store import PIN_ENV, aligned_empty, hugepage_empty, pinned_empty

    make = hugepage_empty if huge else aligned_empty
    ts = [make((4, 1000, 3), torch.bfloat16) for _ in range(3)]
    gc.collect()  # only the tensors hold their mappings now
    for i, t in enumerate(ts):
        assert t.shape == (4, 1000, 3) and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert t.data_ptr() % (2 << 20) == 0 and t.untyped_storage().data_ptr() == t.data_ptr()
        assert t.untyped_storage().nbytes() == 4 * 1000 * 3 * 2
        t.fill_(float(i + 1))
    assert [float(t.float().sum()) for t in ts] == [12_000.0, 24_000.0, 36_000.0]  # distinct memory
    view = ts[0][1:3]
    del ts
    gc.collect()
    assert float(view.float().sum()) == 6_000.0  # a view keeps the mapping alive
    assert aligned_empty((0, 5), torch.bfloat16).numel() == 0
    monkeypatch.setenv(PIN_ENV, "hugepages")
    with pytest.raises(ValueError, match="SGLANG_RIMURU_HOST_PIN='hugepages'"):
        pinned_empty((2,), torch.bfloat16)


@pytest.mark.parametrize("pin", ["register", "hugepage"])
def test_pinnable_host_memory_is_exact_and_unpinned_until_pinned_in_place(pin, monkeypatch) -> None:
    """Serving makes the host store with ``pinnable_empty`` and pins it only after the
    pool is sized (``HostExpertStore.pin``, ``RimuruRuntime.build``): until then it is
    plain (or huge-page) memory of exactly the store's size, adopted as unpinned."""
    from sglang_rimuru.experts import HostExpertStore
    from sglang_rimuru.experts.host_store import PIN_ENV, pinnable_empty

    monkeypatch.setenv(PIN_ENV, pin)
    shape = tiny_shape(E=8, I=16, H=32, k=2)
    layers = {l: pinnable_empty((8, 3, 16 * 32), torch.bfloat16) for l in shape.layer_ids}
    for t in layers.values():
        assert not t.is_pinned() and t.untyped_storage().nbytes() == 8 * 3 * 16 * 32 * 2
        # the storage itself starts on a 2 MiB boundary: is_pinned and cudaHostRegister
        # look at its pointer, and the paged kernel's row tiles must not straddle lines
        assert t.untyped_storage().data_ptr() == t.data_ptr() and t.data_ptr() % (2 << 20) == 0
    store = HostExpertStore.adopt(shape, layers)
    assert store.pinned is False
    if torch.cuda.is_available():  # the pin itself needs CUDA (the GPU test below reads through it)
        store.pin()
        assert store.pinned and all(t.is_pinned() for t in layers.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_store_pinned_in_place_is_read_in_place(monkeypatch) -> None:
    """What serving runs: host tensors made unpinned, filled, adopted, pinned in place,
    then read in place by the paged kernel, equal to the reference."""
    from sglang_rimuru.experts import HostExpertStore
    from sglang_rimuru.experts.host_store import PIN_ENV, pinnable_empty

    monkeypatch.setenv(PIN_ENV, "register")
    g = torch.Generator().manual_seed(12)
    shape = tiny_shape(E=8, I=16, H=32, k=2)
    rig = make_rig(shape, limit=3, resident=5, gates="random", fragment=True)
    layers = {l: pinnable_empty((8, 3, shape.matrix_elems), shape.dtype) for l in shape.layer_ids}
    host = HostExpertStore.adopt(shape, layers)
    for l in shape.layer_ids:
        host.put_fused(l, rig.w13[l], rig.w2[l])
    host.pin()
    assert _read_in_place_like_the_reference(rig, host, g).stats().on_demand_loads == 0
