"""ampkit's Lightning plugins with the real `lightning` package: Fabric and Trainer, CPU, tiny model."""
import math
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from ampkit.integrations.lightning import AmpkitFabricPrecision, AmpkitPrecision, lightning_precision_name  # noqa: E402
from ampkit.optim.base import CompensatedOptimizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]
MODES = ["fp32", "16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-true", "16-true", "fp8-delayed"]


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return x, y


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))


def test_lightning_precision_strings_map_to_ampkit_modes():
    assert [lightning_precision_name(s) for s in ("16-mixed", "bf16-mixed", "bf16-true", "16-true", "32-true")] == \
        ["fp16-mixed", "bf16-mixed", "bf16-pure", "fp16-pure", "fp32"]
    assert [lightning_precision_name(s) for s in (16, "16", "bf16", 32)] == ["fp16-mixed", "fp16-mixed", "bf16-mixed", "fp32"]
    with pytest.raises(ValueError, match="Lightning's own plugin"):
        lightning_precision_name("64-true")
    assert AmpkitPrecision("bf16-master", "cpu").precision == "bf16-true"  # what trainer.precision reports


@pytest.mark.parametrize("mode", MODES)
def test_fabric_trains_in_every_mode(mode):
    fp8 = {"fp8_filter": "ends"} if mode.startswith("fp8") else {}  # the default roofline filter converts none here
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=AmpkitFabricPrecision(mode, "cpu", **fp8))
    model = _net()
    first_weight = model[0].weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = _data()
    losses = []
    for step in range(12):
        xb, yb = x[step % 4 * 16:(step % 4 + 1) * 16], y[step % 4 * 16:(step % 4 + 1) * 16]
        loss = nn.functional.cross_entropy(model(xb), yb)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    plugin = fabric.strategy.precision
    assert all(math.isfinite(v) for v in losses) and sum(losses[-4:]) < sum(losses[:4]), losses
    assert plugin.optimizer_steps + plugin.skipped_steps == 12
    prepared = plugin.prepare_optimizer(optimizer.optimizer)
    if plugin.ampkit.mode.master_weights:  # the model's params are the fp32 masters: the optimizer is the user's
        assert prepared is optimizer.optimizer and model.module[0].weight.dtype == torch.float32
    if plugin.ampkit.mode.compensated:
        assert isinstance(prepared, CompensatedOptimizer)
    assert model.module[0].weight.dtype == plugin.ampkit.param_dtype
    if mode.startswith("fp8"):  # the inner Linear now runs its GEMMs in fp8
        assert type(model.module[3]) is not nn.Linear
    assert not torch.equal(first_weight, model.module[0].weight.detach().float())


def test_fabric_masters_start_from_fp32_weights():
    plugin = AmpkitFabricPrecision("bf16-master", "cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = _net()
    fp32 = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    loss = model(_data()[0]).float().sum()
    fabric.backward(loss)
    optimizer.step()
    masters = list(model.parameters())  # the masters are the model's own parameters, stepped by lr 0
    assert all(p.dtype == torch.float32 for p in masters)
    assert all(torch.equal(a, b) for a, b in zip(fp32, masters))


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss.float(), on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=100)}


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("mode,kwargs", [("bf16-master", {}), ("16-mixed", {"loss_scale": 128.0}),
                                         ("bf16-true", {"compensation": "stochastic"}), ("fp16-master", {}),
                                         ("32-true", {})])
def test_trainer_trains_and_checkpoints(tmp_path, mode, kwargs):
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    plugin = AmpkitPrecision(mode, "cpu", **kwargs)
    losses = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, plugins=plugin, callbacks=[losses],
                        default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0)
    module = _Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    assert len(losses.losses) == 12 and all(math.isfinite(v) for v in losses.losses)
    assert sum(losses.losses[-4:]) < sum(losses.losses[:4]), losses.losses
    assert plugin.optimizer_steps + plugin.skipped_steps == 12
    if "loss_scale" in kwargs:  # ampkit's static scaling: the scale never moves
        assert plugin.loss_scale == 128.0
    assert module.net[0].weight.dtype == plugin.ampkit.param_dtype
    opt = trainer.optimizers[0]
    assert isinstance(opt, CompensatedOptimizer) == plugin.ampkit.mode.compensated
    assert plugin.prepare_optimizer(opt) is opt  # prepared once, when the Trainer connected it
    ckpt = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=False)
    assert ckpt["AmpkitPrecision"]["name"] == plugin.ampkit.name  # the scaler and its counters travel along
    if plugin.ampkit.mode.master_weights:  # the checkpoint's weights are the fp32 masters themselves
        assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())


class _DecayingModule(_Module):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


@pytest.mark.parametrize("mode,kwargs", [("16-mixed", {"init_scale": 2.0**20, "growth_interval": 2}),
                                         ("bf16-master", {}), ("bf16-true", {}), ("bf16-mixed", {})])
def test_trainer_resume_from_checkpoint_is_bitwise(tmp_path, mode, kwargs):
    """Lightning's own checkpoint and fit(ckpt_path=...): the optimizer it saves is the one ampkit steps (masters,
    Kahan buffers), the plugin's state the loss scale; the resumed run equals the uninterrupted one."""
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    def fit(epochs, root, ckpt=None, seed=0):
        plugin = AmpkitPrecision(mode, "cpu", **kwargs)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=plugin, default_root_dir=root,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=1.0)
        torch.manual_seed(seed)
        module = _DecayingModule()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader, ckpt_path=ckpt)
        return trainer, module, plugin

    whole_trainer, whole, whole_plugin = fit(2, tmp_path / "whole")
    fit(1, tmp_path / "first")
    ckpt = next((tmp_path / "first").rglob("*.ckpt"))
    trainer, resumed, plugin = fit(2, tmp_path / "resumed", ckpt=str(ckpt), seed=1)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [1e-2 * 0.5 ** 2]  # the schedule steps it
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    assert whole_plugin.ampkit.scaler.state_dict() == plugin.ampkit.scaler.state_dict()
    if plugin.ampkit.mode.master_weights:
        assert all(torch.equal(a, b) for a, b in zip(whole_plugin.fp32_state_dict(whole.net).values(),
                                                      plugin.fp32_state_dict(resumed.net).values()))
