"""An optimizer that skips inside its kernel (``_step_supports_amp_scaling``: torch's fused Adam/AdamW/SGD, ampkit's
compensated optimizers) takes the scale and the found-inf flag as its ``grad_scale``/``found_inf`` attributes for one
``step()``: the skip decision never reaches the host. Under ``torch.compile`` the hand-over cannot always be traced:

* torch < 2.12: Dynamo wraps an optimizer without attribute-mutation tracking, so setting ``grad_scale`` on it in a
  traced region is an internal AssertionError ("Attempted setattr on a user-defined object that does not have an
  AttributeMutation mutation_type"; fixed in torch 2.12's ``VariableBuilder``);
* every torch of the window: torch's own ``Optimizer.step`` (and an LR scheduler's wrapper around it) breaks the
  graph on purpose, and Dynamo drops an attribute set in an inlined frame before that break.

There :func:`step_outside_graph` hands the two tensors over and steps eagerly: the one graph break sits at that call
instead of inside ``Optimizer.step`` (which breaks there anyway), the scale and flag stay device tensors (no host
sync). ampkit's compensated optimizers trace whole on torch >= 2.12 and take the attributes inside the graph.
``LossScaler.step`` (fp16) and ``ampkit.precision.step`` (the unscaled modes' guard) both ask
:func:`steps_outside_graph`."""
from __future__ import annotations

import torch

__all__ = ["DYNAMO_SETS_OPTIMIZER_ATTRS", "step_outside_graph", "steps_outside_graph"]

#: whether Dynamo can set attributes on a ``torch.optim.Optimizer`` inside a traced region (torch >= 2.12)
DYNAMO_SETS_OPTIMIZER_ATTRS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)


def steps_outside_graph(optimizer) -> bool:
    """Whether, under ``torch.compile``, ``optimizer`` takes ``grad_scale``/``found_inf`` and steps outside the graph
    (:func:`step_outside_graph`): on torch < 2.12 always; on later ones for torch's optimizers and an optimizer whose
    step an LR scheduler wrapped (they break the graph at the step anyway)."""
    return (not DYNAMO_SETS_OPTIMIZER_ATTRS or type(optimizer).__module__.startswith("torch.")
            or hasattr(optimizer.step, "_wrapped_by_lr_sched"))


@torch.compiler.disable
def step_outside_graph(optimizer, grad_scale, found_inf, args, kwargs):
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale``/``found_inf`` handed over as attributes for that
    step, run eagerly (see the module docstring)."""
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf
