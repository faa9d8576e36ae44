"""Removed public names come back for one release as deprecated aliases of what replaced them."""
import warnings

import pytest
import torch
from torch import nn

import ampkit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["fp32", "fp16-mixed"])
def test_last_grad_norm_is_the_norm_step_clipped_and_warns_naming_clip_grad_norm(mode):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = ampkit.Precision(mode, "cpu")
    model, opt = precision.setup(model, opt)
    with precision.autocast():
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    precision.backward(loss)
    # precision.backward leaves true (unscaled) gradients in every mode: the norm is theirs
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float())
                                                     for p in model.parameters()]))
    precision.step(opt, max_norm=1e-3)  # far below the norm: the step clips
    with pytest.warns(DeprecationWarning, match=r"precision\.clip_grad_norm_\(optimizer, max_norm\)"):
        norm = precision.last_grad_norm
    torch.testing.assert_close(norm, expected)

    with precision.autocast():
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    precision.backward(loss)
    precision.step(opt)  # no clipping: no norm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert precision.last_grad_norm is None
