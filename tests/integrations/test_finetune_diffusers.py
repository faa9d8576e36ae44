"""diffusers' unconditional training loop (its train_unconditional.py, as its users write it) with ampkit:
a UNet2DModel from a tiny config, DDPMScheduler noise, accelerate's ``accumulate``, ``get_scheduler``, ``EMAModel``
stepped after each synced optimizer step, ``save_state``/``load_state``: the resumed run ends bit for bit as the
whole one (weights, EMA, loss scale) in bf16-mixed, fp16-mixed, bf16-master and bf16-pure."""
import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers", reason="pip install -e '.[finetune]' (peft, trl, sentence-transformers, "
                                                    "diffusers) runs these")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from diffusers import DDPMScheduler, UNet2DModel  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations import accelerate as ampkit_accelerate  # noqa: E402
from integrations.test_clients_accelerate import _fresh_accelerate  # noqa: E402,F401 (autouse: no accelerate state)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

STEPS, ACCUMULATE, BATCH = 4, 2, 4


def images():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.rand(STEPS * ACCUMULATE * BATCH, 3, 8, 8, generator=g) * 2 - 1)


def build(mode):
    """Everything train_unconditional.py builds, with ampkit's precision in place of accelerate's."""
    torch.manual_seed(0)
    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=STEPS)
    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=ACCUMULATE)
    precision = ampkit.Precision(mode, "cpu")
    model, optimizer = precision.setup(model, optimizer)
    # the EMA averages fp32 weights: the model's own in the autocast and master modes, bf16-pure's fp32 view
    view = precision.fp32_view(model, optimizer) if precision.kind == "pure" else None
    ema = EMAModel((view.module if view else model).parameters(), decay=0.9, model_cls=UNet2DModel,
                   model_config=model.config)
    loader = torch.utils.data.DataLoader(images(), batch_size=BATCH, shuffle=False)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    accelerator.register_for_checkpointing(precision)
    accelerator.register_for_checkpointing(ema)
    return dict(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, accelerator=accelerator,
                precision=precision, ema=ema, view=view, loader=loader, noise=DDPMScheduler(num_train_timesteps=100))


def train(run, micro_batches, skip=0):
    model, optimizer, accelerator, precision = run["model"], run["optimizer"], run["accelerator"], run["precision"]
    loader = accelerator.skip_first_batches(run["loader"], skip) if skip else run["loader"]
    for i, (clean,) in enumerate(loader, start=skip):
        if i >= micro_batches:
            break
        g = torch.Generator().manual_seed(i)  # the noise and timesteps of micro-batch i, whatever resumed
        noise = torch.randn(clean.shape, generator=g)
        t = torch.randint(0, 100, (len(clean),), generator=g)
        noisy = run["noise"].add_noise(clean, noise, t)
        with accelerator.accumulate(model):
            with precision.autocast():
                pred = model(noisy, t).sample
            loss = F.mse_loss(pred.float(), noise)
            ampkit_accelerate.backward(precision, accelerator, loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            ampkit_accelerate.step(precision, optimizer)
            run["lr_scheduler"].step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:  # after the optimizer step, once per synced step
            source = run["view"].refresh() if run["view"] else model
            run["ema"].step(source.parameters())
    return loss


@pytest.mark.parametrize("mode", ["bf16-mixed", "fp16-mixed", "bf16-master", "bf16-pure"])
def test_unconditional_loop_with_ema_resumes_bitwise(mode, tmp_path):
    whole = build(mode)
    loss = train(whole, STEPS * ACCUMULATE)
    assert torch.isfinite(loss)
    half = STEPS * ACCUMULATE // 2
    first = build(mode)
    train(first, half)
    first["accelerator"].save_state(str(tmp_path / "state"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = build(mode)
    resumed["accelerator"].load_state(str(tmp_path / "state"))
    train(resumed, STEPS * ACCUMULATE, skip=half)
    a, b = whole["model"].state_dict(), resumed["model"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(whole["ema"].shadow_params, resumed["ema"].shadow_params))
    assert whole["precision"].state_dict() == resumed["precision"].state_dict()
    if mode == "bf16-pure":  # the Kahan buffers travel in the optimizer state: the fp32 weights agree too
        wa = whole["precision"].fp32_state_dict(whole["model"])
        wb = resumed["precision"].fp32_state_dict(resumed["model"])
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
