"""``torch.compile(model)`` on Hugging Face Llama and GPT-2 (tiny configs, tests/hf_models.py) trains in every ampkit
mode, equal to the same steps in eager within the mode's tolerance, with no graph break.

The compiled runs use ``backend="aot_eager"`` (dynamo + AOT autograd, the graphs run by eager kernels: the
forward and backward are traced as inductor would get them, in seconds; a difference from eager is then a
tracing one, or a decomposition's rounding); ``test_inductor_compiles_fp8`` runs one case through inductor
itself (C++ codegen on the CPU, slower). fp8 modes convert every Linear/Conv1D (``fp8_filter="all"``), emulated
on the CPU: the same Python and casts as on a GPU. By default every Llama mode but three fp8 recipes, and GPT-2 in
bf16-master; every mode on both models with ``--slow``.
"""
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

import ampkit
from ampkit.precision.modes import MODES
from hf_models import BATCHES, build

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

#: relative loss difference compiled vs eager allowed per compute dtype (a decomposition may round differently)
TOL = {None: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8_TOL = 2e-2
#: run by default (the rest with --slow: each compiled fp8 run costs a minute of CPU): every Llama mode but the fp8
#: recipes other than fp8-tensorwise (their 0 breaks are counted in tests/precision/test_fp8_compile.py, in seconds),
#: and GPT-2 in bf16-master (a compute copy of a transposed Conv1D weight)
DEFAULT = {("llama", m) for m in MODES if m not in ("fp8-rowwise", "fp8-delayed", "mxfp8")} | {("gpt2", "bf16-master")}
CASES = [pytest.param(a, m, id=f"{a}-{m}", marks=() if (a, m) in DEFAULT else pytest.mark.slow)
         for a in ("llama", "gpt2") for m in MODES]


def _train(arch, mode, backend=None, steps=2):
    """``steps`` steps on one batch (the loss must fall); the losses and the graph breaks dynamo counted."""
    model = build(arch)
    model.loss_type = "ForCausalLM"  # else transformers logs on the first loss (a graph break of its own)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = ampkit.Precision(mode, "cpu", op_policy=False, **({"fp8_filter": "all"} if MODES[mode].fp8 else {}))
        model, opt = prec.setup(model, opt)
    forward = model if backend is None else torch.compile(model, backend=backend)
    batch = BATCHES[arch](0)
    dynamo.reset()
    counters.clear()
    losses = []
    try:
        for _ in range(steps):
            with prec.autocast():
                loss = forward(**batch).loss
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
    finally:
        dynamo.reset()
    return torch.stack(losses), dict(counters["graph_break"])


def _tol(mode):
    return FP8_TOL if MODES[mode].fp8 else TOL[MODES[mode].low_dtype]


@pytest.mark.parametrize("arch,mode", CASES)
def test_compiled_model_trains_like_eager(arch, mode):
    eager, _ = _train(arch, mode)
    compiled, breaks = _train(arch, mode, backend="aot_eager")
    assert breaks == {}, breaks
    assert torch.isfinite(compiled).all() and compiled[-1] < compiled[0], compiled
    rel = ((compiled - eager).abs() / eager.abs()).max().item()
    assert rel <= _tol(mode), (mode, eager.tolist(), compiled.tolist())


@pytest.mark.slow  # inductor's C++ codegen for a forward and backward: ~100 s of CPU time
def test_inductor_compiles_fp8():
    """The default backend itself (inductor) on fp8-tensorwise Llama: the fused casts and scales train as eager."""
    eager, _ = _train("llama", "fp8-tensorwise")
    compiled, breaks = _train("llama", "fp8-tensorwise", backend="inductor")
    assert breaks == {}, breaks
    assert ((compiled - eager).abs() / eager.abs()).max().item() <= FP8_TOL and compiled[-1] < compiled[0]
