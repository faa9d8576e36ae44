"""``precision.export(model)``: a plain fp32 module with no ampkit in it, loadable and runnable where ampkit is not
importable; ``precision.fp32_view(model)``: fp32 weights (Kahan folded) that follow the model, for EMAs."""
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import ampkit

MODES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _trained(mode, steps=3, lr=1e-2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision(mode, "cpu")
        model = _model()
        model, opt = p.setup(model, torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-4))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        with p.autocast():
            loss = nn.functional.cross_entropy(model(p._convert_input(x)).float(), y)
        p.backward(loss)
        p.step(opt)
        opt.zero_grad()
    return p, model, opt


def test_export_loads_and_runs_where_ampkit_is_not_importable(tmp_path):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    torch.save(x, tmp_path / "x.pt")
    for mode in MODES:
        p, model, _ = _trained(mode)
        plain = p.export(model)
        assert all(t.dtype == torch.float32 for t in plain.state_dict().values()), mode
        for name, t in p.fp32_state_dict(model).items():
            assert torch.equal(plain.state_dict()[name], t), (mode, name)
        torch.save(plain, tmp_path / f"{mode}.pt")
        with torch.no_grad():
            torch.save(plain(x), tmp_path / f"{mode}.out.pt")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["ampkit"] = None  # any import of ampkit fails
        import torch
        x = torch.load("x.pt")
        for mode in {MODES!r}:
            m = torch.load(mode + ".pt", weights_only=False)
            with torch.no_grad():
                assert torch.equal(m(x), torch.load(mode + ".out.pt")), mode
        assert not [k for k in sys.modules if k.startswith("ampkit.")]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bf16_pure_export_folds_the_kahan_buffers():
    p, model, opt = _trained("bf16-pure", lr=1e-4)
    plain = p.export(model)
    w = model[0].weight
    comp = opt.state[w]["compensation"]
    assert comp.abs().sum() > 0
    assert torch.equal(plain[0].weight, w.float() + comp.float())


def test_fp32_view_follows_the_model_for_an_ema():
    p, model, opt = _trained("bf16-pure", steps=1, lr=1e-4)
    view = p.fp32_view(model)
    ema = torch.optim.swa_utils.AveragedModel(view.module,
                                              multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        with p.autocast():
            p.backward(nn.functional.cross_entropy(model(p._convert_input(x)).float(), y))
        p.step(opt)
        opt.zero_grad()
        ema.update_parameters(view.refresh())
    assert torch.equal(view.module[0].weight, p.fp32_state_dict(model)["0.weight"])
    assert all(q.dtype == torch.float32 for q in ema.parameters())



@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master"])
def test_master_models_compute_16_bit_only_inside_autocast(mode):
    p, model, _ = _trained(mode, steps=1)
    plain = p.export(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # outside precision.autocast(): the fp32 model it holds
        with p.autocast():
            inside = model(x)
        assert not torch.equal(inside, plain(x)) and inside.dtype == torch.float32
