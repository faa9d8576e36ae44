"""The ops one eager bf16-pure optimizer step dispatches (each a kernel launch on a GPU, where a step that launches per
tensor or per chunk is bound by the host: ~50,000 launches on an H200 before), counted under a
``TorchDispatchMode``: a fixed number whatever the parameters' count and size up to a batch, at most 2-3x
``torch.optim.AdamW(foreach=True)``'s on the same parameters, and beyond a batch growing with the bytes only."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.optim import AdamW
from ampkit.optim.base import DEVICE_BATCH
from op_count import OpCount

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 1 << 17  # a batch holding either model whole




def _model(width, layers):
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width))]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def _step_ops(width, layers, batch=None, compensation=None):
    """Ops of the optimizer step of ``Precision("bf16-pure")`` (with ``found_inf``: the device-side skip included,
    as every training step runs it) and of torch's foreach AdamW over the same (bf16 and fp32 norm) params."""
    model = _model(width, layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precision = ampkit.Precision("bf16-pure", "cpu", compensation=compensation)
        model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(opt, AdamW)
    opt.bucket_numel, opt.compiled = batch, False  # the eager batches (the compiled pass: test_optim_onepass.py)
    x = torch.randn(4, width)
    for _ in range(3):  # the count of the third step (state made, views cached)
        with precision.autocast():
            loss = model(precision._convert_input(x)).float().pow(2).mean()
        precision.backward(loss)
        found = torch.zeros(())  # the non-finite flag precision.step hands the optimizer (ampkit.precision.step)
        with OpCount() as ours:
            opt.found_inf = found
            opt.step()
            del opt.found_inf
        opt.zero_grad()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(3):
        model(precision._convert_input(x)).float().pow(2).mean().backward()
        with OpCount() as theirs:
            ref.step()
        ref.zero_grad()
    params = list(model.parameters())
    return ours.n, theirs.n, len(params), sum(p.numel() for p in params)


@pytest.mark.parametrize("compensation", [None, "stochastic"])  # None: bf16-pure's default, Kahan
def test_ops_do_not_grow_with_parameter_count(compensation):
    """Two models, 14 and 26 tensors, 13k and 101k parameters (under one batch of 2**17 elements; the CPU's
    default, CPU_BATCH, is smaller: test_ops_grow_with_bytes_beyond_a_batch_only): the same count, within
    3x torch's foreach AdamW (whose count grows with the tensor count) on each: the eager batches run the compiled
    pass's formula op by op (~50 elementwise ops on a flat row, the noise hash among them)."""
    small = _step_ops(64, 3, batch=BATCH, compensation=compensation)
    large = _step_ops(128, 6, batch=BATCH, compensation=compensation)
    assert small[2] < large[2] and small[3] * 7 < large[3] <= BATCH, (small, large)
    assert small[0] == large[0], (small, large)
    if compensation is None:  # stochastic rounding of the params costs one more hash (~10 ops)
        for ours, theirs, *_ in (small, large):
            assert ours <= 3 * theirs, (ours, theirs)


def test_ops_grow_with_bytes_beyond_a_batch_only():
    """At a GPU's batch size (DEVICE_BATCH) the issue's 2.6M-parameter, 27-tensor model and a 0.26M one step in
    the same count as the small models, within 2x torch's; at the CPU's batch size the count grows with the
    batches the bytes need (an embedding-sized param is cut into slices), not with the tensors."""
    tiny = _step_ops(64, 3)
    mid = _step_ops(140, 13, batch=DEVICE_BATCH)
    big = _step_ops(440, 13, batch=DEVICE_BATCH)
    assert mid[2] == big[2] == 54 and mid[3] < 300_000 and big[3] > 2_500_000, (mid, big)
    for ours, theirs, *_ in (mid, big):
        assert ours == tiny[0] and ours <= 2 * theirs, (ours, theirs, tiny)
    sliced = _step_ops(440, 13, batch=1 << 18)  # bf16: ~10 batches; the fp32 norms: one
    batches = -(-big[3] // (1 << 18))
    assert tiny[0] < sliced[0] <= tiny[0] * (batches + 1), (sliced, batches)
