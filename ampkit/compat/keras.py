"""Keras' mixed-precision policies for PyTorch code (``keras.mixed_precision`` spellings).

::

    from ampkit.compat import keras as mixed_precision
    mixed_precision.set_global_policy("mixed_bfloat16")
    policy = mixed_precision.global_policy()
    policy.name, policy.compute_dtype, policy.variable_dtype   # 'mixed_bfloat16', 'bfloat16', 'float32'
    precision = ampkit.Precision()                             # built without a name: follows the global policy

Keras' names map onto ampkit modes through ampkit's one alias table (``ampkit.precision.modes``):
``float32`` -> fp32, ``mixed_float16`` -> fp16-mixed (with dynamic loss scaling: Keras'
LossScaleOptimizer), ``mixed_bfloat16`` -> bf16-mixed, and, Keras' meaning, which differs from
ampkit's (``modes.KERAS_DIFFERENCES``), ``float16`` -> fp16-pure, ``bfloat16`` -> bf16-pure. Any
ampkit name or alias is accepted too.
As in Keras, dtypes are strings; ``torch_compute_dtype`` / ``torch_variable_dtype`` give torch's.
``variable_dtype`` is where the trained weights live: ``float32`` in the master modes (fp16/bf16-master,
whose fp32 weights are the truth, as in Keras' mixed policies), the 16-bit dtype in the pure modes.
Unlike Keras (default ``float32``), ampkit's default global policy is ``auto``.

Keras 3 models: :func:`set_global_policy` also sets Keras' own global policy (``keras.mixed_precision``)
when Keras is imported, or installed with ``KERAS_BACKEND`` set, so layers built afterwards really compute
in 16 bits (on any backend, torch's included): fp16-mixed/fp16-master -> ``mixed_float16``,
bf16-mixed/bf16-master -> ``mixed_bfloat16`` (fp32 variables, 16-bit compute), fp16-pure/bf16-pure ->
``float16``/``bfloat16`` (Keras has no Kahan compensation), fp32 -> ``float32``; fp8 modes have no Keras
policy (a warning, Keras' left as it is). ``LossScaleOptimizer`` is Keras' own (it needs Keras); Keras 3's
``DTypePolicy``/``dtype_policy``/``set_dtype_policy`` are the names of ``Policy``/``global_policy``/
``set_global_policy``. Everything else here is for PyTorch loops (``ampkit.Precision()`` follows the policy).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from typing import Any, Optional, Union

import torch

from .. import precision as core
from ..precision import Precision
from ..precision.auto import canonical
from ..precision.modes import MODES, resolve, valid_names

__all__ = ["Policy", "DTypePolicy", "set_global_policy", "global_policy", "set_dtype_policy", "dtype_policy",
           "keras_policy_name"]

# the Keras policy names, as Keras spells them (their modes come from the alias table, keras dialect)
KERAS_NAMES = {name: resolve(name, dialect="keras")
               for name in ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")}
_KERAS_FOR_MODE = {mode: name for name, mode in KERAS_NAMES.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# ampkit mode -> the Keras policy whose numerics it shares (where the variables live, what computes)
_KERAS_POLICY = {"fp32": "float32", "fp16-mixed": "mixed_float16", "fp16-master": "mixed_float16",
                 "bf16-mixed": "mixed_bfloat16", "bf16-master": "mixed_bfloat16", "fp16-pure": "float16",
                 "bf16-pure": "bfloat16"}


class Policy:
    """A dtype policy: ``name``, ``compute_dtype``, ``variable_dtype`` (strings, as in Keras)."""

    def __init__(self, name: Union[str, "Policy"]) -> None:
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str):
            raise TypeError(f"Policy name must be a string, got {type(name).__name__}.")
        key = name.strip()
        try:
            mode = resolve(key, dialect="keras")
        except ValueError:
            raise ValueError(
                f"Cannot convert {name!r} to a mixed precision Policy. Use 'float32', 'mixed_float16', "
                f"'mixed_bfloat16', 'float16', 'bfloat16', or an ampkit precision ({valid_names()})."
            ) from None
        self._name = key
        self._mode = mode

    @property
    def name(self) -> str:
        return self._name

    @property
    def mode(self) -> str:
        """The ampkit mode (``auto`` resolved for the default device)."""
        return canonical(self._mode)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return MODES[self.mode].low_dtype or torch.float32

    @property
    def torch_variable_dtype(self) -> torch.dtype:
        """Where the trained weights live: the param dtype (fp32 in the master modes: the masters)."""
        return MODES[self.mode].param_dtype

    @property
    def compute_dtype(self) -> str:
        return _DTYPE_NAMES[self.torch_compute_dtype]

    @property
    def variable_dtype(self) -> str:
        return _DTYPE_NAMES[self.torch_variable_dtype]

    def precision(self, device=None, **kwargs) -> Precision:
        """An ``ampkit.Precision`` for this policy (kwargs as Precision's)."""
        return Precision(self._mode, device, **kwargs)

    def autocast(self, device_type: Optional[str] = None):
        """``torch.autocast`` in the compute dtype for the mixed policies, else a no-op context."""
        mode = MODES[self.mode]
        if mode.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device_type=device_type, dtype=mode.autocast_dtype)

    def get_config(self) -> dict:
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict) -> "Policy":
        return cls(config["name"])

    def __eq__(self, other) -> bool:
        return isinstance(other, Policy) and other._mode == self._mode

    def __hash__(self) -> int:
        return hash(self._mode)

    def __repr__(self) -> str:
        return f'<Policy "{self.name}">'


_last_set: Optional[Policy] = None


def keras_policy_name(policy: Union[str, Policy]) -> Optional[str]:
    """The Keras policy name with the numerics of ``policy`` (an ampkit mode, alias or Keras name), or None
    where Keras has none (the fp8 modes)."""
    p = policy if isinstance(policy, Policy) else Policy(policy)
    return _KERAS_POLICY.get(p.mode)


def _keras():
    """Keras, where this process uses it: imported already, or installed with its backend chosen
    (``KERAS_BACKEND``); None otherwise (importing it unasked would pick TensorFlow and take seconds)."""
    if "keras" in sys.modules:
        return sys.modules["keras"]
    if os.environ.get("KERAS_BACKEND") and importlib.util.find_spec("keras") is not None:
        try:
            import keras
        except Exception:  # a broken or backend-less install: PyTorch loops still get their policy
            return None
        return keras
    return None


def _drive_keras(p: Optional[Policy]) -> None:
    keras = _keras()
    if keras is None or not hasattr(keras, "mixed_precision"):
        return
    name = "float32" if p is None else keras_policy_name(p)
    if name is None:
        warnings.warn(f"Keras has no policy for {p.mode!r}: Keras layers keep {keras.mixed_precision.global_policy().name!r} "
                      "(the policy applies to ampkit.Precision() in PyTorch loops).", stacklevel=3)
        return
    keras.mixed_precision.set_global_policy(name)


def set_global_policy(policy: Union[str, Policy, None]) -> None:
    """Set the default for every later ``ampkit.Precision()`` built without a name (None: back to auto), and
    Keras' own global policy where this process uses Keras (see the module docstring)."""
    global _last_set
    if policy is None:
        core.set_global_policy(None)
        _last_set = None
        _drive_keras(None)
        return
    p = policy if isinstance(policy, Policy) else Policy(policy)
    core.set_global_policy(p._mode)
    _last_set = p
    _drive_keras(p)


def global_policy() -> Policy:
    """The global policy as a ``Policy`` (named as it was set, Keras-style where one exists)."""
    current = core.global_policy()
    if _last_set is not None and _last_set._mode == current:
        return _last_set
    return Policy(_KERAS_FOR_MODE.get(current, current))


# Keras 3's names for the same things
DTypePolicy = Policy
set_dtype_policy = set_global_policy
dtype_policy = global_policy


def __getattr__(name: str) -> Any:
    if name == "LossScaleOptimizer":  # Keras' own, for Keras models: it needs Keras
        if importlib.util.find_spec("keras") is None:
            raise ImportError("ampkit.compat.keras.LossScaleOptimizer is Keras' (pip install keras); in a PyTorch "
                              "loop the fp16 modes scale the loss: precision.backward(loss); precision.step(optimizer).")
        try:
            import keras
        except Exception as e:
            raise ImportError(f"ampkit.compat.keras.LossScaleOptimizer is Keras', which did not import ({e}): set "
                              "KERAS_BACKEND (e.g. torch) before importing it.") from e
        return keras.optimizers.LossScaleOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
