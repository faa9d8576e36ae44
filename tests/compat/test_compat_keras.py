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
        ("bf16-master", "bf16-master", "bfloat16", "float32"),  # the trained weights are the fp32 masters
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


def test_keras3_names_and_clear_errors(monkeypatch):
    assert mixed_precision.DTypePolicy is Policy
    mixed_precision.set_dtype_policy("mixed_bfloat16")
    assert mixed_precision.dtype_policy().name == "mixed_bfloat16"
    assert [mixed_precision.keras_policy_name(n) for n in ("bf16-master", "fp16-master", "bf16-pure", "fp32")] == \
        ["mixed_bfloat16", "mixed_float16", "bfloat16", "float32"]
    assert mixed_precision.keras_policy_name("fp8-delayed") is None
    monkeypatch.setattr(mixed_precision.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="Keras'.*precision.backward"):
        mixed_precision.LossScaleOptimizer
    with pytest.raises(AttributeError):
        mixed_precision.NoSuchName


KERAS_SCRIPT = r"""
import numpy as np, torch, keras
from ampkit.compat import keras as mixed_precision

def dense():
    layer = keras.layers.Dense(3)
    model = keras.Sequential([keras.Input((4,)), layer])
    return model(np.ones((2, 4), dtype="float32")), layer

mixed_precision.set_global_policy("mixed_bfloat16")     # the import swap MIGRATING.md shows
assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
out, layer = dense()
assert out.dtype == torch.bfloat16 and layer.kernel.dtype == "float32", (out.dtype, layer.kernel.dtype)
mixed_precision.set_global_policy("bf16-master")       # fp32 variables, bf16 compute: Keras' mixed policy
assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
assert mixed_precision.Policy("bf16-master").variable_dtype == "float32"
mixed_precision.set_global_policy("bfloat16")           # Keras' pure bf16
out, layer = dense()
assert out.dtype == torch.bfloat16 and layer.kernel.dtype == "bfloat16"
mixed_precision.set_global_policy("mixed_float16")
assert mixed_precision.LossScaleOptimizer is keras.optimizers.LossScaleOptimizer
opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
assert float(opt.scale_loss(1.0)) > 1.0  # a dynamic scale, Keras-side
mixed_precision.set_global_policy(None)                 # back to auto for ampkit, Keras' default for Keras
assert keras.mixed_precision.global_policy().name == "float32"
print("ok")
"""


def test_drives_keras_own_policy_on_the_torch_backend():
    """A Keras 3 model on the torch backend really computes in 16 bits under the compat layer's policy (its own
    process: Keras picks its backend once, at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import importlib.util

    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras is not installed")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", KERAS_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
