"""Precision policies: every mode trains; master weights round-trip; errors are clear."""
import io
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit import Precision
from ampkit.precision import convert_model, modes, resolve
from precision_helpers import data as _data
from precision_helpers import net as _net
from precision_helpers import setup, train_steps

TRAINABLE = ["fp32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-pure", "fp16-pure", "auto"]


def _train(name, steps=25, opt_factory=None, **kw):
    p, model, opt = setup(name, opt_factory, **kw)
    return p, model, opt, train_steps(p, model, opt, steps)


@pytest.mark.parametrize("name", TRAINABLE)
def test_every_mode_trains_to_finite_decreasing_loss(name):
    p, model, _, losses = _train(name)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0]
    assert all(torch.isfinite(t).all() for t in model.parameters())


def _weight_dtype_in_forward(module, x):
    """The dtype ``module.weight`` has while its forward runs (the compute copy in the master modes)."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, a: seen.update(dtype=m.weight.dtype))
    return seen, handle


@pytest.mark.parametrize("name,dtype", [("fp16-master", torch.float16), ("bf16-master", torch.bfloat16),
                                        ("fp16-pure", torch.float16)])
def test_param_dtypes_and_norms_fp32(name, dtype):
    p, model, opt, _ = _train(name, steps=1)
    stored = torch.float32 if "master" in name else dtype  # master modes: the fp32 masters are the params
    assert model[0].weight.dtype == stored and model[3].weight.dtype == stored
    assert model[1].weight.dtype == torch.float32  # LayerNorm kept fp32
    if "master" in name:
        assert type(opt) is torch.optim.AdamW  # the user's optimizer steps the fp32 params: no wrapper
        assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
    seen, handle = _weight_dtype_in_forward(model[0], None)
    with p.autocast():  # the master modes make their compute copies inside it only
        out = model(torch.randn(2, 16))
    handle.remove()
    assert seen["dtype"] == dtype  # the forward computes with the 16-bit weight
    assert "weight" not in vars(model[0])  # and the compute copy is gone after it
    assert out.dtype == torch.float32  # outputs cast back for an fp32 loss


def test_mixed_modes_keep_fp32_params():
    for name in ("fp16-mixed", "bf16-mixed"):
        p, model, opt, _ = _train(name, steps=1)
        assert all(t.dtype == torch.float32 for t in model.parameters())
        assert type(opt) is torch.optim.AdamW


@pytest.mark.parametrize("name", ["fp16-master", "bf16-master"])
def test_master_checkpoint_roundtrip_exact(name):
    p, model, opt, _ = _train(name, steps=5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "prec": p.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)

    # continue the original for 3 steps
    def cont(p, model, opt):
        train_steps(p, model, opt, 3)
        return [t.detach().clone() for t in model.parameters()], [t.grad for t in model.parameters()]

    ref_params, ref_masters = cont(p, model, opt)

    model2 = _net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, eps=1e-4)
    p2 = Precision(name, "cpu")
    model2, opt2 = p2.setup(model2, opt2)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    p2.load_state_dict(ck["prec"])
    assert p2.loss_scale == ck["prec"]["scaler"].get("scale", 1.0)
    assert p2.optimizer_steps == ck["prec"]["scaler"]["optimizer_steps"]
    new_params, new_masters = cont(p2, model2, opt2)
    assert all(t.dtype == torch.float32 for t in ref_params)  # the params are the masters
    for a, b in zip(ref_params, new_params):
        assert torch.equal(a, b)


def test_master_grads_are_fp32_on_the_params_once():
    """One gradient per parameter, fp32, on the model's own (fp32) parameters: nothing kept twice, and
    micro-batches accumulate in fp32."""
    model = _net()
    p = Precision("bf16-master", "cpu")
    model, opt = p.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = _data()
    grads = []
    for _ in range(2):  # two micro-batches accumulate
        with p.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        p.backward(loss)
        grads.append([t.grad.clone() for t in model.parameters()])
    assert all(g.dtype == torch.float32 for g in grads[1])
    assert all(torch.equal(b, a + a) for a, b in zip(grads[0], grads[1]))  # fp32 sums, not 16-bit ones
    assert not any(st for st in opt.state.values())  # no masters or grads in the optimizer
    p.step(opt)


def test_nonfinite_step_skipped_in_every_mode():
    for name in ("fp32", "bf16-mixed", "bf16-master", "fp16-mixed"):
        model = _net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = Precision(name, "cpu")
        model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = [t.detach().clone() for t in model.parameters()]
        with p.autocast():
            loss = model(torch.randn(4, 16)).sum() * float("nan")
        p.backward(loss)
        assert not p.step(opt)  # a StepResult: falsy when skipped (read on demand)
        assert p.skipped_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_auto_on_cpu_never_fp16():
    p = Precision("auto", "cpu")
    assert p.name in ("bf16-mixed", "bf16-master", "fp32")
    assert "auto" in p.describe()


def test_aliases_resolve():
    assert resolve("O1") == "fp16-mixed" and resolve("O2") == "fp16-master" and resolve("O0") == "fp32"
    assert resolve("mixed_float16") == "fp16-mixed" and resolve("mixed_bfloat16") == "bf16-mixed"
    assert resolve("16-mixed") == "fp16-mixed" and resolve("bf16-true") == "bf16-pure"
    assert resolve("32-true") == "fp32" and resolve("BF16_Mixed") == "bf16-mixed"


def test_unknown_mode_lists_names():
    with pytest.raises(ValueError, match=r"Unknown precision 'fp8'.*bf16-mixed.*O0-O3"):
        Precision("fp8", "cpu")


def test_scaler_with_bf16_is_an_error():
    with pytest.raises(ValueError, match="does not use loss scaling.*bf16"):
        Precision("bf16-mixed", "cpu", loss_scale=1024)
    with pytest.raises(ValueError, match="does not use loss scaling"):
        Precision("fp32", "cpu", scaler=ampkit.LossScaler("cpu"))


@pytest.mark.cpu_caps("avx512_bf16")  # fp16 measured ~0.1x fp32, bf16 2.4x
def test_fp16_on_cpu_warns_with_the_measured_ratio_and_what_is_faster():
    with pytest.warns(UserWarning, match=r"fp16 matmuls/convs run 0.10x fp32's speed on this machine .* faster "
                                         r"here: 'bf16-mixed' \(2.40x\) or 'fp32'"):
        Precision("fp16-mixed", "cpu")


def test_bf16_without_hardware_support(monkeypatch):
    """A GPU without bf16 is an error that names the fix; a CPU without bf16 units, a warning."""
    from ampkit.precision import choice
    from ampkit.precision.kinds import base as policy
    from ampkit.precision.capability import DeviceInfo

    monkeypatch.setattr(policy, "device_info", lambda d: DeviceInfo(d.type, "Old GPU", False, False, True, "none",
                                                                    {"bf16": 0.01, "fp16": 0.01}, "measured"))
    monkeypatch.setattr(choice, "resolve_device", lambda d: torch.device("cuda"))
    with pytest.raises(RuntimeError, match="needs bf16, which Old GPU does not support: use 'fp16-mixed'"):
        Precision("bf16-mixed", "cuda")
    monkeypatch.setattr(choice, "resolve_device", lambda d: torch.device("cpu"))
    with pytest.warns(UserWarning, match="bf16 matmuls/convs run 0.01x fp32's speed"):
        Precision("bf16-pure", "cpu")


def test_static_loss_scale_apex_convention():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = Precision("O1", "cpu", loss_scale=128)
        assert p.loss_scale == 128 and not p.scaler.is_dynamic
        assert Precision("O1", "cpu", loss_scale=0).scaler.is_dynamic
        assert "static loss scale 128" in p.describe()


def test_global_policy():
    try:
        ampkit.set_global_policy("mixed_bfloat16")
        assert ampkit.global_policy() == "bf16-mixed"
        assert Precision(device="cpu").name == "bf16-mixed"
    finally:
        ampkit.set_global_policy(None)
    assert ampkit.global_policy() == "auto"


def test_convert_model_keeps_batchnorm_and_forward_works():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.GroupNorm(1, 2))
    convert_model(model, torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    assert model[4].weight.dtype == torch.float32
    out = model(torch.randn(2, 1, 8, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_fp32_islands():
    model = _net()
    p = Precision("bf16-master", "cpu", fp32_modules=["3"])
    model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[3].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float32
    computes, handle = _weight_dtype_in_forward(model[0], None)
    island, handle3 = _weight_dtype_in_forward(model[3], None)
    seen = {}
    model[3].register_forward_hook(lambda m, a, o: seen.setdefault("dtype", o.dtype))
    with p.autocast():
        model(torch.randn(2, 16))
    handle.remove(), handle3.remove()
    assert seen["dtype"] == torch.float32
    assert computes["dtype"] == torch.bfloat16 and island["dtype"] == torch.float32
    with pytest.raises(ValueError, match="not found in the model"):
        Precision("bf16-mixed", "cpu", fp32_modules=["nope"]).setup(_net())


def test_describe_and_state_mismatch():
    p = Precision("bf16-mixed", "cpu")
    assert "bf16" in p.describe()
    with pytest.raises(ValueError, match="precision='fp32'|precision=.fp32."):
        p.load_state_dict({"name": "fp32", "scaler": {}})


def test_mode_table_complete():
    assert set(modes.MODES) == {"fp32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-pure", "fp16-pure",
                                "fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "mxfp8"}


def test_fp16_state_needs_a_larger_adam_eps():
    """fp16-pure keeps Adam's moments in fp16: eps=1e-8 is raised to 1e-4 with one warning naming the fix; the Trainer builds it right."""
    from ampkit.train.trainer import build_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU
        pure = [Precision("fp16-pure", "cpu") for _ in range(3)]
    assert pure[0]._min_adam_eps == pytest.approx(1e-4)
    for name in ("fp32", "fp16-mixed", "fp16-master", "bf16-pure", "bf16-mixed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert Precision(name, "cpu")._min_adam_eps is None
    with pytest.warns(UserWarning, match=r"eps=1e-08 .* eps raised to 0.0001\. Build the optimizer with eps=0.0001.*optimizer_state='fp32'"):
        pure[0].setup(_net(), torch.optim.AdamW(_net().parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SGD has no eps, and eps=1e-4 is enough: no warning
        pure[1].setup(_net(), torch.optim.SGD(_net().parameters(), lr=1e-3))
        model = _net()
        opt = build_optimizer(model, "adamw", 1e-3, 0.01, torch.device("cpu"), eps=pure[2]._min_adam_eps)
        pure[2].setup(model, opt)
    assert {g["eps"] for g in opt.param_groups} == {1e-4}
    assert {g["eps"] for g in build_optimizer(_net(), "adam", 1e-3, 0.0, torch.device("cpu")).param_groups} == {1e-8}
