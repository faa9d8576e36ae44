"""Keras-style policies: names, dtypes, and the global default every Precision() follows."""
import pytest
import torch

import ampkit
from ampkit.compat import keras as mixed_precision
from ampkit.compat.keras import Policy


@pytest.fixture(autouse=True)
def _reset_global_policy():
    yield
    mixed_precision.set_global_policy(None)


@pytest.mark.parametrize(
    "name, mode, compute, variable",
    [
        ("float32", "fp32", "float32", "float32"),
        ("mixed_float16", "fp16-mixed", "float16", "float32"),
        ("mixed_bfloat16", "bf16-mixed", "bfloat16", "float32"),
        ("float16", "fp16-pure", "float16", "float16"),
        ("bfloat16", "bf16-pure", "bfloat16", "bfloat16"),
        ("bf16-master", "bf16-master", "bfloat16", "float32"),  # the variables are the fp32 masters
        ("O2", "fp16-master", "float16", "float32"),
    ],
)
def test_policy_names_and_dtypes(name, mode, compute, variable):
    p = Policy(name)
    assert (p.name, p.mode, p.compute_dtype, p.variable_dtype) == (name, mode, compute, variable)
    assert p.torch_compute_dtype == getattr(torch, compute)
    assert repr(p) == f'<Policy "{name}">'
    assert Policy.from_config(p.get_config()) == p


def test_bad_policy_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="Cannot convert 'float64'.*'mixed_float16'"):
        Policy("float64")
    with pytest.raises(TypeError):
        Policy(16)


def test_global_policy_drives_precision():
    assert mixed_precision.global_policy().name == "auto"
    mixed_precision.set_global_policy("mixed_bfloat16")
    assert mixed_precision.global_policy().name == "mixed_bfloat16"
    assert ampkit.global_policy() == "bf16-mixed"
    precision = ampkit.Precision(device="cpu")
    assert precision.name == "bf16-mixed" and precision.compute_dtype == torch.bfloat16
    mixed_precision.set_global_policy(Policy("float32"))
    assert ampkit.Precision(device="cpu").name == "fp32"
    ampkit.set_global_policy("mixed_float16")  # the core accepts Keras names too
    assert mixed_precision.global_policy().name == "mixed_float16"
    mixed_precision.set_global_policy(None)
    assert ampkit.global_policy() == "auto"


def test_policy_autocast_and_precision():
    p = Policy("mixed_bfloat16")
    with p.autocast("cpu"):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    with Policy("float32").autocast("cpu"):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    assert p.precision("cpu").name == "bf16-mixed"
