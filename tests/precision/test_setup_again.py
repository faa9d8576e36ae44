"""A model an earlier setup changed (bf16-pure's bf16 params, a master mode's compute copies) is refused by a setup in
another mode, in one line naming the fix (``earlier.export(model)``), with nothing changed; the fix carries the weights
over with the Kahan compensation folded in."""
import io
import warnings

import pytest
import torch
from torch import nn

import ampkit


def _quiet(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "likely slower than fp32" on a CPU without bf16 units
        return ampkit.Precision(mode, "cpu")


def _trained_pure(steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prec = _quiet("bf16-pure")
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for _ in range(steps):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return prec, model, opt


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-pure"])
def test_another_mode_after_bf16_pure_is_refused_in_one_line_and_changes_nothing(mode):
    _, model, _ = _trained_pure()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(ValueError) as e:
        _quiet(mode).setup(model, torch.optim.AdamW(model.parameters()))
    text = str(e.value)
    assert "\n" not in text and "set up in 'bf16-pure'" in text and "earlier.export(model)" in text
    assert all(v.dtype == before[k].dtype and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks


def test_the_fix_carries_the_weights_over_with_the_kahan_compensation_folded_in():
    prec, model, opt = _trained_pure()
    assert any(s["compensation"].abs().sum() > 0 for s in opt.state.values())  # something to fold
    folded = {k: v.clone() for k, v in prec.fp32_state_dict(model).items()}
    fresh = prec.export(model)
    again = _quiet("bf16-mixed")
    fresh, _ = again.setup(fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(p.dtype == torch.float32 for p in fresh.parameters())
    assert all(torch.equal(v, folded[k]) for k, v in fresh.state_dict().items())
    assert any(not torch.equal(v, model.state_dict()[k].float()) for k, v in folded.items())  # not a plain cast


def test_the_same_mode_again_and_a_mode_that_changed_nothing_are_accepted():
    _, model, _ = _trained_pure()
    _quiet("bf16-pure").setup(model, torch.optim.AdamW(model.parameters()))  # the same mode: as before
    plain = nn.Linear(4, 4)
    _quiet("fp32").setup(plain, torch.optim.AdamW(plain.parameters()))
    _quiet("bf16-pure").setup(plain, torch.optim.AdamW(plain.parameters()))  # fp32 left the model as it was
    assert plain.weight.dtype == torch.bfloat16
    torch.save(plain, io.BytesIO())  # the mark is a string: the model still pickles


def test_a_master_mode_then_another_is_refused():
    model = nn.Linear(4, 4)
    _quiet("bf16-master").setup(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="set up in 'bf16-master'"):
        _quiet("bf16-mixed").setup(model, torch.optim.AdamW(model.parameters()))
