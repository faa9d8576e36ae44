"""Continuing a run in another precision mode (``allow_precision_change``): whether the change is allowed,
refused before anything is timed or written, and how the checkpoint's state is carried over.

What carries over: the weights (cast to the new mode's dtypes; bf16-pure's Kahan compensation folded into
fp32 weights), the learning-rate schedule and the run's position. The optimizer's moments are converted
(cast to the new parameters' dtypes by torch's own ``Optimizer.load_state_dict``; a mode's extra state
such as the Kahan buffers starts afresh) or reset (``precision_change_optimizer="reset"``: a fresh
optimizer at the schedule's learning rate). The loss scaler starts afresh in the new mode.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..precision import Precision
from ..precision.modes import AUTO, resolve
from . import checkpoint as ckpt
from .config import TrainConfig

__all__ = ["requested", "check_precision_change", "carry_over", "MOMENTS"]

#: the optimizer state a conversion keeps (torch's Adam/AdamW/SGD); anything else is the old mode's own
MOMENTS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _is_fp8(name: Optional[str]) -> bool:
    return bool(name) and (name.startswith("fp8") or name.startswith("mx"))


def requested(precision: Any, cfg: TrainConfig) -> Tuple[str, Optional[str]]:
    """(mode asked for, optimizer_state) of a run, before its `Precision` is built: a ready one's, or the
    name given (or the config's) resolved from its alias; ``auto`` stays ``auto``."""
    if isinstance(precision, Precision):
        return (AUTO if precision.requested == AUTO else precision.name), precision.optimizer_state
    return resolve(precision or cfg.precision), cfg.optimizer_state


def check_precision_change(ck: Dict[str, Any], new: str, new_state: Optional[str], cfg: TrainConfig, path: str,
                           fsdp: bool) -> Optional[Tuple[str, str]]:
    """(old mode, new mode) when this run continues the checkpoint in another precision (allowed), None when
    it keeps the checkpoint's; a CheckpointError naming the fix when the change is not allowed or supported.
    ``new``/``new_state``: the mode and optimizer state the run asks for (`requested`). Called before the
    precision is built, before any timing or writing."""
    saved = ck.get("precision") or {}
    old = saved.get("name")
    if old is None or new == AUTO:
        return None  # a resumed auto run keeps its checkpoint's mode
    old_state = saved.get("optimizer_state")
    if old == new and ("optimizer_state" not in saved or old_state == new_state):
        return None
    what = (f"precision {old}, this run asks for {new}" if old != new else
            f"optimizer state {old_state or 'the mode default'}, this run asks for {new_state or 'the mode default'}")
    if not cfg.allow_precision_change:
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} was trained in {what}: resume without --precision/--optimizer-state (a resumed "
            f"run keeps its mode), or pass --allow-precision-change to continue in {new} (the weights carried over, "
            "the optimizer state converted, or reset with --precision-change-optimizer reset; recorded in "
            "config.toml; docs/CHECKPOINTS.md).")
    if _is_fp8(old) or _is_fp8(new) or fsdp or "sharded" in ck:
        why = "an fp8 mode" if _is_fp8(old) or _is_fp8(new) else "an FSDP run or a sharded checkpoint"
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} was trained in {what}: --allow-precision-change does not convert {why}: resume "
            f"in {old} (without --precision), or start a new run from its weights (ampkit.precision.export).")
    if old_state != new_state and cfg.change_optimizer == "convert":
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} kept the optimizer state in {old_state or 'the mode default'}, this run keeps it in "
            f"{new_state or 'the mode default'}: that state is not converted; pass --precision-change-optimizer "
            "reset (a fresh optimizer; the schedule continues), or resume with the checkpoint's --optimizer-state.")
    return old, new


def carry_over(model: torch.nn.Module, optimizer, ck: Dict[str, Any], how: str) -> None:
    """The checkpoint's weights into ``model`` (cast to its dtypes; bf16-pure's compensation folded into fp32
    weights) and its optimizer state into ``optimizer``: ``how`` "convert" (the moments) or "reset" (none; each
    group's learning rate the checkpoint's, where the schedule had brought it)."""
    model.load_state_dict(ck["model"])
    old = ck["optimizer"]
    groups = optimizer.param_groups
    if len(old["param_groups"]) != len(groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(old["param_groups"], groups)):
        raise ckpt.CheckpointError("the checkpoint's optimizer has other parameter groups than this run's: the "
                                   "precision change needs the same model and optimizer.")
    ids = [i for g in old["param_groups"] for i in g["params"]]
    params = [p for g in groups for p in g["params"]]
    with torch.no_grad():  # bf16-pure: weight + its Kahan compensation is the weight it trained to
        folds = [(p, old["state"][i]["compensation"]) for i, p in zip(ids, params)
                 if "compensation" in old["state"].get(i, {}) and p.dtype == torch.float32]
        if folds:
            torch._foreach_add_([p for p, _ in folds], [c.to(p.dtype) for p, c in folds])
    new = optimizer.state_dict()
    new["param_groups"] = [{**n, **{k: o[k] for k in ("lr", "initial_lr") if k in o}}
                           for n, o in zip(new["param_groups"], old["param_groups"])]
    if how == "convert":
        mine = {i: n for a, b in zip(old["param_groups"], new["param_groups"]) for i, n in zip(a["params"], b["params"])}
        new["state"] = {mine[i]: {k: v for k, v in s.items() if k in MOMENTS} for i, s in old["state"].items()
                        if i in mine}
    optimizer.load_state_dict(new)
