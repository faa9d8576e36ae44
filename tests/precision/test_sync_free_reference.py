"""The Trainer resolves the skip flag one step late (no host read per step); the lr and
params it produces must equal, bit for bit on CPU, a synchronous run that reads the flag after every
step and advances the schedule only on real steps. The synchronous reference is a hand loop over the
public API (the Trainer's own model/optimizer/scheduler/precision objects, built but not fitted),
fed the exact batches the Trainer saw, with NaN storms, fp16 overflow skips and a resume mid-run.
"""
import glob
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # fp16 on CPU is slow: said once


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _data(n):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _loss(bad, start=0, labels=None):
    """Cross-entropy, NaN on the training calls whose 0-based index is in ``bad`` (the Trainer's data
    check calls it once under no_grad: not counted). ``start``: calls already made (a resumed run);
    ``labels``: a list that collects the targets of the training calls."""
    calls = [start]

    def loss_fn(out, y):
        loss = nn.functional.cross_entropy(out, y)
        if not torch.is_grad_enabled():
            return loss
        if labels is not None:
            labels.append(y.clone())
        k, calls[0] = calls[0], calls[0] + 1
        return loss * float("nan") if k in bad else loss

    return loss_fn


def _trainer(steps, loss_fn, out=None, **kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(_model(), _data(steps * 8), batch_size=8, epochs=1, log_every=10_000, progress=False,
                       lr_schedule="cosine", warmup_steps=2, max_norm=1.0, loss_fn=loss_fn,
                       out=str(out) if out else None, **kw)


def _record(t, log):
    """After every optimizer call (taken or skipped): the lr it used and the params it left."""
    params = [p for g in t.optimizer.param_groups for p in g["params"]]
    t.optimizer.register_step_post_hook(
        lambda opt, args, kwargs: log.append((opt.param_groups[0]["lr"], [p.detach().clone() for p in params])))


def _batches(t, log):
    """The (x, y) of every training forward of ``t``."""
    t.model.register_forward_pre_hook(
        lambda m, args: log.append(args[0].detach().clone()) if torch.is_grad_enabled() else None)


def _synchronous(steps, bad, batches, **kw):
    """The reference: read the flag after every step, advance the schedule only on a real one."""
    ref = _trainer(steps, None, **kw)
    loss_fn = _loss(bad)
    model, opt, sched, prec = ref.model, ref.optimizer, ref.scheduler, ref.precision
    log, skipped = [], 0
    _record(ref, log)
    for x, y in batches:
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        stepped = bool(prec.step(opt, max_norm=ref.config.max_norm))  # the synchronous read
        skipped += not stepped
        if stepped:
            sched.step()
        opt.zero_grad(set_to_none=True)
    return log, skipped


def _assert_same(got, want):
    assert len(got) == len(want)
    for k, ((lr_a, ps_a), (lr_b, ps_b)) in enumerate(zip(got, want)):
        assert lr_a == lr_b, f"step {k}: lr {lr_a} != {lr_b}"
        assert all(torch.equal(a, b) for a, b in zip(ps_a, ps_b)), f"step {k}: params differ"


@pytest.mark.parametrize("precision,kw,bad,min_skips", [
    ("bf16-pure", {"compensation": "kahan"}, {1, 2, 5}, 3),  # a NaN storm (steps 1, 2) and a lone NaN
    ("bf16-pure", {"compensation": "stochastic"}, {0, 4}, 2),  # a skipped first step, SR draws
    ("fp32", {}, {3, 4, 5}, 3),
    ("fp16-mixed", {"init_scale": 2.0 ** 24}, set(), 2),  # overflow skips while the scale comes down
])
def test_one_step_late_equals_synchronous(precision, kw, bad, min_skips):
    steps = 10
    got, xs, ys = [], [], []
    t = _trainer(steps, _loss(bad, labels=ys), precision=precision, save_every=None, **kw)  # None: each epoch (0 is refused)
    _record(t, got)
    _batches(t, xs)
    t.fit()
    batches = list(zip(xs, ys))
    want, skipped = _synchronous(steps, bad, batches, precision=precision, **kw)
    assert skipped >= min_skips and t.precision.skipped_steps == skipped
    assert t.global_step == steps - skipped
    _assert_same(got, want)


def test_resume_mid_run_with_skips_equals_synchronous(tmp_path):
    steps, bad, kw = 10, {2, 3, 7}, dict(precision="bf16-pure", compensation="stochastic")
    got_full, xs, ys = [], [], []
    full = _trainer(steps, _loss(bad, labels=ys), tmp_path / "full", save_every=4, **kw)
    _record(full, got_full)
    _batches(full, xs)
    full.fit()
    ckpts = sorted(glob.glob(os.path.join(tmp_path, "full", "**", "*step*4*"), recursive=True))
    assert ckpts, os.listdir(tmp_path / "full")
    # from an earlier checkpoint of a run that went on: into a run directory of its own (in place is refused)
    resumed = _trainer(steps, _loss(bad, start=4), tmp_path / "resumed", save_every=4, resume=ckpts[0], **kw)
    got_resumed = []
    _record(resumed, got_resumed)
    resumed.fit()
    _assert_same(got_resumed, got_full[4:])
    want, skipped = _synchronous(steps, bad, list(zip(xs, ys)), **kw)
    _assert_same(got_full, want)
    assert skipped == 3 and resumed.global_step == full.global_step == 7
