"""Continuing a checkpoint in another precision mode (`ampkit.train.change`), and what the Trainer says when
it builds the precision."""
import pytest
import torch

from ampkit.train.change import carry_over, check_precision_change
from ampkit.train.checkpoint import CheckpointError
from ampkit.train.config import TrainConfig
from ampkit import Precision


def _bf16_pure_checkpoint():
    """What a bf16-pure run's checkpoint holds for a Linear(3, 2): bf16 weights, bf16 moments, Kahan buffers."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2, 3, generator=g), torch.randn(2, generator=g)
    comp_w, comp_b = torch.randn(2, 3, generator=g) * 1e-3, torch.randn(2, generator=g) * 1e-3
    state = {i: {"step": torch.tensor(7.0), "exp_avg": torch.full_like(t, 0.5).bfloat16(),
                 "exp_avg_sq": torch.full_like(t, 0.25).bfloat16(), "compensation": c.bfloat16()}
             for i, (t, c) in enumerate([(w, comp_w), (b, comp_b)])}
    return {"model": {"weight": w.bfloat16(), "bias": b.bfloat16()},
            "optimizer": {"state": state, "param_groups": [{"params": [0, 1], "lr": 0.125, "initial_lr": 0.5,
                                                            "compensation": "kahan", "weight_decay": 0.0}]}}


@pytest.mark.parametrize("how", ["convert", "reset"])
def test_bf16_pure_into_fp32_folds_the_compensation(how):
    ck = _bf16_pure_checkpoint()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    carry_over(model, opt, ck, how)
    comp = ck["optimizer"]["state"][0]["compensation"]
    assert torch.equal(model.weight.detach(), ck["model"]["weight"].float() + comp.float())
    assert opt.param_groups[0]["lr"] == 0.125 and opt.param_groups[0]["initial_lr"] == 0.5
    assert "compensation" not in opt.param_groups[0]  # this run's groups, not the old mode's
    state = opt.state[model.weight]
    if how == "reset":
        assert not state
    else:
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # the Kahan buffer stays with its mode
        assert state["exp_avg"].dtype == torch.float32 and torch.all(state["exp_avg"] == 0.5)
        assert float(state["step"]) == 7.0


def _ck(name, optimizer_state=None):
    return {"precision": {"name": name, "scaler": {}, "optimizer_state": optimizer_state}}


def test_a_change_is_refused_unless_allowed_and_supported():
    cfg = TrainConfig()
    with pytest.raises(CheckpointError, match="--allow-precision-change"):
        check_precision_change(_ck("fp32"), "bf16-mixed", None, cfg, "c.pt", fsdp=False)
    allow = cfg.updated(allow_precision_change=True)
    assert check_precision_change(_ck("fp32"), "bf16-mixed", None, allow, "c.pt", False) == (
        "fp32", "bf16-mixed")
    assert check_precision_change(_ck("fp32"), "fp32", None, cfg, "c.pt", False) is None
    assert check_precision_change(_ck("fp32"), "auto", None, cfg, "c.pt", False) is None  # keeps it
    with pytest.raises(CheckpointError, match="does not convert an fp8 mode"):
        check_precision_change(_ck("fp8-delayed"), "bf16-mixed", None, allow, "c.pt", False)
    with pytest.raises(CheckpointError, match="--precision-change-optimizer reset"):
        check_precision_change(_ck("fp32", "bf16"), "fp32", None, allow, "c.pt", False)
    reset = allow.updated(precision_change_optimizer="reset")
    assert check_precision_change(_ck("fp32", "bf16"), "fp32", None, reset, "c.pt", False) == (
        "fp32", "fp32")


def test_precision_load_state_dict_names_no_cli_flag():
    p = Precision("fp16-mixed", "cpu")
    with pytest.raises(ValueError) as e:
        p.load_state_dict(Precision("fp32", "cpu").state_dict())
    assert "Precision('fp32')" in str(e.value) and "--" not in str(e.value)
    with pytest.raises(ValueError, match="unknown key"):
        p.load_state_dict({"foo": 1})


def test_the_mode_asked_for_is_known_before_the_precision_is_built():
    from ampkit.train.change import requested

    assert requested(None, TrainConfig(precision="bf16")) == ("bf16-mixed", None)
    assert requested("O2", TrainConfig(optimizer_state="bf16")) == ("fp16-master", "bf16")
    assert requested(None, TrainConfig()) == ("auto", None)



def test_a_modes_warning_at_trainer_construction_points_at_the_callers_line(monkeypatch):
    """What the precision says when built (e.g. 'likely slower than fp32' on some CPUs) is attributed to the line
    that built the Trainer, not to ampkit's own code."""
    import warnings

    from ampkit.train import Trainer, setup

    real = setup._dist.run_device

    def warning_device(*a, **k):  # a warning raised while the precision is built, from inside ampkit
        warnings.warn("this mode is likely slower than fp32 here", UserWarning)
        return real(*a, **k)

    monkeypatch.setattr(setup._dist, "run_device", warning_device)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(torch.nn.Linear(4, 2), ds, precision="fp32", epochs=1, progress=False, autotune=False)
    slow = [w for w in caught if "likely slower" in str(w.message)]
    assert len(slow) == 1 and slow[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
