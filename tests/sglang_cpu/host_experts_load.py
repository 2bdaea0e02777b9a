"""Run in a child process (it imports SGLang with the CPU stand-in): the
``experts.host_*`` seams over SGLang's own ``create_weights`` and
``initialize_dummy_weights``.

* While the main model is built, SGLang's ``UnquantizedFusedMoEMethod.create_weights``
  gives a layer ``w13_weight`` / ``w2_weight`` that are views of one host tensor in
  the host store's layout, with the attributes SGLang set (its weight loader),
  and the runtime can adopt that tensor (``HostExpertStore.adopt``).
* Outside that (a draft model), and for a layer with biases, SGLang's placement stays.
* ``--load-format dummy``: the hosted experts get exactly the numbers SGLang's own
  ``initialize_dummy_weights`` gives the same parameters made the usual way, and
  the other parameters are drawn by SGLang as before.
"""

import types

import torch

from rimuru_patches.bootstrap import bootstrap_process
from rimuru_patches.context import ProcessContext

bootstrap_process(ProcessContext(device="cpu", rimuru={"mode": "static"}))

from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod  # noqa: E402
from sglang.srt.model_loader import loader, weight_utils  # noqa: E402

from rimuru_patches import seams  # noqa: E402
from rimuru_patches.unified_pool import host_experts  # noqa: E402
from sglang_rimuru.experts import HostExpertStore, MoEShape  # noqa: E402

for name in ("experts.host_load", "experts.host_weights", "experts.dummy_weights"):
    assert name in seams.installed(), name
assert loader.initialize_dummy_weights is not weight_utils.initialize_dummy_weights

E, I, H = 4, 6, 8


def sglang_initialize_dummy_weights(module):
    """SGLang's own function, not the seam."""
    return weight_utils.initialize_dummy_weights(module)


class Layer(torch.nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.moe_runner_config = MoeRunnerConfig(is_gated=True)


def loader_fn(*args):
    pass


def made(layer_id, *, with_bias=False):
    layer = Layer(layer_id)
    UnquantizedFusedMoEMethod().create_weights(layer, E, H, I, torch.bfloat16, with_bias=with_bias,
                                               weight_loader=loader_fn)
    return layer


# -- placement --------------------------------------------------------------
with host_experts.placing():
    layers = [made(3), made(7)]
    biased = made(9, with_bias=True)
hosted = host_experts.take()
assert sorted(hosted) == [3, 7], sorted(hosted)
assert host_experts.take() == {}  # taken once
for layer in layers:
    host = hosted[layer.layer_id]
    assert host.shape == (E, 3, I * H) and host.dtype == torch.bfloat16 and host.is_contiguous()
    w13, w2 = layer.w13_weight, layer.w2_weight
    assert isinstance(w13, torch.nn.Parameter) and not w13.requires_grad
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I) and w13.device.type == "cpu"
    assert w13.weight_loader is loader_fn and w2.weight_loader is loader_fn  # SGLang's attributes kept
    # views: what a weight loader writes into expert 2's up rows / down is in the host tensor
    w13.data[2, I:].fill_(1.5)
    w2.data[2].fill_(-2.0)
    assert torch.equal(host[2, 1], torch.full((I * H,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(host[2, 2], torch.full((I * H,), -2.0, dtype=torch.bfloat16))
    assert w13.data[2, :I].data_ptr() == host[2, 0].data_ptr()
store = HostExpertStore.adopt(
    MoEShape(layer_ids=(3, 7), num_experts=E, hidden=H, inter=I, top_k=2, dtype=torch.bfloat16), hosted)
assert store.layer_tensor(7) is hosted[7] and not store.pinned
assert torch.equal(store.matrix(3, 2, 1), torch.full((I * H,), 1.5, dtype=torch.bfloat16))
assert not getattr(biased.w13_weight, host_experts.HOSTED_ATTR, False)  # biases: SGLang's placement
outside = made(4)  # not while the main model is built (a draft model): SGLang's placement
assert not getattr(outside.w13_weight, host_experts.HOSTED_ATTR, False) and host_experts.take() == {}


# -- dummy weights ------------------------------------------------------------
class Model(torch.nn.Module):
    def __init__(self, hosted_experts: bool):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.empty(16, H, dtype=torch.bfloat16), requires_grad=False)
        if hosted_experts:
            with host_experts.placing():
                self.moe = made(0)
            host_experts.take()
        else:
            self.moe = made(0)


ours, plain = Model(True), Model(False)
assert getattr(ours.moe.w13_weight, host_experts.HOSTED_ATTR, False)
assert not getattr(plain.moe.w13_weight, host_experts.HOSTED_ATTR, False)
loader.initialize_dummy_weights(ours)  # the seam
sglang_initialize_dummy_weights(plain)  # SGLang's own on contiguous parameters
for name in ("embed", "moe.w13_weight", "moe.w2_weight"):
    a, b = ours.get_parameter(name), plain.get_parameter(name)
    assert a.shape == b.shape and torch.equal(a, b), name
    assert a.abs().max() > 0, name
assert ours.moe.w13_weight.data[0, :I].data_ptr() != plain.moe.w13_weight.data_ptr()
print("OK")
