"""AmpkitFabricPrecision as Fabric code uses it (litgpt's order): outputs and the loss after the forward in
fp32, Fabric's clip_gradients, and resume through Fabric's own fabric.save / fabric.load, bitwise, one process."""
import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from ampkit.integrations.lightning import PRECISION_KEY, AmpkitFabricPrecision  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :3].sum(1) > 0).long()


def _fabric(mode, **kwargs):
    return L.Fabric(accelerator="cpu", devices=1, plugins=AmpkitFabricPrecision(mode, "cpu", **kwargs))


def _setup(fabric, seed=0, scheduler=False):
    model = _net(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    if scheduler:  # built on the optimizer Fabric returned, as litgpt does
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7 ** s)
    return model, optimizer


def _train(fabric, model, optimizer, steps, clip=None, scheduler=None):
    for step in steps:
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y)  # computed after the forward, as Fabric code does
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return loss


@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed", "fp16-master", "bf16-true"])
def test_outputs_and_loss_are_fp32(mode):
    """As Lightning's own plugins: outputs in fp32, so the loss after the forward is fp32; in 16-mixed its
    scaled seed gradient no longer overflows on step 1, and Fabric's clip_gradients (which raises on a
    non-finite norm) works."""
    fabric = _fabric(mode)
    model, optimizer = _setup(fabric)
    out = model(_batch(0)[0])
    assert out.dtype == torch.float32
    loss = _train(fabric, model, optimizer, range(3), clip=1.0)
    plugin = fabric.strategy.precision
    assert loss.dtype == torch.float32 and plugin.skipped_steps == 0 and plugin.optimizer_steps == 3


def test_bf16_mixed_is_bitwise_lightnings_own():
    ours, theirs = _fabric("bf16-mixed"), L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    (m1, o1), (m2, o2) = _setup(ours), _setup(theirs)
    _train(ours, m1, o1, range(4), clip=1.0)
    _train(theirs, m2, o2, range(4), clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


RESUME = [("32-true", {}), ("16-mixed", {"init_scale": 2.0**20, "growth_interval": 2}), ("bf16-mixed", {}),
          ("bf16-true", {}), ("bf16-true", {"compensation": "stochastic"}), ("fp16-master", {}), ("bf16-master", {}),
          ("fp8-delayed", {"fp8_filter": "ends"})]  # fp8: the first/last rule (auto converts none of these)


@pytest.mark.parametrize("mode,kwargs", RESUME, ids=[m + "-" + "-".join(map(str, k.values())) for m, k in RESUME])
def test_fabric_save_load_resumes_bitwise(tmp_path, mode, kwargs):
    """fabric.save({"model", "optimizer"}) mid-run, then a fresh Fabric, model (another init) and optimizer,
    fabric.load, and the rest of the run: equal to the uninterrupted run (weights, optimizer state, scale)."""
    whole = _fabric(mode, **kwargs)
    m, o, s = _setup(whole, scheduler=True)
    _train(whole, m, o, range(6), scheduler=s)
    expected = whole.strategy.precision.fp32_state_dict(m)

    first = _fabric(mode, **kwargs)
    m1, o1, s1 = _setup(first, scheduler=True)
    _train(first, m1, o1, range(3), scheduler=s1)
    first.save(tmp_path / "ckpt.pt", {"model": m1, "optimizer": o1, "scheduler": s1})

    again = _fabric(mode, **kwargs)
    m2, o2, s2 = _setup(again, seed=1, scheduler=True)
    again.load(tmp_path / "ckpt.pt", {"model": m2, "optimizer": o2, "scheduler": s2})
    _train(again, m2, o2, range(3, 6), scheduler=s2)
    stepped = again.strategy.precision.prepare_optimizer(o2.optimizer)
    assert [g["lr"] for g in stepped.param_groups] == [1e-2 * 0.7 ** 6]  # the schedule reached the steps
    got = again.strategy.precision.fp32_state_dict(m2)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), [k for k in expected if not torch.equal(expected[k], got[k])]
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    assert whole.strategy.precision.ampkit.scaler.state_dict() == again.strategy.precision.ampkit.scaler.state_dict()


def test_bf16_pure_checkpoint_holds_the_optimizer_state(tmp_path):
    """The optimizer Fabric saves is the user's AdamW; its state_dict is the compensated optimizer's that steps:
    moments, step counts and Kahan buffers, plus the precision's own state."""
    fabric = _fabric("bf16-true")
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, range(2))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)["optimizer"]
    state = saved["state"]
    assert len(state) == len(list(model.parameters()))
    weight = state[0]
    assert {"exp_avg", "exp_avg_sq", "compensation"} <= weight.keys() and float(weight["step"]) == 2.0
    assert saved[PRECISION_KEY]["name"] == "bf16-pure"


def test_loss_scale_travels_in_the_optimizer_state(tmp_path):
    fabric = _fabric("16-mixed", init_scale=2.0**20, growth_interval=1)
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, range(3))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    scale = fabric.strategy.precision.loss_scale
    again = _fabric("16-mixed", init_scale=2.0**20, growth_interval=1)
    m2, o2 = _setup(again)
    again.load(tmp_path / "ckpt.pt", {"model": m2, "optimizer": o2})
    assert again.strategy.precision.loss_scale == scale != 2.0**20


def test_fp32_state_dict_needs_no_extra_argument():
    """The export finds the masters (and Kahan buffers) of the optimizer Fabric set up, from the plugin or from
    its ampkit precision, with the model Fabric returned or the user's own."""
    fabric = _fabric("bf16-master")
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, range(2))
    plugin = fabric.strategy.precision
    updated = plugin.prepare_optimizer(optimizer.optimizer).param_groups[0]["params"][0]  # the fp32 truth of 0.weight
    assert updated.dtype == torch.float32
    for sd in (plugin.fp32_state_dict(model), plugin.ampkit.fp32_state_dict(model.module)):
        assert sd["0.weight"].dtype == torch.float32 and torch.equal(sd["0.weight"], updated)
        if model.module[0].weight.dtype != torch.float32:  # the masters, not the 16-bit weights' casts
            assert not torch.equal(sd["0.weight"], model.module[0].weight.float())

