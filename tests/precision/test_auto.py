"""`auto` is one rule (ampkit/precision/auto.py): the device's choice, the candidates tuning times, the
order the check walks, and the "why" line that train and check print all come from it."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import Tuned
from ampkit.precision.auto import (auto_candidates, auto_mode, choose_auto, decide, mode_family, preference_order, probe,
                                   resumed_mode, safe_modes, why)
from ampkit.tuning.autotune import fastest_mode

pytestmark = pytest.mark.machine_kind  # auto's choice follows the measured capability


def test_the_device_choice_is_the_first_preference(any_cpu_kind):
    order = preference_order("cpu")
    assert auto_mode("cpu")[0] == order[0] and order[-1] == "fp32"
    assert "fp16-mixed" not in order  # torch's CPU fp16 is slow: never a CPU candidate
    assert auto_candidates("cpu") == [m for p in order[:-1] for m in mode_family(p, "cpu")] + ["fp32"]
    assert all(probe(m) in order for m in auto_candidates("cpu"))  # each candidate is judged by a checked dtype
    # what Precision("auto") runs without a measurement is the device choice, with its reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision("auto", "cpu")
    assert (p.name, p.reason) == auto_mode("cpu") == decide("cpu")
    assert decide("cpu", Tuned(mode="O0", mode_reason="measured")) == ("fp32", "measured")


@pytest.mark.cpu_caps("amx")
def test_check_and_tuning_word_why_with_the_one_function():
    ok = {"verdict": "ok", "reasons": []}
    checked = choose_auto({"bf16-mixed": ok, "fp32": ok}, "cpu")
    assert checked["mode"] == "bf16-mixed"
    assert checked["reason"] == why("bf16-mixed", "AMP check ok", "cpu")
    assert checked["reason"].startswith(auto_mode("cpu")[1])  # the device's argument leads: it was kept
    unsafe = {"verdict": "unsafe", "reasons": ["loss rel err 1 > 0.1"]}
    assert [m["mode"] for m in safe_modes({"bf16-mixed": unsafe}, "cpu")["modes"]] == ["fp32"]


@pytest.mark.cpu_caps("amx")
def test_tuning_reports_why_it_left_the_device_choice(monkeypatch, tmp_path):
    """fastest_mode keeps fp32 where it is measured faster: the reason says so first, the device's
    suggestion after (the same why() the check uses)."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    from ampkit.tuning import autotune

    monkeypatch.setattr(autotune, "time_modes", lambda model, x, y, loss, modes, dev, **kw:
                        {m: (1.0 if m == "fp32" else 2.0) for m in modes})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    got = fastest_mode(model, torch.randn(4, 8), torch.randint(0, 2, (4,)), nn.functional.cross_entropy, "cpu")
    assert got["mode"] == "fp32"
    assert got["reason"].startswith("AMP check ok; fp32 fastest here")
    assert got["reason"].endswith(f"; the device alone suggested bf16-mixed ({auto_mode('cpu')[1]})")


def test_a_resumed_auto_run_keeps_its_checkpoints_mode():
    assert resumed_mode("auto", "bf16-master") == "bf16-master"
    assert resumed_mode("auto", None) is None  # nothing saved yet: chosen as a fresh start
    assert resumed_mode("bf16-mixed", "fp32") is None  # a named mode is what runs (a mismatch: the checkpoint's error)



def test_auto_keeps_bf16_master_under_gradient_accumulation():
    """Today's bf16-master accumulates micro-batch gradients on the fp32 parameters, in fp32 (the design that kept
    16-bit model grads, which accumulated in bf16, is gone): auto keeps it a candidate under accumulation."""
    import warnings

    from torch import nn

    from ampkit import Precision
    from ampkit.precision.auto import mode_family

    assert mode_family("bf16-mixed", "cpu", grad_accum=4) == ["bf16-mixed", "bf16-master"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Precision("bf16-master", "cpu")
        model, _ = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs = torch.randn(3, 4, 8)

    def backward(x):
        with p.autocast():
            loss = model(x).float().square().mean()
        p.backward(loss)

    each = []
    for x in xs:  # each micro-batch's gradient alone
        model.zero_grad(set_to_none=True)
        backward(x)
        each.append([q.grad.clone() for q in model.parameters()])
    model.zero_grad(set_to_none=True)
    for x in xs:  # accumulated
        backward(x)
    for i, q in enumerate(model.parameters()):
        assert q.grad.dtype == torch.float32
        assert torch.equal(q.grad, each[0][i] + each[1][i] + each[2][i])  # summed in fp32, not rounded to bf16
