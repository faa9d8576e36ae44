"""apex.optimizers / normalization / parallel on torch: FusedAdam's update matches apex's formula."""
import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit.compat.apex.normalization import FusedLayerNorm, FusedRMSNorm
from ampkit.compat.apex.optimizers import FP16_Optimizer, FusedAdam, FusedSGD
from ampkit.compat.apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3, generator=g).to(dtype)), nn.Parameter(torch.randn(7, generator=g).to(dtype))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _run(opt_factory, steps=5, dtype=torch.float32):
    params = _params(dtype)
    opt = opt_factory(params)
    for s in range(steps):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()
    return params


def _apex_reference(steps=5, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, wd=0.0, adam_w=True, bias_correction=True,
                    eps_inside_sqrt=False, dtype=torch.float32):
    """apex's multi_tensor_adam update written out per tensor, in fp64."""
    params = [p.detach().double() for p in _params(dtype)]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for s in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(s, _params(dtype)))):
            g = g.double()
            if not adam_w:
                g = g + wd * p
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            bc1 = 1 - betas[0] ** (s + 1) if bias_correction else 1.0
            bc2 = 1 - betas[1] ** (s + 1) if bias_correction else 1.0
            denom = (v[i] / bc2 + eps).sqrt() if eps_inside_sqrt else (v[i] / bc2).sqrt() + eps
            update = (m[i] / bc1) / denom + (wd * p if adam_w else 0)
            params[i] = p - lr * update
    return params


@pytest.mark.parametrize("adam_w", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_fused_adam_matches_apex_formula(adam_w, bias_correction):
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, adam_w_mode=adam_w, bias_correction=bias_correction)
    got = _run(lambda ps: FusedAdam(ps, **kw))
    ref = _apex_reference(wd=0.1, adam_w=adam_w, bias_correction=bias_correction)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-5, atol=1e-6)


def test_fused_adam_with_bias_correction_is_torch_adamw_and_adam():
    for adam_w, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        got = _run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w))
        ref = _run(lambda ps: torch_cls(ps, lr=1e-2, weight_decay=0.1))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)


def test_eps_inside_sqrt():
    got = _run(lambda ps: FusedAdam(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-3, eps_inside_sqrt=True))
    ref = _apex_reference(eps=1e-3, eps_inside_sqrt=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_keep_fp32_moments(dtype):
    params = _run(lambda ps: FusedAdam(ps, lr=1e-2, betas=(0.9, 0.99), bias_correction=False), steps=1, dtype=dtype)
    ref = _apex_reference(steps=1, bias_correction=False, dtype=dtype)
    for a, b in zip(params, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.to(dtype).double(), rtol=0, atol=torch.finfo(dtype).eps * 8)
    opt = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert {opt.state[p]["exp_avg"].dtype for p in params} == {torch.float32}


def test_max_grad_norm_clips_each_group_before_the_update():
    clipped = _params()
    for p, g in zip(clipped, _grads(0, clipped)):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(clipped, 0.5)
    ref = FusedAdam(clipped, lr=1e-2, bias_correction=False)
    ref.step()
    got = _params()
    for p, g in zip(got, _grads(0, got)):
        p.grad = g.clone()
    FusedAdam(got, lr=1e-2, bias_correction=False, max_grad_norm=0.5).step()
    for a, b in zip(got, clipped):
        torch.testing.assert_close(a, b)


def test_state_dict_round_trip_and_zero_grad():
    params = _params()
    opt = FusedAdam(params, lr=1e-2, bias_correction=False)
    for s in range(3):
        for p, g in zip(params, _grads(s, params)):
            p.grad = g
        opt.step()
    twin = [nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdam(twin, lr=1e-2, bias_correction=False)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint on disk would
    for o, ps in ((opt, params), (opt2, twin)):
        for p, g in zip(ps, _grads(3, ps)):
            p.grad = g
        o.step()
    for a, b in zip(params, twin):
        assert torch.equal(a, b)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_fused_adam_with_loss_scaler_and_fp16_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    scaler = ampkit.LossScaler("cpu", init_scale=1024.0)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
    assert scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight)
    wrapped = FP16_Optimizer(FusedAdam(nn.Linear(4, 2).half().parameters()), dynamic_loss_scale=True, verbose=False)
    assert isinstance(wrapped.optimizer, FusedAdam)


def test_refusals():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="master weights"):
        FusedAdam(_params(), master_weights=True)
    with pytest.raises(ValueError, match="Invalid beta1"):
        FusedAdam(_params(), betas=(1.0, 0.9))
    opt = FusedAdam(_params())
    with pytest.raises(RuntimeError, match="takes no grads"):
        opt.step(scale=128.0)
    with pytest.raises(ValueError, match="needs a learning rate"):
        FusedSGD(_params())
    with pytest.raises(ValueError, match="wd_after_momentum"):
        FusedSGD(_params(), lr=0.1, wd_after_momentum=True)


def test_fused_sgd_is_torch_sgd():
    got = _run(lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True))
    ref = _run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_normalization_layers_are_torch_layers():
    ln = FusedLayerNorm(8, eps=1e-12)
    assert isinstance(ln, nn.LayerNorm) and ln.eps == 1e-12
    ln.load_state_dict(nn.LayerNorm(8).state_dict())
    assert isinstance(FusedRMSNorm(8), nn.RMSNorm)


_PARALLEL_CHILD = r"""
import os, sys
import pytest, torch
import torch.distributed as dist
from torch import nn
from ampkit.compat.apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

net = convert_syncbn_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
assert isinstance(net[1], SyncBatchNorm)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
plain = nn.Linear(4, 2)
model = DistributedDataParallel(nn.Linear(4, 2), message_size=1000, allreduce_always_fp32=True)
model.module.load_state_dict(plain.state_dict())
x = torch.randn(8, 4)
model(x).sum().backward()
plain(x).sum().backward()
torch.testing.assert_close(model.module.weight.grad, plain.weight.grad)
with pytest.raises(ValueError, match="gradient_average=False"):
    DistributedDataParallel(nn.Linear(2, 2), gradient_average=False)
print("ok", flush=True)
os._exit(0)
"""


def test_parallel(tmp_path):
    """apex's DDP wrapper on a one-process gloo group. In a child process that exits without running the
    process group's destructor: torch's ProcessGroupGloo destructor, run when DDP's reducer is freed after
    ``destroy_process_group``, was seen to deadlock joining its worker threads (a hang in the suite)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _PARALLEL_CHILD, str(tmp_path / "pg")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
