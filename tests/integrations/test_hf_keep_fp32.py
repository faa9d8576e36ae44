"""Hugging Face Llama (LlamaRMSNorm) and T5 (T5LayerNorm, ``_keep_in_fp32_modules = ["wo"]``) in the
16-bit-param modes: their norms stay fp32 and compute in fp32, ``wo`` runs in fp32 where transformers
keeps it (fp16), describe() names what stayed fp32, and training steps stay finite."""
import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

import ampkit

from hf_models import BATCHES, build

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

class _LinearCalls(TorchFunctionMode):
    """Records (input dtype, autocast on?) of each F.linear call on the given weights."""

    def __init__(self, weights, seen):
        super().__init__()
        self.weights, self.seen = weights, seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and id(args[1]) in self.weights:
            self.seen.append((args[0].dtype, torch.is_autocast_enabled("cpu")))
        return func(*args, **(kwargs or {}))


NORM_CLASS = {"llama": "LlamaRMSNorm", "t5": "T5LayerNorm"}


def _train(arch, mode, steps=2):
    model = build(arch)
    precision = ampkit.Precision(mode, "cpu")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4))
    ctx = precision.autocast()
    for i in range(steps):
        with ctx:
            out = model(**BATCHES[arch](i))
        precision.backward(out.loss)
        precision.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
    return precision, model, out.loss


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-pure"])
@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_hf_norms_stay_fp32(arch, mode):
    precision, model, loss = _train(arch, mode)
    low = precision.compute_dtype
    norms = {n: m for n, m in model.named_modules() if type(m).__name__ == NORM_CLASS[arch]}
    assert norms and all(m.weight.dtype == torch.float32 for m in norms.values())
    outputs = []
    for m in norms.values():
        m.register_forward_hook(lambda mod, a, out: outputs.append(out.dtype))
    with precision.autocast(), torch.no_grad():
        model(**BATCHES[arch](9))
    assert outputs and set(outputs) == {low}  # computed in fp32, handed on in the compute dtype
    kept = precision.kept_fp32
    assert {n for n, why in kept.items() if why.startswith("norm")} == set(norms)
    assert f"{len(kept)} modules kept fp32 (norms: {len(norms)}" in precision.describe() and next(iter(norms)) in precision.describe()
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode,kept", [("fp16-pure", True), ("fp16-master", True), ("bf16-master", False)])
def test_t5_keep_in_fp32_modules_as_transformers_does(mode, kept):
    """transformers keeps T5's ``wo`` fp32 when loading in fp16 (it overflows there), not in bf16."""
    precision, model, loss = _train("t5", mode)
    wo = {n: m for n, m in model.named_modules() if n.endswith(".wo")}
    computes = []  # the weight each wo computes with (a master mode's compute copy, or the param)
    handles = [m.register_forward_pre_hook(lambda mod, a: computes.append(mod.weight.dtype)) for m in wo.values()]
    with precision.autocast(), torch.no_grad():
        model(**BATCHES["t5"](9))
    for h in handles:
        h.remove()
    assert wo and computes and all((d == torch.float32) == kept for d in computes)
    assert all(m.weight.dtype == (torch.float32 if kept else precision.param_dtype) for m in wo.values())
    assert {n for n, why in precision.kept_fp32.items() if why == "_keep_in_fp32_modules"} == (set(wo) if kept else set())
    if kept:
        weights = {id(m.weight) for m in wo.values()}
        gemms, outputs = [], []
        for m in wo.values():
            m.register_forward_hook(lambda mod, a, out: outputs.append(out.dtype))
        with precision.autocast(), torch.no_grad(), _LinearCalls(weights, gemms):
            model(**BATCHES["t5"](9))
        # each wo GEMM: fp32 input, autocast off inside; its output handed on in fp16
        assert gemms and set(gemms) == {(torch.float32, False)} and set(outputs) == {torch.float16}
    assert torch.isfinite(loss)
