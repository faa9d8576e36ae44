"""fp8 under the ways torch runs a forward besides the plain one: activation checkpointing (the recompute
must not record amaxes again: bitwise equal runs), torch.inference_mode / no_grad evaluation, torch.func.grad."""
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampkit
from ampkit.precision.fp8.current import FUNC_TRANSFORM_HINT

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = ("fp8-tensorwise", "fp8-rowwise", "fp8-delayed")


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Blocks run plainly, or each through torch.utils.checkpoint (reentrant or not), as training scripts do;
    ``shared`` runs one block twice (two checkpointed segments use the same fp8 layers)."""

    def __init__(self, ckpt=None, shared=False):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ckpt, self.order = ckpt, [0, 1, 0] if shared else [0, 1]

    def forward(self, x):
        h = self.inp(x)
        for i in self.order:
            block = self.blocks[i]
            h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant") if self.ckpt else block(h)
        return self.out(h)


def _setup(model, mode="fp8-delayed", opt=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulated-bf16 note
        prec = ampkit.Precision(mode, "cpu", op_policy=False, fp8_filter="ends")  # tiny layers: auto converts none
        return (*prec.setup(model, opt), prec)


def _train(ckpt, shared=False, steps=4, accum=2):
    torch.manual_seed(0)
    model = Net(ckpt, shared)
    model, opt, prec = _setup(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-2))
    outs = []
    for step in range(steps):
        for micro in range(accum):
            g = torch.Generator().manual_seed(step * 10 + micro)
            x = torch.randn(8, 16, generator=g) * (1 + step)  # growing amaxes: the histories matter
            with prec.autocast():
                y = model(x)
                loss = y.float().pow(2).mean() / accum
            prec.backward(loss)
            outs.append(y.detach())
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), torch.stack(outs)


@pytest.mark.parametrize("shared", [False, True], ids=["blocks", "shared-block"])
def test_delayed_checkpointing_is_bitwise_equal_to_no_checkpointing(shared):
    state, outs = _train(None, shared)
    hist = state["blocks.0.up.amax_history_input"]
    assert hist[:8].gt(0).all() and hist[8:].eq(0).all()  # one entry per micro-batch: 4 steps x 2, not 16
    # a block used twice under reentrant checkpointing accumulates its two weight gradients in another order
    # (one autograd.backward per segment): not bitwise even in fp32, so that pair is left out
    for ckpt in ("non-reentrant",) if shared else ("non-reentrant", "reentrant"):
        s, o = _train(ckpt, shared)
        assert torch.equal(o, outs), ckpt  # the same scales in every forward
        for k, v in state.items():  # amax histories (input, weight, grad-output) and parameters
            assert torch.equal(v, s[k]), (ckpt, k)


def test_hf_gpt2_gradient_checkpointing_bitwise_equal_in_fp8_delayed():
    hf = pytest.importorskip("hf_models")

    def run(ckpt):
        model = hf.build("gpt2")
        for m in model.modules():  # dropout off: the comparison is about the fp8 state, not RNG streams
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        if ckpt:
            model.gradient_checkpointing_enable()  # HF's own switch: torch.utils.checkpoint per block
        model, opt, prec = _setup(model, opt=torch.optim.AdamW(model.parameters(), lr=1e-3))
        model.train()
        calls = []
        model.transformer.h[1].mlp.c_fc.register_forward_pre_hook(lambda *a: calls.append(1))
        for step in range(3):
            with prec.autocast():
                loss = model(**hf.BATCHES["gpt2"](step)).loss
            prec.backward(loss)
            prec.step(opt)
            opt.zero_grad(set_to_none=True)
        return model.state_dict(), len(calls)

    (plain, n_plain), (ckpt, n_ckpt) = run(False), run(True)
    assert (n_plain, n_ckpt) == (3, 6)  # the backward re-ran each checkpointed forward
    assert plain["transformer.h.1.mlp.c_fc.amax_history_input"][:3].gt(0).all()
    assert plain["transformer.h.1.mlp.c_fc.amax_history_input"][3:].eq(0).all()  # 3 steps, 3 entries
    for k, v in plain.items():
        assert torch.equal(v, ckpt[k]), k


def test_delayed_records_each_amax_once_under_checkpoint():
    torch.manual_seed(0)
    model, _, prec = _setup(Net("non-reentrant"))
    x = torch.randn(8, 16)
    with prec.autocast():
        model(x).float().sum().backward()
    up = model.blocks[1].up
    assert up.amax_history_input[0] > 0 and up.amax_history_input[1:].eq(0).all()
    assert up.amax_history_grad_output[0] > 0 and up.amax_history_grad_output[1:].eq(0).all()


@pytest.mark.parametrize("mode", MODES)
def test_inference_mode_and_no_grad_eval_run_fp8_alike(mode):
    torch.manual_seed(0)
    model, opt, prec = _setup(Net(), mode, None)
    x = torch.randn(8, 16)
    with prec.autocast():  # one training step, so delayed scaling has a history
        model(x).float().pow(2).mean().backward()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), prec.autocast():
        want = model(x)
    with torch.inference_mode(), prec.autocast():
        got = model(x)
    assert torch.equal(got, want)
    model.train()  # a training-mode forward under inference_mode (a forgotten eval()) records nothing either
    with torch.inference_mode(), prec.autocast():
        model(x * 100)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_func_grad_delayed_equals_backward():
    x = torch.randn(8, 16)

    def build():
        torch.manual_seed(0)
        return _setup(Net())

    model, _, prec = build()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p):
        with prec.autocast():
            return torch.func.functional_call(model, p, (x,)).float().pow(2).mean()

    grads = torch.func.grad(loss_fn)(params)
    ref, _, ref_prec = build()
    with ref_prec.autocast():
        ref(x).float().pow(2).mean().backward()
    for k, g in grads.items():
        assert torch.equal(g, ref.get_parameter(k).grad), k
    for k, v in ref.state_dict().items():  # the amax histories recorded alike
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("mode", ["fp8-tensorwise", "fp8-rowwise"])
def test_func_grad_torchao_recipes_say_what_to_use(mode):
    model, _, prec = _setup(Net(), mode)
    params = dict(model.named_parameters())

    def loss_fn(p):
        with prec.autocast():
            return torch.func.functional_call(model, p, (torch.randn(4, 16),)).float().sum()

    with pytest.raises(RuntimeError) as err:
        torch.func.grad(loss_fn)(params)
    assert str(err.value) == FUNC_TRANSFORM_HINT and "fp8-delayed" in str(err.value)
