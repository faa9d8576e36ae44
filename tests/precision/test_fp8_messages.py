"""What fp8 says about the GPU it runs on: the compute capability each recipe's GEMMs need (8.9+ per-tensor and
delayed, 9.0+ row-wise, 10.0+ MX), with the capability faked; and the one warning that eager fp8 is slower than
bf16-mixed where its GEMMs are real (said once, never under torch.compile)."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import fp8 as fp8_pkg
from ampkit.precision.fp8 import RECIPES, emulated_warning, note_eager
from ampkit.precision.fp8.swap import has_gemm

pytestmark = pytest.mark.usefixtures("one_thread")

NEEDS = {"fp8-tensorwise": (8, 9), "fp8-delayed": (8, 9), "fp8-rowwise": (9, 0), "mxfp8": (10, 0)}


@pytest.fixture
def fake_gpu(monkeypatch):
    """``set(major, minor)``: torch.cuda reports a device of that compute capability."""
    def set_cap(cap):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_cap


@pytest.mark.parametrize("mode", list(NEEDS))
def test_each_recipe_needs_its_own_capability(mode, fake_gpu):
    need = NEEDS[mode]
    for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
        fake_gpu(cap)
        assert has_gemm("cuda", RECIPES[mode]()) == (cap >= need), (mode, cap)
    fake_gpu((0, 0))
    assert not has_gemm("cpu", RECIPES[mode]())


def test_mxfp8_on_hopper_names_blackwell_not_the_fp8_capabilities():
    msg = emulated_warning("mxfp8", RECIPES["mxfp8"](), (9, 0))
    assert "compute capability 9.0" in msg and "need compute capability 10.0+ (Blackwell)" in msg
    assert "8.9+, 9.0+ for row-wise" not in msg
    assert "fp8-rowwise (9.0+)" in msg and "fp8-tensorwise (8.9+)" in msg  # what does run on this GPU
    assert len(msg.splitlines()) == 1


@pytest.mark.parametrize("mode,cap", [("fp8-rowwise", (8, 9)), ("fp8-tensorwise", (8, 6)), ("fp8-delayed", (8, 0))])
def test_fp8_messages_name_the_recipes_capability(mode, cap):
    msg = emulated_warning(mode, RECIPES[mode](), cap)
    major, minor = NEEDS[mode]
    assert f"need compute capability {major}.{minor}+" in msg and "emulated" in msg
    assert ("fp8-tensorwise (8.9+)" in msg) == (mode == "fp8-rowwise")  # only where 8.9 is there and it is not itself
    assert "10.0" not in msg


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _eager_notes(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if "runs eagerly" in str(w.message)]


def test_eager_fp8_is_said_once_and_not_under_compile():
    torch.manual_seed(0)
    model = Net()
    note_eager(model, "fp8-tensorwise")
    note_eager(model, "fp8-tensorwise")  # once per model
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    try:
        assert _eager_notes(lambda: compiled(x)) == []  # compiled: nothing to say
    finally:
        torch._dynamo.reset()
    notes = _eager_notes(lambda: [model(x) for _ in range(3)])
    assert len(notes) == 1
    msg = str(notes[0].message)
    assert "slower than bf16-mixed" in msg and "torch.compile(model)" in msg and len(msg.splitlines()) == 1
    model.eval()
    assert _eager_notes(lambda: model(x)) == []
    torch.save(model, __import__("io").BytesIO())  # the hook pickles


def test_eager_note_is_not_said_for_a_model_compiled_by_region():
    torch.manual_seed(0)
    model = Net()
    note_eager(model, "fp8-tensorwise")
    model.b.compile(backend="eager")  # as ampkit train --compile does with the blocks
    torch._dynamo.reset()
    try:
        assert _eager_notes(lambda: [model(torch.randn(4, 32)) for _ in range(2)]) == []
    finally:
        torch._dynamo.reset()


def test_setup_hooks_the_note_only_where_fp8_gemms_are_real(monkeypatch):
    def setup():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prec = ampkit.Precision("fp8-tensorwise", "cpu", op_policy=False, fp8_filter="all")
            model, _ = prec.setup(Net())
        return model

    emulated = setup()  # a CPU: emulated GEMMs, already said to be numerics only
    assert _eager_notes(lambda: emulated(torch.randn(4, 32))) == []
    monkeypatch.setattr(fp8_pkg, "has_gemm", lambda device, recipe: True)  # as on an sm90 GPU
    real = setup()
    assert len(_eager_notes(lambda: [real(torch.randn(4, 32)) for _ in range(2)])) == 1
