"""Which module made the numbers non-finite? Replays one batch with hooks and names it.

Cheap when nothing is wrong: no hook is installed during training. After a failure (a
non-finite loss, or the scaler skipping K steps in a row) the caller replays the failing batch
through :func:`localise_nonfinite`, which hooks every module for that one forward/backward and
removes the hooks again. Buffers (BatchNorm statistics) and the RNG are restored afterwards and
gradients come from ``torch.autograd.grad``, so the replay leaves the training run unchanged.

Forward: the first module (in completion order, so the innermost) whose output holds NaN/inf
while its input was finite. Backward, at the first non-finite gradient: the innermost module
whose gradient w.r.t. its output was finite while the gradient w.r.t. its input or one of its
own parameters was not; else the loss, or the code between modules that consumed an output.

The forward and backward searches share one replay (hooks, restored buffers and RNG) and one report.

Trainer use::

    report = localise_nonfinite(model, batch, lambda m, b: loss_fn(m(b[0]), b[1]), precision)
    if report:
        log.warning(format_report(report))
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..precision import MODES, Precision
from ..precision.auto import canonical
from ..utils.copying import copy_model
from .hooks import FP16_MAX, HookSet, display_name, iter_tensors, state_snapshot, tensor_range
from .runner import to_device

__all__ = ["localise_nonfinite", "format_report"]


def _floats(obj) -> List[torch.Tensor]:
    return [t for t in iter_tensors(obj) if t.is_floating_point()]


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _resolve_precision(precision, model: nn.Module, loss_scale: Optional[float]):
    """(model to run, autocast context factory, loss scale, precision name)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if isinstance(precision, Precision):
        scale = loss_scale if loss_scale is not None else (precision.loss_scale if precision.mode.scaled else 1.0)
        return model, precision.autocast, float(scale), precision.name
    if precision is None:
        return model, contextlib.nullcontext, float(loss_scale or 1.0), "fp32"
    name = canonical(precision, device)
    mode = MODES[name]
    scale = float(loss_scale) if loss_scale is not None else (2.0**16 if mode.scaled else 1.0)
    params_fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    if mode.kind in ("master", "pure") and params_fp32:  # 16-bit weights: cast in place or as compute copies
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prec = Precision(name, device, channels_last=False, op_policy=False)
        model, _ = prec.setup(copy_model(model), None)
        return model, prec.autocast, scale, name
    if mode.autocast_dtype is None:
        return model, contextlib.nullcontext, scale, name
    return model, (lambda: torch.autocast(device.type, dtype=mode.autocast_dtype)), scale, name


def _grad_range(grad: torch.Tensor, ok: bool) -> Dict[str, Any]:
    if not ok:
        return tensor_range([grad])
    lo, hi = torch.aminmax(grad.detach().float()) if grad.numel() else (torch.zeros(()), torch.zeros(()))
    lo, hi = float(lo), float(hi)
    return {"dtype": str(grad.dtype).replace("torch.", ""), "shape": list(grad.shape), "min": lo, "max": hi,
            "absmax": max(abs(lo), abs(hi)), "nan": 0, "inf": 0}


def _merge(ranges: List[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """One range over several gradients of the same module (a module called more than once)."""
    ranges = [r for r in ranges if r]
    if not ranges:
        return None
    if len(ranges) == 1:
        return ranges[0]
    lows = [r["min"] for r in ranges if r["min"] is not None]
    highs = [r["max"] for r in ranges if r["max"] is not None]
    lo, hi = (min(lows), max(highs)) if lows else (None, None)
    return {"dtype": ranges[0]["dtype"], "shape": ranges[0]["shape"], "min": lo, "max": hi,
            "absmax": max(abs(lo), abs(hi)) if lows else None,
            "nan": sum(r["nan"] for r in ranges), "inf": sum(r["inf"] for r in ranges)}


class _Watch:
    """Forward and backward hooks on every module for one replay."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: Dict[int, str] = {}
        for name, m in model.named_modules():
            self.names.setdefault(id(m), name)
        self.stack: List[Tuple[str, list]] = []
        self.forward_bad: Optional[Dict[str, Any]] = None
        self.input_bad = False
        # backward events: (kind 'out'|'in'|'param', module name, finite, value range, param name,
        # identity of the gradient tensor); ranges, not gradients, are kept so the replay holds no
        # extra activation-sized memory
        self.events: List[Tuple[str, str, bool, Dict[str, Any], Optional[str], tuple]] = []

    def install(self, hooks: HookSet) -> None:
        for name, m in self.model.named_modules():
            hooks.add(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            hooks.add(m.register_forward_hook(self._post))
            for pname, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    full = f"{name}.{pname}" if name else pname
                    hooks.add(p.register_hook(self._grad_hook("param", name, full)))

    def _grad_hook(self, kind: str, module: str, pname: Optional[str] = None):
        def hook(grad: torch.Tensor):
            ok = bool(torch.isfinite(grad).all())
            ident = (grad.data_ptr(), tuple(grad.shape), grad.dtype)
            self.events.append((kind, module, ok, _grad_range(grad, ok), pname, ident))

        return hook

    def _pre(self, module, args, kwargs):
        name = self.names.get(id(module), "?")
        inputs = _floats((args, kwargs))
        self.stack.append((name, inputs))
        if name == "" and not _finite(inputs):
            self.input_bad = True
        if torch.is_grad_enabled():
            for t in inputs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook("in", name))

    def _post(self, module, args, output):
        name, inputs = self.stack.pop() if self.stack else (self.names.get(id(module), "?"), [])
        outs = _floats(output)
        if self.forward_bad is None and not _finite(outs):
            self.forward_bad = {
                "module": name,
                "type": type(module).__name__,
                "input_finite": _finite(inputs),
                "input": tensor_range(inputs),
                "output": tensor_range(outs),
            }
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook("out", name))

    def backward_culprit(self) -> Optional[Dict[str, Any]]:
        """The module where the backward first turned non-finite.

        The first non-finite event decides. Hooks on one tensor fire one after another with the
        same gradient (the output of one module is the input of the next), so the events sharing
        the first one's gradient are read together: a module whose *input* (or own parameter)
        gradient is among them produced it (its output gradient was finite before); if only
        output gradients are, the gradient came from the loss (the model's own output) or from
        code between modules.
        """
        first = next((i for i, e in enumerate(self.events) if not e[2]), None)
        if first is None:
            return None
        key = self.events[first][5]
        group = [self.events[first]]
        for e in self.events[first + 1:]:
            if e[5] != key or e[2]:
                break
            group.append(e)
        modules = dict(self.model.named_modules())
        made = [e[1] for e in group if e[0] in ("in", "param")]
        if made:
            # the innermost module that received finite gradients and produced this one
            name = max(made, key=lambda n: (n.count(".") + (n != ""), -made.index(n)))
            upto = self.events[: first + len(group)]
            outs = [r for k, n, _, r, _, _ in upto if k == "out" and n == name]
            ins = [r for k, n, _, r, _, _ in upto if k == "in" and n == name]
            params = [r for k, n, _, r, _, _ in self.events if k == "param" and n == name]
            bad_param = next((p for k, n, ok, _, p, _ in group if k == "param" and n == name and not ok), None)
            return {
                "stage": "backward",
                "module": name,
                "type": type(modules[name]).__name__ if name in modules else "?",
                "grad_output": _merge(outs),
                "grad_input": _merge(ins),
                "param": bad_param,
                "param_grad": _merge(params),
            }
        outs_bad = [e[1] for e in group]
        # the loss's gradient, or code in a parent's forward that consumes this (outermost) output
        name = "" if "" in outs_bad else min(outs_bad, key=lambda n: n.count("."))
        return {
            "stage": "loss-backward" if name == "" else "backward",
            "module": name,
            "type": type(modules[name]).__name__ if name in modules else "?",
            "grad_output": _merge([e[3] for e in group if e[1] == name]),
            "between_modules": name != "",
        }


def localise_nonfinite(
    model: nn.Module,
    batch: Any,
    forward_fn: Callable[[nn.Module, Any], Any],
    precision: Any = None,
    *,
    loss_scale: Optional[float] = None,
    backward: bool = True,
) -> Optional[Dict[str, Any]]:
    """Replay ``batch`` and name the first module whose output (or gradient) became non-finite.

    Args:
        model: the model as it trains (already set up by ``precision``).
        batch: the failing batch (moved to the model's device here).
        forward_fn: ``forward_fn(model, batch) -> loss`` (forward + loss, as the training step does);
            a non-scalar return is checked in forward only.
        precision: the :class:`ampkit.Precision` the model was set up with (its autocast and current
            loss scale are used), a precision name (a copy of the model is set up for modes that cast
            parameters), or None for plain fp32.
        loss_scale: override the scale the backward replay multiplies the loss by.
        backward: also replay the (scaled) backward when forward and loss are finite.

    Returns None when the replay is all finite, else a dict: ``stage`` ('input', 'forward',
    'loss', 'backward' or 'loss-backward'), ``module`` (name, '' = the model itself), ``type``,
    ``precision``, ``loss_scale``, value ranges (``input``/``output`` or ``grad_output``/
    ``grad_input``/``param_grad``: dtype, shape, min, max, absmax, nan, inf) and ``message``
    (one line; :func:`format_report` gives the full text).
    """
    run_model, autocast, scale, name = _resolve_precision(precision, model, loss_scale)
    device = next((p.device for p in run_model.parameters()), torch.device("cpu"))
    batch = to_device(batch, device)
    watch = _Watch(run_model)
    report: Optional[Dict[str, Any]] = None
    with state_snapshot(run_model, device), HookSet() as hooks:
        watch.install(hooks)
        with torch.enable_grad(), autocast():
            loss = forward_fn(run_model, batch)
        if watch.input_bad:
            report = {"stage": "input", "module": "", "type": type(run_model).__name__,
                      "input": tensor_range(_floats(batch))}
        elif watch.forward_bad is not None:
            report = {"stage": "forward", **watch.forward_bad}
        elif isinstance(loss, torch.Tensor) and loss.numel() == 1:
            if not bool(torch.isfinite(loss).all()):
                report = {"stage": "loss", "module": None, "type": None, "loss": float(loss.detach().float())}
            elif backward and loss.requires_grad:
                params = [p for p in run_model.parameters() if p.requires_grad]
                torch.autograd.grad(loss.float() * scale, params, allow_unused=True)
                report = watch.backward_culprit()
        elif not _finite(_floats(loss)):
            report = {"stage": "forward", "module": "", "type": type(run_model).__name__,
                      "input_finite": True, "input": None, "output": tensor_range(_floats(loss))}
    if report is None:
        return None
    report.update(precision=name, loss_scale=scale)
    report["message"] = _message(report)
    return report


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _range_text(r: Optional[Dict[str, Any]]) -> str:
    if not r:
        return "none"
    bad = []
    if r["nan"]:
        bad.append(f"{r['nan']} NaN")
    if r["inf"]:
        bad.append(f"{r['inf']} inf")
    finite = f"finite values in [{_fmt(r['min'])}, {_fmt(r['max'])}]" if r["min"] is not None else "no finite values"
    return f"{r['dtype']}{r['shape']} {finite}" + (f", {', '.join(bad)}" if bad else "")


def _message(r: Dict[str, Any]) -> str:
    where = f"{display_name(r['module'])!r} ({r['type']})" if r.get("module") is not None else ""
    stage = r["stage"]
    if stage == "input":
        return f"the batch itself holds non-finite values ({_range_text(r['input'])}): clean the data."
    if stage == "forward":
        if not r.get("input_finite", True):
            return (f"forward: the input of {where} was already non-finite: produced by code between "
                    f"modules (in its parent's forward), under {r['precision']}.")
        out = r.get("output") or {}
        hint = ""
        inp = r.get("input") or {}
        if r["precision"].startswith("fp16") and out.get("inf"):
            hint = (f"; fp16 overflow (max {FP16_MAX:g}): keep it in fp32 (--fp32-modules "
                    f"{r['module'] or '<name>'}) or use bf16")
        return (f"forward: first non-finite output at {where} under {r['precision']}: input "
                f"absmax {_fmt(inp.get('absmax'))} -> output {out.get('nan', 0)} NaN, {out.get('inf', 0)} inf{hint}.")
    if stage == "loss":
        return (f"forward finite, but the loss is {r.get('loss')} under {r['precision']}: "
                "check the loss function and the targets.")
    if stage == "loss-backward":
        return (f"backward: the gradient of the loss w.r.t. the model output is non-finite at loss "
                f"scale {r['loss_scale']:g}: lower the loss scale or compute the loss in fp32.")
    if r.get("between_modules"):
        return (f"backward: the gradient w.r.t. the output of {where} is non-finite at loss scale "
                f"{r['loss_scale']:g}: produced by the code that consumes that output in its parent's forward.")
    what = f"parameter {r['param']!r}" if r.get("param") else "input"
    return (f"backward: first non-finite gradient at {where} under {r['precision']} (loss scale "
            f"{r['loss_scale']:g}): gradient of its output finite (absmax "
            f"{_fmt((r.get('grad_output') or {}).get('absmax'))}), gradient of its {what} non-finite.")


def format_report(report: Optional[Dict[str, Any]]) -> str:
    """Multi-line text of a :func:`localise_nonfinite` report (for logs and the CLI)."""
    if not report:
        return "non-finite localisation: the replay was finite (the failure did not reproduce)."
    lines = [f"non-finite localisation ({report['precision']}, loss scale {report['loss_scale']:g}):",
             f"  {report['message']}"]
    if report.get("module") is not None:
        lines.append(f"  module: {display_name(report['module'])} ({report['type']})")
    for key, label in (("input", "input"), ("output", "output"), ("grad_output", "grad of output"),
                       ("grad_input", "grad of input"), ("param_grad", "grad of params")):
        if key in report:
            lines.append(f"  {label + ':':16s}{_range_text(report[key])}")
    if report.get("param"):
        lines.append(f"  non-finite parameter gradient: {report['param']}")
    return "\n".join(lines)
