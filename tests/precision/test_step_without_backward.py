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


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["fp32", "fp16-mixed", "bf16-master", "bf16-pure"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_second_step_on_the_same_gradients_is_refused(mode, max_norm):
    """One backward, two steps: the second would apply the same gradients again (it did in fp16-mixed,
    bf16-master and bf16-pure); refused in one line, nothing stepped or counted. The next backward steps again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    prec = Precision(mode, "cpu")
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    x = torch.randn(3, 4, dtype=next(model.parameters()).dtype)
    prec.backward(model(x).float().mean())
    prec.step(opt, max_norm=max_norm)
    after_one = [p.detach().clone() for p in model.parameters()]
    steps = prec.optimizer_steps + prec.skipped_steps
    with pytest.raises(RuntimeError, match=r"gradients the last step applied, unchanged.*precision\.backward\(loss\)"):
        prec.step(opt, max_norm=max_norm)
    assert all(torch.equal(a, b) for a, b in zip(after_one, model.parameters()))
    assert prec.optimizer_steps + prec.skipped_steps == steps
    opt.zero_grad(set_to_none=False)  # grads kept as zeros, then a new backward accumulates into them
    prec.backward(model(x).float().mean())
    prec.step(opt, max_norm=max_norm)
    assert prec.optimizer_steps + prec.skipped_steps == steps + 1
