"""Run one batch through a copy of the model in one precision: forward, loss, scaled backward.

`check` compares these runs with an fp32 reference. Each precision gets its own deep copy of
the model set up by :class:`ampkit.Precision` exactly as training would set it up (cast params,
norms kept fp32, fp32 islands), so the user's model is never touched. Dropout is switched off in
the copies and every run starts from the same seed, so differences come from precision alone.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..precision import MODES, Precision
from .hooks import iter_tensors, rng_devices
from ..utils.batch import call_model, output_logits, own_loss
from ..utils.copying import copy_model
from ..utils.loss import default_loss
from ..utils.tree import to_device

__all__ = [
    "to_device", "split_batch", "default_forward", "default_loss", "as_loss_fn", "prepare",
    "RunResult", "run_once", "step_fn",
]

SEED = 0


def split_batch(batch: Any) -> Tuple[Any, Any]:
    """(inputs, target): a tensor is inputs only; ``(x, y)`` is inputs and target; a dict is kwargs."""
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        if len(batch) == 0:
            raise ValueError("the batch is empty: pass a tensor, an (inputs, target) pair, or a dict.")
        if len(batch) == 1:
            return batch[0], None
        return batch[0], batch[1]
    return batch, None


def default_forward(model: nn.Module, batch: Any) -> Any:
    """``model(x)`` for a tensor or ``(x, y)`` batch, ``model(**batch)`` for a dict."""
    inputs, _ = split_batch(batch)
    return call_model(model, inputs)


def _check_loss(output: Any, target: Any) -> torch.Tensor:
    """`check`'s default: :func:`default_loss`, and for a batch with neither a target nor a model loss the
    mean square of the output (a stand-in that still sends gradient through every layer)."""
    if target is None and own_loss(output) is None:
        out = output_logits(output)
        if out is None:
            raise ValueError("the model's output holds no floating-point tensor: pass loss_fn=.")
        return out.float().pow(2).mean()
    return default_loss(output, target)


def as_loss_fn(loss_fn: Optional[Callable]) -> Callable[[Any, Any], torch.Tensor]:
    """Accept ``loss_fn(output, target)`` or ``loss_fn(output)``; None = `check`'s default (:func:`_check_loss`)."""
    if loss_fn is None:
        return _check_loss
    try:
        params = [p for p in inspect.signature(loss_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        varargs = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return loss_fn
    if len(params) == 1 and not varargs:
        return lambda output, target: loss_fn(output)
    return loss_fn


def step_fn(forward_fn: Callable, loss_fn: Callable) -> Callable[[nn.Module, Any], torch.Tensor]:
    """forward + loss as one ``f(model, batch) -> loss``, the shape the localiser replays."""
    def f(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(forward_fn(model, batch), split_batch(batch)[1])

    return f


def _disable_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        elif isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0


def prepare(model: nn.Module, name: str, device: torch.device, fp32_modules: Sequence[str] = (),
            **options: Any) -> Tuple[nn.Module, Precision]:
    """A deep copy of ``model`` set up for precision ``name`` (train mode, dropout off); ``options``: more
    ``Precision`` keywords."""
    try:
        clone = copy_model(model)
    except Exception as e:  # a model holding un-copyable state (open files, locks, ...)
        raise ValueError(f"check needs to deep-copy the model to compare precisions, which failed "
                         f"({type(e).__name__}: {e}); make the model copyable with copy.deepcopy.") from e
    _disable_dropout(clone)
    clone.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'fp16 on CPU is slow': known, the check runs anyway
        # untuned: torch's attention kernels (training uses ampkit's only where ampkit.tune measured them faster
        # and switched them on for the model: ampkit.tuning.attention)
        prec = Precision(name, device, fp32_modules=tuple(fp32_modules), channels_last=False, **options)
    clone, _ = prec.setup(clone, None)
    return clone, prec


@dataclass
class RunResult:
    name: str
    output: Optional[torch.Tensor] = None  # all floating outputs, flattened, fp32
    loss: Optional[float] = None
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)  # unscaled, fp32
    nonfinite: Optional[str] = None  # None | "forward" | "loss" | "backward"
    loss_scale: Optional[float] = None  # the scale the gradients were taken at (None: no backward)
    scales_tried: List[float] = field(default_factory=list)
    grad_norm: Optional[float] = None


def _scales(prec: Precision, loss_scale: float) -> List[float]:
    """Scales to try, as a dynamic scaler backs off over skipped steps (16x at a time here), down to 1."""
    if not MODES[prec.name].scaled:
        return [1.0]
    s = float(loss_scale)
    out = [s]
    while s > 1.0:
        s = max(1.0, s / 16.0)
        out.append(s)
    return out


def run_once(
    model: nn.Module,
    prec: Precision,
    batch: Any,
    forward_fn: Callable,
    loss_fn: Callable,
    loss_scale: float = 2.0**16,
    forward_ctx: Optional[Callable[[], Any]] = None,
    backward_ctx: Optional[Callable[[], Any]] = None,
) -> RunResult:
    """Forward + loss under ``prec.autocast()``, then gradients of every trainable parameter.

    Scaled modes back off the loss scale (as the dynamic scaler would over a few skipped steps)
    until the gradients are finite or the scale reaches 1. Gradients come from
    ``torch.autograd.grad``, so nothing accumulates in ``.grad``.
    """
    res = RunResult(prec.name)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fctx = forward_ctx() if forward_ctx is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=rng_devices(prec.device)):
        torch.manual_seed(SEED)
        with fctx, prec.autocast():
            output = forward_fn(model, batch)
            loss = loss_fn(output, split_batch(batch)[1])
    outs = [t.detach().float().reshape(-1) for t in iter_tensors(output) if t.is_floating_point()]
    res.output = torch.cat(outs) if outs else torch.zeros(0)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                         + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "") + ".")
    res.loss = float(loss.detach().float())
    if not bool(torch.isfinite(res.output).all()):
        res.nonfinite = "forward"
        return res
    if not torch.isfinite(torch.tensor(res.loss)):
        res.nonfinite = "loss"
        return res
    if not params or not loss.requires_grad:
        return res
    scales = _scales(prec, loss_scale)
    bctx = backward_ctx() if backward_ctx is not None else contextlib.nullcontext()
    with bctx:
        for i, s in enumerate(scales):
            grads = torch.autograd.grad(loss.float() * s, [p for _, p in params],
                                        retain_graph=i + 1 < len(scales), allow_unused=True)
            res.scales_tried.append(s)
            res.loss_scale = s
            g32 = {n: g.detach().float() / s for (n, _), g in zip(params, grads) if g is not None}
            if all(bool(torch.isfinite(g).all()) for g in g32.values()):
                res.grads = g32
                res.nonfinite = None
                break
            res.nonfinite = "backward"
            res.grads = g32
    if res.nonfinite is None and res.grads:
        res.grad_norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in res.grads.values()])))
    return res
