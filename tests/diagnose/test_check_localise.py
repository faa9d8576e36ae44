"""First non-finite localisation: names the module, replays without side effects."""
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from ampkit import Precision
from ampkit.diagnose.check import check
from ampkit.diagnose.localise import format_report, localise_nonfinite

from check_models import NaNGrad, _NaNGrad, batch, mlp, planted_nan, planted_overflow


def loss_of(model, b):
    return F.cross_entropy(model(b[0]).float(), b[1])


def test_planted_nan_module_is_named_in_forward():
    torch.manual_seed(0)
    r = localise_nonfinite(planted_nan(), batch(), loss_of)
    assert r["stage"] == "forward" and r["module"] == "2.1" and r["type"] == "NaNGate"
    assert r["output"]["nan"] > 0 and r["input"]["nan"] == 0 and r["input_finite"]
    text = format_report(r)
    assert "'2.1' (NaNGate)" in text and "NaN" in text


def test_nan_in_fp32_reference_is_reported_by_check():
    torch.manual_seed(0)
    r = check(planted_nan(), batch(), precisions=["bf16-mixed"], audit=False)
    assert r["reference"]["nonfinite"] == "forward"
    assert r["reference"]["first_nonfinite"]["module"] == "2.1"
    assert r["verdicts"]["bf16-mixed"]["verdict"] == "unsafe"
    assert r["modules"][0]["name"] == "2.1" and r["modules"][0]["nonfinite"]


def test_planted_nan_gradient_is_named_in_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), NaNGrad(), nn.Linear(8, 4))
    r = localise_nonfinite(model, batch(), loss_of)
    assert r["stage"] == "backward" and r["module"] == "2" and r["type"] == "NaNGrad"
    assert r["grad_output"]["nan"] == 0 and r["grad_input"]["nan"] > 0


class _Parent(nn.Module):
    """The NaN gradient comes from the parent's own code, after its child."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(8, 8)

    def forward(self, x):
        return _NaNGrad.apply(self.child(x))


def test_nan_gradient_from_code_between_modules_names_its_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Parent(), nn.Linear(8, 4))
    r = localise_nonfinite(model, batch(), loss_of)
    assert r["stage"] == "backward" and r["module"] == "1.child" and r["between_modules"]
    assert "consumes that output" in r["message"]


def test_scaled_gradient_overflow_points_at_the_loss():
    torch.manual_seed(0)
    r = localise_nonfinite(mlp(), batch(), loss_of, "fp16-mixed", loss_scale=2.0**40)
    assert r["stage"] == "loss-backward" and r["loss_scale"] == 2.0**40
    assert localise_nonfinite(mlp(), batch(), loss_of, "fp16-mixed", loss_scale=2.0**8) is None


def test_trainer_use_with_a_set_up_precision_and_no_side_effects():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(8), planted_overflow())  # BN stats stay finite here
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = Precision("fp16-mixed", "cpu")
    model, opt = prec.setup(model, opt)
    x, y = batch()
    with prec.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    assert not torch.isfinite(loss)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    r = localise_nonfinite(model, (x, y), loss_of, prec)
    assert r["module"] == "1.boom" and r["precision"] == "fp16-mixed" and r["loss_scale"] == 2.0**16
    assert "--fp32-modules 1.boom" in r["message"]
    # nothing changed: buffers (BatchNorm statistics), RNG, grads, hooks
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules() if m is not model)


def test_healthy_model_returns_none():
    torch.manual_seed(0)
    assert localise_nonfinite(mlp(), batch(), loss_of, "bf16-mixed") is None
    assert "did not reproduce" in format_report(None)


def test_non_finite_batch_is_blamed_on_the_input():
    x, y = batch()
    x[0, 0] = float("inf")
    r = localise_nonfinite(mlp(), (x, y), loss_of)
    assert r["stage"] == "input" and "clean the data" in r["message"]
