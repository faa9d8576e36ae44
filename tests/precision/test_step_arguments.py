"""`Precision.step`'s arguments: a max_norm that would clip nothing is refused, not ignored."""
import pytest
import torch

from ampkit import Precision


@pytest.mark.parametrize("max_norm", [0, -1.0, float("nan")])
def test_step_refuses_a_max_norm_that_clips_nothing(max_norm):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = Precision("fp32", "cpu")
    model, opt = p.setup(model, opt)
    p.backward(model(torch.randn(4, 3)).sum())
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="max_norm must be > 0, or None"):
        p.step(opt, max_norm=max_norm)
    assert torch.equal(model.weight.detach(), before)
