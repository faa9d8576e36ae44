"""apex.fp16_utils on ampkit: FP16_Optimizer scripts run with only the import changed; helpers match apex."""
import copy

import pytest
import torch
from torch import nn

from ampkit.compat.apex.fp16_utils import (
    BN_convert_float,
    FP16_Optimizer,
    FP16Model,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    tofp16,
)

# A BERT-era FP16_Optimizer script as written for apex (device-agnostic, tiny).
APEX_SCRIPT = """
import torch
from torch import nn
from apex.fp16_utils import FP16_Optimizer

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(device).half()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if LOSS_SCALE == 0:
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)
else:
    optimizer = FP16_Optimizer(optimizer, static_loss_scale=LOSS_SCALE, verbose=False)

x = torch.randn(128, 16, device=device)
y = x[:, :4].argmax(1)
losses = []
for step in range(30):
    loss = nn.functional.cross_entropy(model(x.half()).float(), y)
    optimizer.zero_grad()
    optimizer.backward(loss)
    optimizer.clip_master_grads(5.0)
    optimizer.step()
    losses.append(loss.item())
"""


@pytest.mark.parametrize("loss_scale", [0, 128.0])
def test_fp16_optimizer_script_runs_with_only_the_import_changed(loss_scale):
    old, new = "from apex.fp16_utils import FP16_Optimizer", "from ampkit.compat.apex.fp16_utils import FP16_Optimizer"
    ported = APEX_SCRIPT.replace(old, new)
    changed = [(a, b) for a, b in zip(APEX_SCRIPT.splitlines(), ported.splitlines()) if a != b]
    assert changed == [(old, new)]
    ns = {"LOSS_SCALE": loss_scale}
    exec(compile(ported, "<apex FP16_Optimizer script>", "exec"), ns)
    losses = ns["losses"]
    assert losses[-1] < 0.6 * losses[0], losses


def _half_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _loss(model, seed=0, scale=1.0):
    x, y = _batch(seed)
    return nn.functional.cross_entropy(model(x.half()).float(), y) * scale


def test_defaults_follow_apex():
    model = _half_net()
    static = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert not static.dynamic_loss_scale and static.loss_scale == 1.0 and not static.scaler.is_dynamic
    model = _half_net()
    dyn = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    assert dyn.loss_scale == 2.0**32
    assert dyn.scaler.get_growth_interval() == 1000 and dyn.scaler.get_growth_factor() == 2.0
    model = _half_net()
    tuned = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                           dynamic_loss_args={"init_scale": 1024, "scale_window": 10, "scale_factor": 4.0})
    assert tuned.loss_scale == 1024 and tuned.scaler.get_growth_interval() == 10
    assert tuned.scaler.get_backoff_factor() == 0.25


def test_masters_are_fp32_copies_in_the_param_groups():
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    assert [m.shape for m in masters] == [p.shape for p in model.parameters()]
    assert opt.fp16_groups[0][0] is model[0].weight and opt.fp32_from_fp16_groups[0][0] is masters[0]
    assert opt.fp32_from_fp32_groups == [[]]


def test_step_updates_masters_then_model():
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt.backward(_loss(model))
    opt.step()
    x, y = _batch()
    nn.functional.cross_entropy(ref(x.half().float()), y).backward()
    masters = [p for g in opt.param_groups for p in g["params"]]
    for m, r, p in zip(masters, ref.parameters(), model.parameters()):
        expected = r.detach() - 0.1 * r.grad
        torch.testing.assert_close(m, expected, rtol=0, atol=2e-3)
        assert torch.equal(p, m.half())  # the model holds the rounded masters


def test_overflow_skips_and_halves_never_below_one(capsys):
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0})
    before = [p.detach().clone() for p in model.parameters()]
    for expected in (1.0, 1.0):
        opt.zero_grad()
        opt.backward(_loss(model, scale=float("inf")))
        opt.step()
        assert opt.overflow and opt.loss_scale == expected
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "OVERFLOW! Skipping step. Attempted loss scale: 2, reducing to 1" in capsys.readouterr().out
    opt.zero_grad()
    opt.backward(_loss(model))
    opt.step()
    assert not opt.overflow and not torch.equal(before[0], model[0].weight)


def test_clip_master_grads_returns_the_norm_and_clips():
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
    opt.backward(_loss(model))
    norm = opt.clip_master_grads(1e-3)
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    assert norm.item() > 1e-3
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item() == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(RuntimeError, match="after update_master_grads"):
        opt.backward(_loss(model))


def test_several_backward_calls_accumulate():
    def grads(seeds):
        model = _half_net()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
        for s in seeds:
            opt.backward(_loss(model, s), update_master_grads=False)
        opt.update_master_grads()
        return [g.clone() for group in opt.inspect_master_grad_data() for g in group]

    for g, a, b in zip(grads([0, 1]), grads([0]), grads([1])):
        torch.testing.assert_close(g, a + b, rtol=1e-2, atol=1e-3)


def test_state_dict_round_trip():
    def train(model, opt, steps, start=0):
        for s in range(start, start + steps):
            opt.zero_grad()
            opt.backward(_loss(model, s))
            opt.step()

    def build():
        model = _half_net()
        return model, FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                     dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 2}, verbose=False)

    model, opt = build()
    initial = model[0].weight.detach().clone()
    train(model, opt, 4)
    assert not torch.equal(initial, model[0].weight)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["fp32_from_fp16"][0][0].dtype == torch.float32
    model2, opt2 = build()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.loss_scale == opt.loss_scale and opt2.scaler.skipped_steps == opt.scaler.skipped_steps
    train(model, opt, 3, start=4)
    train(model2, opt2, 3, start=4)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    other = FP16_Optimizer(torch.optim.Adam(nn.Linear(3, 3).half().parameters()), verbose=False)
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(saved_opt)


def test_misuse_is_refused():
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match="does not take a closure"):
        opt.step(lambda: 0)
    with pytest.raises(ValueError, match="wrap the bare optimizer once"):
        FP16_Optimizer(opt)
    with pytest.raises(ValueError, match="static_loss_scale must be a positive"):
        FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), static_loss_scale=0)
    with pytest.raises(TypeError, match="unknown key"):
        FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"scale_windw": 10})
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).double().parameters(), lr=0.1))
    stateful = torch.optim.SGD(_half_net().parameters(), lr=0.1, momentum=0.9)
    stateful.state[stateful.param_groups[0]["params"][0]] = {"momentum_buffer": None}
    with pytest.raises(ValueError, match="wrap a fresh optimizer"):
        FP16_Optimizer(stateful)
    opt.loss_scale = 256
    assert opt.loss_scale == 256


def test_network_to_half_keeps_affine_batchnorm_fp32():
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.BatchNorm1d(16, affine=False), nn.Linear(16, 2))
    half = network_to_half(net)
    assert isinstance(half[0], tofp16)
    assert net[0].weight.dtype == torch.float16 and net[1].weight.dtype == torch.float32
    assert net[1].running_mean.dtype == torch.float32 and net[2].running_mean.dtype == torch.float16
    assert half(torch.randn(4, 8)).dtype == torch.float16
    bn = BN_convert_float(nn.BatchNorm2d(3).half())
    assert bn.weight.dtype == torch.float32
    wrapped = FP16Model(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
    assert wrapped(torch.randn(4, 8)).dtype == torch.float16


@pytest.mark.parametrize("flat", [False, True])
def test_manual_master_weight_loop(flat):
    model = _half_net()
    model_params, master_params = prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 for m in master_params) and len(master_params) == (1 if flat else 4)
    opt = torch.optim.SGD(master_params, lr=0.5)
    first = None
    for step in range(15):
        loss = _loss(model)
        first = first if first is not None else loss.item()
        model.zero_grad()
        (loss * 128.0).backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat)
        for m in master_params:
            m.grad.div_(128.0)
        opt.step()
        master_params_to_model_params(model_params, master_params, flat_master=flat)
    assert _loss(model).item() < 0.8 * first
    mixed = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="flat_master=False"):
        prep_param_lists(mixed, flat_master=True)
