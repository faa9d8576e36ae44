"""fp8 under torch.compile: no graph break of ampkit's in any fp8 recipe on Hugging Face Llama and GPT-2 (its
Conv1D) with every Linear converted, the same count as torchao's own ``convert_to_float8_training``.

Breaks are counted with ``torch._dynamo.explain`` (dynamo only, no inductor: seconds). The forward (with the
loss) must trace as one graph (the autograd.Functions' backwards are speculated with their forwards, so a side
effect there shows up as a break too); a compiled training step, forward and backward, in every mode and equal
to eager: tests/integrations/test_hf_compile.py. Emulated fp8 (CPU), the same Python as on a GPU.
"""
import warnings

import pytest
import torch
import torch._dynamo as dynamo

import ampkit
from ampkit.precision.fp8.swap import DIMS
from hf_models import BATCHES, build

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "mxfp8")


def _model(arch, mode):
    model = build(arch)
    model.loss_type = "ForCausalLM"  # else transformers logs (a graph break of its own) on the first loss
    if mode == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
        return model, lambda: torch.autocast("cpu", torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = ampkit.Precision(mode, "cpu", op_policy=False, fp8_filter="all")
        model, _ = prec.setup(model)
    cov = prec.fp8.coverage  # every Linear / Conv1D converted (mxfp8: but Llama's 32x16 k/v, not blocks of 32)
    assert len(prec.fp8.layers) >= 8 and set(cov["skipped"]) <= {DIMS}, cov["skipped"]
    return model, prec.autocast


def _breaks(arch, mode):
    model, autocast = _model(arch, mode)
    batch = BATCHES[arch](0)

    def step(**b):
        with autocast():
            return model(**b).loss

    dynamo.reset()
    try:
        e = dynamo.explain(step)(**batch)
    finally:
        dynamo.reset()
    return e.graph_break_count, [r.reason.splitlines()[0] for r in e.break_reasons]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", RECIPES + ("torchao",))
def test_fp8_forward_traces_whole(arch, mode):
    """0 breaks, as torchao's own conversion (which on GPT-2 converts nothing: its Conv1Ds are not Linears)."""
    count, why = _breaks(arch, mode)
    assert count == 0, why
