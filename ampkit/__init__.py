"""ampkit: mixed-precision training for PyTorch that is fast, correct and honest about its numerics.

Core objects are imported eagerly; the heavier parts (trainer, diagnostics, bench, compat)
load on first use so ``import ampkit`` stays cheap.
"""
from ._startup import install_cli_handler

install_cli_handler()  # the `ampkit` command: a Ctrl-C inside any start-up import is one line and exit 130
try:  # torch imports here (seconds): Ctrl-C meanwhile, as the `ampkit` command, is one line and exit 130
    from .precision import (
        LossScaler,
        NonFiniteGradientsError,
        Precision,
        convert_model,
        global_policy,
        set_global_policy,
    )
except KeyboardInterrupt:
    from ._startup import exit_if_cli

    exit_if_cli()
    raise

__version__ = "0.1.0"

# name -> module that defines it (imported lazily)
_LAZY = {
    "tune": "ampkit.tuning",
    "Trainer": "ampkit.train.trainer",
    "TrainConfig": "ampkit.train.config",
    "check": "ampkit.diagnose.check",
    "optim": "ampkit.optim",
    "compat": "ampkit.compat",
    "models": "ampkit.models",
    "data": "ampkit.data",
    "plan": "ampkit.memory",
    "MemoryPlan": "ampkit.memory",
}

__all__ = [
    "LossScaler", "NonFiniteGradientsError", "Precision",
    "convert_model", "global_policy", "set_global_policy", "__version__", *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        # a module exported under its own name (ampkit.models) is the module; otherwise the attribute
        # (ampkit.check is the function ampkit.diagnose.check.check, not the module of that name)
        value = getattr(module, name) if hasattr(module, name) else module
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
