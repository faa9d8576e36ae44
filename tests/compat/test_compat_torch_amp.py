"""The deprecated torch.cuda.amp spellings, device-agnostic."""
import torch

import ampkit
from ampkit.compat.torch_amp import GradScaler, autocast, custom_bwd, custom_fwd, default_device

SCRIPT = """
import torch
from torch import nn
from torch.cuda.amp import autocast, GradScaler

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = GradScaler()
x = torch.randn(64, 16).to(device)
y = x[:, :4].argmax(1)
losses = []
for _ in range(20):
    optimizer.zero_grad()
    with autocast():
        inner = model[0](x).dtype
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    losses.append(loss.item())
"""


def test_old_tutorial_script_runs_with_only_the_import_changed():
    old, new = "from torch.cuda.amp import autocast, GradScaler", "from ampkit.compat.torch_amp import autocast, GradScaler"
    ns = {}
    exec(compile(SCRIPT.replace(old, new), "<torch.cuda.amp script>", "exec"), ns)
    assert ns["inner"] in (torch.float16, torch.bfloat16)  # autocast really ran
    assert ns["scaler"].is_enabled() and isinstance(ns["scaler"], ampkit.LossScaler)
    assert ns["losses"][-1] < 0.8 * ns["losses"][0]


def test_defaults_per_device():
    ctx = autocast()
    assert ctx.device == default_device()
    assert ctx.fast_dtype == (torch.float16 if default_device() == "cuda" else torch.bfloat16)
    assert autocast(dtype=torch.float16, device_type="cpu").fast_dtype == torch.float16
    assert not autocast(enabled=False)._enabled
    s = GradScaler(init_scale=1024.0, growth_interval=10)
    assert s.get_scale() == 1024.0 and s.get_growth_interval() == 10


def test_custom_fwd_bwd():
    class Square(torch.autograd.Function):
        @staticmethod
        @custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @custom_bwd
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.ones(3, device=default_device(), requires_grad=True)  # custom_fwd casts tensors of its device
    with autocast():
        y = Square.apply(x.to(autocast().fast_dtype))
    assert y.dtype == torch.float32
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0, device=x.device))
