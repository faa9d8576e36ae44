"""timm's scaler protocol (timm is not a dependency): its CheckpointSaver saves `amp_scaler.state_dict()` under
`amp_scaler.state_dict_key`, its resume_checkpoint loads it back by that key, and train.py calls the scaler as
`loss_scaler(loss, optimizer, clip_grad=..., clip_mode=..., parameters=..., create_graph=..., need_update=...)`.
The two checkpoint functions below do what timm's do, so ampkit's objects are tested as timm uses them."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.integrations.timm import AmpkitScaler

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]


def timm_style_save(path, model, optimizer, amp_scaler, epoch):
    state = {"epoch": epoch, "arch": "net", "optimizer": optimizer.state_dict(), "version": 2,
             "state_dict": model.state_dict()}
    if amp_scaler is not None:
        state[amp_scaler.state_dict_key] = amp_scaler.state_dict()
    torch.save(state, path)


def timm_style_resume(path, model, optimizer, loss_scaler):
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if loss_scaler is not None and loss_scaler.state_dict_key in checkpoint:
        loss_scaler.load_state_dict(checkpoint[loss_scaler.state_dict_key])
    return checkpoint["epoch"] + 1


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 2))


def _batch(step):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    return x, (x[:, :3].sum(1) > 0).long()


def _setup(mode, options, seed=0):
    precision = ampkit.Precision(mode, "cpu", **options)
    model = _net(seed)
    model, optimizer = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    return precision, model, optimizer, AmpkitScaler(precision)


def _train(precision, model, optimizer, scaler, steps):
    for step in steps:  # timm's train_one_epoch body
        x, y = _batch(step)
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
        optimizer.zero_grad()


CASES = [("fp16-mixed", {"init_scale": 2.0**20, "growth_interval": 2}), ("fp16-master", {}), ("bf16-master", {}),
         ("bf16-pure", {}), ("bf16-mixed", {})]


@pytest.mark.parametrize("mode,options", CASES, ids=[m for m, _ in CASES])
def test_resume_through_timms_checkpoint_protocol_is_bitwise(tmp_path, mode, options):
    whole = _setup(mode, options)
    _train(*whole, range(6))
    first = _setup(mode, options)
    _train(*first, range(3))
    timm_style_save(tmp_path / "last.pth.tar", first[1], first[2], first[3], epoch=0)
    again = _setup(mode, options, seed=1)
    assert timm_style_resume(tmp_path / "last.pth.tar", again[1], again[2], again[3]) == 1
    _train(*again, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(whole[1].state_dict().values(), again[1].state_dict().values()))
    assert whole[0].scaler.state_dict() == again[0].scaler.state_dict()
    if mode == "fp16-mixed":
        saved = torch.load(tmp_path / "last.pth.tar", weights_only=False)["amp_scaler"]
        assert saved["name"] == "fp16-mixed" and saved["scaler"]["scale"] != 2.0**20


def test_loss_scaler_has_timms_key_and_round_trips():
    precision = ampkit.Precision("fp16-mixed", "cpu", init_scale=1024.0)
    assert precision.scaler.state_dict_key == "amp_scaler" == AmpkitScaler.state_dict_key
    other = ampkit.Precision("fp16-mixed", "cpu")
    other.scaler.load_state_dict(precision.scaler.state_dict())
    assert other.loss_scale == 1024.0


def test_a_native_scaler_state_loads_and_another_mode_is_refused():
    scaler = AmpkitScaler(ampkit.Precision("fp16-mixed", "cpu"))
    native = torch.amp.GradScaler("cpu", init_scale=512.0)
    native._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler.load_state_dict(native.state_dict())  # a checkpoint written with timm's NativeScaler
    assert scaler.precision.loss_scale == 512.0
    with pytest.raises(ValueError, match="saved by precision='bf16-master'"):
        scaler.load_state_dict(ampkit.Precision("bf16-master", "cpu").state_dict())


def test_need_update_false_accumulates_then_steps():
    precision, model, optimizer, scaler = _setup("fp16-mixed", {})
    before = model[0].weight.detach().clone()
    for step in range(2):
        x, y = _batch(step)
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x), y) / 2
        result = scaler(loss, optimizer, need_update=step == 1)
        assert (result is None) == (step == 0)
        assert torch.equal(before, model[0].weight) == (step == 0)
    assert bool(result) and precision.optimizer_steps == 1 and precision.skipped_steps == 0


def test_bad_calls_are_one_line_errors():
    precision, model, optimizer, scaler = _setup("bf16-mixed", {})
    x, y = _batch(0)
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match="clip_mode='agc' is not supported"):
        scaler(loss, optimizer, clip_grad=1.0, clip_mode="agc", parameters=model.parameters())
    with pytest.raises(TypeError, match="takes an ampkit.Precision"):
        AmpkitScaler(torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="no backward came through"):
        AmpkitScaler(precision).step_and_update()
