"""`precision.step()` with no backward before it: one behaviour in every mode, one
clear error; nothing stepped, nothing counted."""
import pytest
import torch

from ampkit import Precision


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "fp16-mixed", "fp16-master", "bf16-master", "bf16-pure",
                                  "fp16-pure"])
def test_step_without_backward_is_one_clear_error(mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    prec = Precision(mode, "cpu")
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"found no gradients.*call precision\.backward\(loss\)"):
        prec.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert prec.skipped_steps == 0
    # the right order still works afterwards (fp16 modes may skip their first step: the scale backs off)
    prec.backward(model(torch.randn(3, 4, dtype=next(model.parameters()).dtype)).float().mean())
    prec.step(opt)
    assert prec.skipped_steps <= 1
