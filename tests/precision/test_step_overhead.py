"""What ``Precision.step`` adds to the optimizer's own step, counted in dispatched ops (each a kernel launch
on a GPU, where small models' steps are launch-bound): the unscaled modes' inf/NaN guard and the device-side
skip counters stay a fixed handful of ops, whatever the number of parameters or parameter groups."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from op_count import OpCount


def _ops_per_step(mode, layers, groups):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[i::groups]} for i in range(groups)], lr=1e-3, fused=True)
    x = torch.randn(4, 8)
    if mode is None:  # the plain loop's step
        for _ in range(3):
            model(x).pow(2).mean().backward()
            with OpCount() as c:
                opt.step()
            opt.zero_grad()
        return c.n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision(mode, "cpu")
        model, opt = p.setup(model, opt)
    for _ in range(3):
        with p.autocast():
            loss = model(p.convert_input(x)).float().pow(2).mean()
        p.backward(loss)
        with OpCount() as c:
            p.step(opt)
        opt.zero_grad()
    return c.n


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed"])
def test_unscaled_step_adds_a_fixed_handful_of_ops(mode):
    for layers, groups in ((2, 1), (12, 2)):
        extra = _ops_per_step(mode, layers, groups) - _ops_per_step(None, layers, groups)
        # guard: foreach max-abs per dtype group, stack, amax, mul, nan_to_num (5 + groups of dtypes);
        # counters: gt, index, add, addcmul, where (5); the fused AdamW's step-count rollback per group
        assert extra <= 12 + groups, (layers, groups, extra)
