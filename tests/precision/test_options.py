"""``PrecisionOptions`` (ampkit/precision/options.py): built once from ``Precision``'s flat keywords into groups
by owner (scaler, model, optimizer, fp8), the loss scale parsed once, ``compensation`` normalised once, each
option's range checked with a one-line error; a mode refuses the options it does not use in their owner's
words; ``_retuned``/``with_options`` rebuild from the object."""
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import loss_scale as loss_scale_module
from ampkit.precision import options as options_module
from ampkit.precision.scaling import loss_scaler as scaler_module
from ampkit.precision.options import Fp8Config, OptimizerOptions, PrecisionOptions, ScalerOptions


def _quiet(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16/bf16 on a CPU without the units: a warning, not the point here
        return ampkit.Precision(*args, **kwargs)


def test_the_loss_scale_is_parsed_once_per_precision(monkeypatch):
    """Precision(loss_scale=...) parsed the value, then LossScaler parsed the result again: once now."""
    seen = []

    def counting(value):
        if value is not None:
            seen.append(value)
        return loss_scale_module.parse_loss_scale(value)

    monkeypatch.setattr(options_module, "parse_loss_scale", counting)
    monkeypatch.setattr(scaler_module, "parse_loss_scale", counting)
    p = _quiet("fp16-mixed", "cpu", loss_scale="128")
    assert seen == ["128"]
    assert p.scaler.static_scale == 128.0 and not p.scaler.is_dynamic and p.settings.scaling.static_scale == 128.0
    assert p.options()["loss_scale"] == "128"  # handed back as given: a rebuild parses it the same way
    seen.clear()
    assert _quiet("fp16-mixed", "cpu", loss_scale="dynamic").scaler.is_dynamic and seen == ["dynamic"]


def test_compensation_is_normalised_once_none_is_plain_rounding():
    o = OptimizerOptions(compensation="NONE")
    assert o.compensation == "none" and o.plain_rounding and o.optim_compensation is None
    assert OptimizerOptions(compensation="Kahan").optim_compensation == "kahan"
    assert OptimizerOptions().compensation is None and not OptimizerOptions().plain_rounding  # not given
    p = _quiet("bf16-pure", "cpu", compensation="None")
    assert p.compensation == "none" and "no compensation (plain bf16 rounding)" in p.describe()
    model = nn.Linear(4, 4)
    _, opt = p.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert opt.defaults["compensation"] is None  # ampkit.optim spells plain rounding None


@pytest.mark.parametrize("kwargs, match", [
    ({"growth_interval": 0}, "growth_interval must be a positive integer"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive integer"),
    ({"hysteresis": 0}, "hysteresis must be >= 1"),
    ({"max_consecutive_skips": 0}, "max_consecutive_skips must be a positive integer or None"),
    ({"init_scale": float("inf")}, "init_scale must be a positive finite number"),
    ({"min_scale": 8.0, "max_scale": 2.0}, r"min_scale \(8.0\) must not exceed max_scale \(2.0\)"),
    ({"max_scale": -1.0}, "max_scale must be a positive finite number"),
    ({"loss_scale": "lots"}, "loss scale 'lots' is not valid: use 'dynamic' or 0"),
    ({"compensation": "fancy"}, "compensation='fancy' is not supported: use 'kahan', 'stochastic' or 'none'"),
    ({"fp32_modules": "head"}, r"fp32_modules='head' must be a list of module names: use fp32_modules=\['head'\]"),
    ({"optimizer_state": "fp64"}, "optimizer_state"),
])
def test_each_option_is_range_checked_with_one_line_naming_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        _quiet("fp16-mixed", "cpu", **kwargs)
    assert "\n" not in str(err.value)


def test_an_unknown_keyword_names_the_options():
    with pytest.raises(TypeError, match="Precision\\(\\) got an unexpected keyword argument 'loss_scaling'.*loss_scale"):
        ampkit.Precision("fp32", "cpu", loss_scaling=128)


def test_each_kind_owns_its_options():
    """Options only one kind takes are refused elsewhere, with the owner's fix; the owner checks them."""
    with pytest.raises(ValueError, match="compensation='kahan' applies to precision='bf16-pure' only \\(got 'fp16-pure'\\)"):
        _quiet("fp16-pure", "cpu", compensation="kahan")
    with pytest.raises(ValueError, match="compensation='stochastic' applies to precision='bf16-pure' only \\(got 'fp32'\\)"):
        _quiet("fp32", "cpu", compensation="stochastic")  # refused by fp32, in the owner's (bf16-pure's) words
    with pytest.raises(ValueError, match="fp8_recipe/fp8_skip/fp8_force apply to the fp8 modes only \\(got 'bf16-mixed'\\)"):
        _quiet("bf16-mixed", "cpu", fp8_skip=["head"])
    with pytest.raises(ValueError, match="precision='bf16-mixed' does not use loss scaling, found loss scale 0"):
        _quiet("bf16-mixed", "cpu", loss_scale=0)  # "dynamic" given is still given
    with pytest.raises(ValueError, match="optimizer_state='8bit' is torchao's AdamW8bit"):
        _quiet("bf16-pure", "cpu", compensation="kahan", optimizer_state="8bit")
    assert _quiet("fp8-rowwise", "cpu", fp8_skip=["head"]).fp8.filter.skip == ("head",)


def test_retuned_and_with_options_rebuild_from_the_options_object():
    p = _quiet("fp16-mixed", "cpu", loss_scale=64, growth_interval=50, fp32_modules=["0"])
    again = p._retuned(ampkit.precision.Tuned(channels_last=False))
    assert again.settings is p.settings and again.channels_last is False and p.channels_last is None
    assert again.scaler is not p.scaler and again.scaler.static_scale == 64.0
    other = p.with_options(loss_scale=None, hysteresis=2)
    assert other.settings == dataclasses.replace(
        p.settings, scaling=dataclasses.replace(p.settings.scaling, loss_scale=None, hysteresis=2))
    assert other.scaler.is_dynamic and other.fp32_modules == ("0",) and p.scaler.static_scale == 64.0
    with pytest.raises(ValueError, match="hysteresis must be >= 1"):
        p.with_options(hysteresis=0)  # checked again
    assert ampkit.Precision(p.requested, **p.options()).settings == p.settings  # options() rebuilds the same


def test_the_flat_keywords_land_in_their_owners_group_and_come_back_flat():
    o = PrecisionOptions.from_kwargs(init_scale=1024.0, fp32_modules=["head"], optimizer_state="bf16",
                                     compensation="stochastic", fp8_skip=["lm_head"], fp8_tokens=4096)
    assert o.scaling == ScalerOptions(init_scale=1024.0)
    assert o.model.fp32_modules == ("head",) and o.optimizer == OptimizerOptions("bf16", "stochastic")
    assert o.fp8 == Fp8Config(skip=("lm_head",), tokens=4096) and o.fp8.given() and not Fp8Config().given()
    assert PrecisionOptions.from_kwargs(**o.kwargs()) == o  # every keyword handed back, flat
    assert set(o.kwargs()) >= {"loss_scale", "fp8_recipe", "fp8_filter", "fused_optimizer", "op_policy", "strategy"}
    with pytest.raises(ValueError, match=r"fp8_skip='head' must be a list of module names: use fp8_skip=\['head'\]"):
        PrecisionOptions.from_kwargs(fp8_skip="head")


def test_strategy_is_given_at_construction():
    """What a strategy needs is part of the object as built: FSDP contiguous parameters (channels_last off,
    asked for: an error), DDP a scaler without its own found-inf collective; a strategy it does not know, refused."""
    p = _quiet("bf16-mixed", "cpu", strategy="fsdp", tuned=ampkit.precision.Tuned(channels_last=True))
    assert p.channels_last is False and p.strategy == "fsdp"
    assert p._prepare_fsdp() is not None and p.channels_last is False  # the old call: nothing left to change
    with pytest.raises(ValueError, match="channels_last=True cannot be used with strategy 'fsdp'"):
        _quiet("bf16-mixed", "cpu", strategy="fsdp", channels_last=True)
    assert _quiet("fp16-mixed", "cpu", strategy="ddp").scaler.distributed is False
    assert _quiet("bf16-mixed", "cpu", strategy="ddp").scaler.distributed is False  # the check-only guard too
    assert _quiet("fp16-mixed", "cpu").scaler.distributed is None  # one process: follows the process group
    with pytest.raises(ValueError, match="strategy='deepspeed' is not supported: use 'ddp', 'fsdp' or None"):
        _quiet("fp32", "cpu", strategy="deepspeed")
    q = _quiet("bf16-mixed", "cpu")
    q._prepare_fsdp()  # built without strategy: the old call still turns channels_last off
    assert q.channels_last is False


def test_every_keyword_of_the_flat_signature_still_builds():
    """The grouped options take the same flat keywords ``Precision(...)`` always took, each to its group."""
    flat = {"loss_scale": 0, "init_scale": 256.0, "growth_interval": 10, "min_scale": 1.0, "max_scale": 2.0**20,
            "hysteresis": 2, "max_consecutive_skips": 5, "fp32_modules": ["0"], "keep_norm_fp32": True,
            "cast_outputs": False, "nonfinite": "skip", "channels_last": False, "op_policy": False,
            "optimizer_state": "fp32", "fused_optimizer": False}
    p = _quiet("fp16-master", "cpu", **flat)
    assert {k: p.options()[k] for k in flat} == {**flat, "fp32_modules": ("0",)}
    assert p.scaler.get_scale() == 256.0 and p.cast_outputs is False and p.settings.model.channels_last is False
    fp8 = {"fp8_recipe": None, "fp8_skip": ["a"], "fp8_force": ["b"], "fp8_filter": "all", "fp8_gpu": "h100",
           "fp8_tokens": 2048}
    assert _quiet("fp8-rowwise", "cpu", **fp8).settings.fp8 == Fp8Config(None, ("a",), ("b",), "all", "h100", 2048)
    assert _quiet("bf16-pure", "cpu", compensation="kahan", scaler=None).compensation == "kahan"


@pytest.mark.parametrize("kwargs", [{"growth_interval": 0}, {"hysteresis": 0}, {"max_consecutive_skips": 0},
                                    {"init_scale": 0.0}, {"min_scale": 4.0, "max_scale": 2.0}, {"max_scale": -1.0}])
def test_a_loss_scaler_built_directly_words_its_ranges_as_precision_does(kwargs):
    """One range check (``loss_scale.check_scaler_ranges``) behind ``Precision(...)`` and ``LossScaler(...)``."""
    with pytest.raises(ValueError) as via_precision:
        _quiet("fp16-mixed", "cpu", **kwargs)
    with pytest.raises(ValueError) as direct:
        scaler_module.LossScaler("cpu", **kwargs)
    assert str(via_precision.value) == str(direct.value)
