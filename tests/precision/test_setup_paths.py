"""One set-up path: ``setup(model, optimizer)`` is exactly ``convert_module(model)`` then
``wrap_optimizer(optimizer)`` (what Lightning, Fabric, the Trainer's FSDP path and apex compat call). Every
mode, and every option that acts while setting up (``optimizer_state``, ``compensation``, the Adam ``eps``
rule, fp32 norms and ``fp32_modules``, fp8 recipes and layer choices), has the same effect through both:
the same optimizer class and state dtypes, the same parameter dtypes and ``eps``, the same precision state,
and bitwise the same weights after a few steps."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import MODES
from ampkit.precision.fp8 import DelayedScaling

STEPS = 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.mid, self.out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.norm(self.inp(x)))))


def _has_torchao_optim():
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return False
    return True


#: (mode, options): every mode with its defaults, then each option that acts in setup where it applies
CASES = [(mode, {}) for mode in MODES] + [
    *[(mode, {"optimizer_state": "bf16"}) for mode in ("fp32", "fp16-mixed", "bf16-mixed", "bf16-master",
                                                        "fp16-master", "bf16-pure", "fp16-pure", "fp8-rowwise")],
    ("fp16-pure", {"optimizer_state": "fp32"}),
    ("bf16-master", {"optimizer_state": "8bit"}),  # torchao's 8-bit optimizers compile their step: two cases only
    ("bf16-pure", {"optimizer_state": "8bit", "compensation": "stochastic"}),
    *[("bf16-pure", {"compensation": c}) for c in ("kahan", "stochastic", "none")],
    ("bf16-pure", {"keep_norm_fp32": False}), ("bf16-master", {"keep_norm_fp32": False}),
    ("fp16-pure", {"fp32_modules": ["mid"]}), ("bf16-master", {"fp32_modules": ["mid"]}),
    ("fp8-delayed", {"fp8_recipe": DelayedScaling(amax_history_len=4, margin=1), "fp8_force": ["inp", "out"]}),
    ("fp8-rowwise", {"fp8_skip": ["mid"], "fp8_force": ["inp"]}),
    ("fp8-tensorwise", {"fp8_filter": "all"}),
]


def _run(mode, options, halves, eps):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated 16-bit / fp8 on this CPU, eps raised: not the point here
        prec = ampkit.Precision(mode, "cpu", **({"init_scale": 1024.0} if MODES[mode].scaled else {}), **options)
        torch.manual_seed(0)
        model = _Net()
        if halves:
            model = prec.convert_module(model)
            opt = prec.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
        else:
            model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
        for _ in range(STEPS):
            with prec.autocast():
                loss = nn.functional.mse_loss(model(prec._convert_input(x)).float(), y)
            prec.backward(loss)
            prec.step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)
    inner = getattr(opt, "optimizer", opt)
    return {
        "optimizer": (type(opt), type(inner)),
        "state": sorted((k, str(v.dtype)) for st in inner.state.values() for k, v in st.items()
                        if torch.is_tensor(v) and v.numel() > 1),
        "eps": [g_.get("eps") for g_ in inner.param_groups],
        "params": {n: p.dtype for n, p in model.named_parameters()},
        "modules": sorted(type(m).__name__ for m in model.modules()),
        "precision": prec.state_dict(), "describe": prec.describe(), "kept": prec.kept_fp32,
        "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
    }


@pytest.mark.parametrize("mode, options", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'defaults'}"
                                                      for m, o in CASES])
def test_every_option_has_the_same_effect_through_setup_and_the_two_halves(mode, options):
    if options.get("optimizer_state") == "8bit" and not _has_torchao_optim():
        pytest.skip("torchao.optim is not installed")
    eps = 1e-8  # the fp16-state modes raise it to their minimum, through either path
    one, two = _run(mode, options, False, eps), _run(mode, options, True, eps)
    for key in ("optimizer", "state", "eps", "params", "modules", "precision", "describe", "kept"):
        assert one[key] == two[key], (key, one[key], two[key])
    assert one["weights"].keys() == two["weights"].keys()
    assert all(torch.equal(one["weights"][k], two["weights"][k]) for k in one["weights"])


def test_the_options_show_through_either_path():
    """The cases above compare like with like; here, that the options they pass do act (so the comparison
    is not between two runs that ignored them)."""
    state = _run("bf16-master", {"optimizer_state": "bf16"}, True, 1e-8)["state"]
    assert state and all(d == "torch.bfloat16" for k, d in state if k.startswith("exp_avg"))
    assert _run("fp16-pure", {}, True, 1e-8)["eps"] == [ampkit.precision.kinds.pure.FP16_STATE_MIN_EPS]
    pure = _run("bf16-pure", {"keep_norm_fp32": False}, True, 1e-8)
    assert pure["params"]["norm.weight"] == torch.bfloat16
    assert _run("bf16-pure", {}, True, 1e-8)["params"]["norm.weight"] == torch.float32
    assert _run("fp16-pure", {"fp32_modules": ["mid"]}, True, 1e-8)["params"]["mid.weight"] == torch.float32
    assert _run("bf16-pure", {"compensation": "stochastic"}, True, 1e-8)["optimizer"][0].__module__.startswith("ampkit.optim")
    fp8 = _run("fp8-rowwise", {"fp8_skip": ["mid"], "fp8_force": ["inp"]}, True, 1e-8)
    assert fp8["modules"] != _run("bf16-mixed", {}, True, 1e-8)["modules"]  # Linears swapped for fp8 ones
