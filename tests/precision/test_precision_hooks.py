"""The kinds answer for themselves when a caller sets up in two halves (Lightning's plugin: the module
first, the optimizer later; apex's initialize; the FSDP path): ``convert_module``,
``wrap_optimizer``, ``_fsdp_policy``/``_prepare_fsdp`` (ampkit/precision/kinds/)."""
import warnings

import pytest
import torch
from torch import nn

from ampkit import Precision
from ampkit.optim import AdamW as CompensatedAdamW


def _precision(name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated bf16 / fp16 on this CPU
        return Precision(name, "cpu", **kw)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def _train(model, opt, precision, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        with precision.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["bf16-master", "fp16-master", "bf16-pure", "bf16-mixed"])
def test_two_halves_match_setup_bitwise(name):
    """Lightning's order (module converted, optimizer built on it, then wrapped) trains exactly as setup
    (setup's switch to torch's fused kernel aside: it needs the optimizer while converting, so off here)."""
    ref_model = _mlp()
    ref_prec = _precision(name, fused_optimizer=False)
    ref_model, ref_opt = ref_prec.setup(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2))
    ref = _train(ref_model, ref_opt, ref_prec)

    prec = _precision(name, fused_optimizer=False)
    model = _mlp()
    model = prec.convert_module(model)
    opt = prec.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert type(opt) is type(ref_opt)
    assert all(torch.equal(a, b) for a, b in zip(_train(model, opt, prec), ref))


@pytest.mark.parametrize("name", ["bf16-master", "fp16-master"])
def test_the_master_modes_step_the_users_optimizer_over_the_fp32_masters(name):
    """The masters are the model's fp32 parameters: the optimizer built on them is stepped as it is."""
    prec = _precision(name, fused_optimizer=False)
    model = prec.convert_module(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert prec.wrap_optimizer(opt) is opt and type(opt) is torch.optim.SGD
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_pure_modes_get_the_compensated_optimizer():
    assert isinstance(_precision("bf16-pure").wrap_optimizer(torch.optim.AdamW(_mlp().parameters())),
                      CompensatedAdamW)


def test_fsdp_policies_come_from_the_kind():
    """Master modes: fp32 shards gathered in 16 bits, reduced in fp32; pure modes: 16-bit shards gathered and
    reduced as they are; kept-fp32 modules: fp32 throughout; fp8-delayed refused in one line."""
    pytest.importorskip("torch.distributed.fsdp")
    master = _precision("fp16-master")._prepare_fsdp()
    assert (master.param_dtype, master.reduce_dtype) == (torch.float16, torch.float32)
    pure = _precision("bf16-pure")._prepare_fsdp()
    assert (pure.param_dtype, pure.reduce_dtype) == (None, None)
    kept = _precision("bf16-master")._fp32_policy()
    assert (kept.param_dtype, kept.reduce_dtype) == (None, torch.float32)
    assert _precision("fp8-rowwise")._prepare_fsdp().param_dtype == torch.bfloat16
    assert _precision("fp8-delayed")._prepare_fsdp().param_dtype == torch.bfloat16


def test_prepare_fsdp_turns_the_layout_off_or_refuses_it():
    pytest.importorskip("torch.distributed.fsdp")
    prec = _precision("bf16-mixed")
    policy = prec._prepare_fsdp()
    assert prec.channels_last is False and policy.param_dtype == torch.bfloat16
    assert policy.reduce_dtype == torch.float32
    assert _precision("fp32")._fsdp_policy().param_dtype is None
    with pytest.raises(ValueError, match="channels_last=True cannot be used with strategy 'fsdp'"):
        _precision("bf16-mixed", channels_last=True)._prepare_fsdp()
