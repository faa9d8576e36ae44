"""One class per kind of mode behind ``Precision(name)`` (ampkit/precision/kinds/, the table ``KINDS``)."""
import copy
import pickle

import pytest
import torch

from torch import nn

import ampkit
from ampkit.precision import (MODES, AutocastPrecision, Fp8Precision, Fp32Precision, MasterPrecision, Precision,
                              PurePrecision, Tuned, precision_class)

EXPECTED = {
    "fp32": Fp32Precision, "fp16-mixed": AutocastPrecision, "bf16-mixed": AutocastPrecision,
    "fp16-master": MasterPrecision, "bf16-master": MasterPrecision, "bf16-pure": PurePrecision,
    "fp16-pure": PurePrecision, "fp8-tensorwise": Fp8Precision, "fp8-rowwise": Fp8Precision,
    "fp8-delayed": Fp8Precision, "mxfp8": Fp8Precision,
}


@pytest.mark.filterwarnings("ignore:precision='fp16")
def test_every_mode_builds_its_kind():
    assert set(EXPECTED) == set(MODES)
    for name, cls in EXPECTED.items():
        p = Precision(name, "cpu")
        assert type(p) is cls and isinstance(p, Precision) and isinstance(p, ampkit.Precision)
        assert p.name == name and precision_class(name) is cls
    assert type(Precision("O2", "cpu")) is MasterPrecision  # aliases go through the same table
    assert type(Precision("bf16-mixed", "cpu")._retuned(Tuned())) is AutocastPrecision


def test_auto_lands_on_the_tuned_kind_as_a_new_object():
    p = Precision("auto", "cpu")
    q = p._retuned(Tuned(mode="bf16-pure", mode_reason="measured"))
    assert type(q) is PurePrecision and q is not p and q.requested == "auto"
    assert q.describe().startswith("auto -> bf16-pure (measured)")
    assert p.name != "bf16-pure"  # the first object is left as it was
    with pytest.raises(ValueError, match="auto picks its mode per device"):
        precision_class("auto")


def test_a_kind_built_directly_runs_its_modes_only():
    assert type(AutocastPrecision("bf16-mixed", "cpu")) is AutocastPrecision
    with pytest.raises(TypeError, match=r"runs the 'autocast' modes, not 'bf16-pure'.*Precision\('bf16-pure'\)"):
        AutocastPrecision("bf16-pure", "cpu")
    p = Precision("bf16-mixed", "cpu")
    with pytest.raises(TypeError, match="not 'fp32'"):  # no re-initialising a live object into another kind
        p.__init__("fp32", "cpu")


def test_copies_keep_the_kind_and_state():
    p = Precision("bf16-pure", "cpu", compensation="stochastic")
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert type(q) is PurePrecision and q.compensation == "stochastic" and q.describe() == p.describe()


def test_only_the_hooks_a_kind_needs_change_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    for name, dtype, computes in (("fp32", torch.float32, torch.float32), ("bf16-mixed", torch.float32, torch.float32),
                                  ("bf16-master", torch.float32, torch.bfloat16),
                                  ("bf16-pure", torch.bfloat16, torch.bfloat16)):
        m = copy.deepcopy(model)
        precision = Precision(name, "cpu")
        m, opt = precision.setup(m, torch.optim.AdamW(m.parameters()))
        assert m[0].weight.dtype == dtype and m[1].weight.dtype == torch.float32
        seen = []
        m[0].register_forward_pre_hook(lambda mod, a: seen.append(mod.weight.dtype))
        with precision.autocast():  # master modes put their compute copies on inside it only
            m(torch.randn(2, 4))
        assert seen == [computes]  # the master mode computes with a 16-bit copy of its fp32 weight


def test_one_explicit_table_covers_every_kind_of_the_mode_table():
    """``Precision(name)`` dispatches through ``kinds.KINDS`` (written once, in plain code) in ``Precision.__new__``:
    no metaclass, no class registering itself by being defined, no registry filled by an import."""
    import ast
    import inspect

    from ampkit.precision import kinds
    from ampkit.precision.kinds import base

    assert set(kinds.KINDS) == {m.kind for m in MODES.values()}
    assert all(kinds.KINDS[c.kind] is c for c in set(EXPECTED.values()))
    assert all(issubclass(c, Precision) and c.kind == k for k, c in kinds.KINDS.items())
    assert type(Precision) is type
    tree = ast.parse(inspect.getsource(base))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init_subclass__"]
    assert [c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)] == ["Precision"]  # one class, no mixin


