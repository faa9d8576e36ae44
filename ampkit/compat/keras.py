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
Unlike Keras (default ``float32``), ampkit's default global policy is ``auto``.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from ..precision import Precision, global_policy as _core_global_policy, set_global_policy as _core_set_global_policy
from ..precision.device import auto_mode
from ..precision.modes import AUTO, MODES, resolve, valid_names

__all__ = ["Policy", "set_global_policy", "global_policy"]

# the Keras policy names, as Keras spells them (their modes come from the alias table, keras dialect)
KERAS_NAMES = {name: resolve(name, dialect="keras")
               for name in ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")}
_KERAS_FOR_MODE = {mode: name for name, mode in KERAS_NAMES.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


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
        return auto_mode(None)[0] if self._mode == AUTO else self._mode

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return MODES[self.mode].low_dtype or torch.float32

    @property
    def torch_variable_dtype(self) -> torch.dtype:
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


def set_global_policy(policy: Union[str, Policy, None]) -> None:
    """Set the default for every later ``ampkit.Precision()`` built without a name (None: back to auto)."""
    global _last_set
    if policy is None:
        _core_set_global_policy(None)
        _last_set = None
        return
    p = policy if isinstance(policy, Policy) else Policy(policy)
    _core_set_global_policy(p._mode)
    _last_set = p


def global_policy() -> Policy:
    """The global policy as a ``Policy`` (named as it was set, Keras-style where one exists)."""
    current = _core_global_policy()
    if _last_set is not None and _last_set._mode == current:
        return _last_set
    return Policy(_KERAS_FOR_MODE.get(current, current))
