"""Compatibility layers for code written against other mixed-precision APIs.

* ``ampkit.compat.apex``: NVIDIA apex's ``amp``, ``fp16_utils``, ``optimizers`` (FusedAdam,
  FusedSGD), ``normalization`` and ``parallel``, on ampkit's policies, scaler and master weights;
* ``ampkit.compat.keras``: Keras' ``Policy`` / ``set_global_policy`` / ``global_policy``;
* ``ampkit.compat.torch_amp``: the deprecated ``torch.cuda.amp.autocast`` / ``GradScaler``
  spellings, device-agnostic.

docs/MIGRATING.md shows each side by side. Submodules load on first use.
"""
import importlib

__all__ = ["apex", "keras", "torch_amp"]


def __getattr__(name):
    if name in __all__:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
