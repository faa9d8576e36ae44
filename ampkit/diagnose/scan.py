"""Per-module numerics scan, taken on the fp32 reference pass: how close is each layer to fp16's limits?

Measured in fp32 (the true magnitudes; an fp16 run would only show inf), per module:

* ``act_max``: max |output|; ``input_max``: max |input|;
* ``fp16_overflow``: fraction of output elements beyond 65504 (they become inf in fp16);
  ``overflow_source``: the module's input fits fp16 but its output does not (the layer to fix;
  modules downstream only inherit the overflow);
* ``grad_max`` / ``grad_min``: max and smallest non-zero |gradient| (w.r.t. its outputs and its
  own parameters, unscaled);
* ``fp16_underflow``: fraction of non-zero gradient values that become 0 when multiplied by the
  loss scale and cast to fp16 (exact: ``(g * scale).half() == 0``);
* ``grad_overflow``: fraction of gradient values whose scaled value exceeds 65504.

Statistics stay on the device as tensors until :meth:`NumericsScan.finish` (one host sync).
A histogram of gradient exponents (``torch.frexp``) feeds :func:`recommend_init_scale`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .hooks import FP16_MAX, HookSet, display_name, finite_number, iter_tensors

__all__ = ["NumericsScan", "recommend_init_scale", "underflow_fraction_at", "fp32_candidates",
           "HEADROOM", "MAX_INIT_SCALE", "MIN_INIT_SCALE"]

#: the recommended init scale leaves the largest scaled gradient this far below 65504
HEADROOM = 8.0
MAX_INIT_SCALE = 2.0**24  # apex's cap
MIN_INIT_SCALE = 2.0**-16
_EXP_OFFSET = 160  # frexp exponents of finite fp32 values lie in [-148, 128]
_EXP_BINS = 300
_UNDER = 2.0**-25  # half the smallest fp16 subnormal: at or below it, a value rounds to 0
_HIST_SAMPLE = 1 << 16  # elements per tensor fed to the exponent histogram (a strided sample)


class _Acc:
    """Running statistics of one module, as device tensors."""

    def __init__(self, name: str, module: nn.Module, order: int) -> None:
        self.name, self.type, self.order = name, type(module).__name__, order
        self.calls = 0
        self.leaf = not any(True for _ in module.children())
        self.t: Dict[str, List[torch.Tensor]] = {k: [] for k in (
            "act_max", "in_max", "act_over", "act_n", "nonfinite",
            "g_max", "g_min", "g_under", "g_nz", "g_over", "g_n")}

    def add_grad(self, g: torch.Tensor, scale: float) -> None:
        # fp32 -> fp16 rounds |x| <= 2^-25 to zero (ties to even) and |x| > 65504 to inf, so the
        # thresholds below are exact for what `(g * scale).half()` would do
        a = g.detach().float().abs()
        t = self.t
        if not a.numel():
            return
        zeros = (a == 0).sum()
        t["g_max"].append(a.amax())
        t["g_min"].append(torch.where(a > 0, a, torch.full_like(a, math.inf)).amin())
        t["g_under"].append((a <= _UNDER / scale).sum() - zeros)
        t["g_nz"].append(a.numel() - zeros)
        t["g_over"].append((a > FP16_MAX / scale).sum())
        t["g_n"].append(torch.tensor(a.numel(), device=a.device))


class NumericsScan:
    """Hooks every module of the fp32 reference model for one forward/backward.

    Use ``with scan.hooks(): forward`` (the tensor hooks it leaves on outputs fire during the
    backward that follows), then ``scan.finish(param_grads)``.
    """

    def __init__(self, model: nn.Module, loss_scale: float) -> None:
        self.model = model
        self.loss_scale = float(loss_scale)
        self.acc: Dict[str, _Acc] = {}
        self.names = {}
        for name, m in model.named_modules():
            self.names.setdefault(id(m), name)
        self.hist: List[torch.Tensor] = []
        self._stack: List[torch.Tensor] = []

    # ---------------------------------------------------------------- hooks
    def hooks(self) -> HookSet:
        hs = HookSet()
        for _, m in self.model.named_modules():
            hs.add(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            hs.add(m.register_forward_hook(self._post))
        return hs

    def _absmax(self, tensors) -> Optional[torch.Tensor]:
        vals = [t.detach().abs().amax().float() for t in tensors if t.is_floating_point() and t.numel()]
        return torch.stack(vals).amax() if vals else None

    def _pre(self, module, args, kwargs):
        self._stack.append(self._absmax(iter_tensors((args, kwargs))))

    def _post(self, module, args, output):
        in_max = self._stack.pop() if self._stack else None
        name = self.names.get(id(module), "?")
        acc = self.acc.get(name)
        if acc is None:
            acc = self.acc[name] = _Acc(name, module, len(self.acc))
        acc.calls += 1
        outs = [t for t in iter_tensors(output) if t.is_floating_point() and t.numel()]
        t = acc.t
        if in_max is not None:
            t["in_max"].append(in_max)
        for o in outs:
            a = o.detach().float().abs()
            amax = a.amax()  # NaN/inf propagate: the module is non-finite even in fp32
            t["act_max"].append(amax)
            t["act_over"].append((a > FP16_MAX).sum())
            t["act_n"].append(torch.tensor(a.numel(), device=a.device))
            t["nonfinite"].append(~torch.isfinite(amax))
            if o.requires_grad:
                o.register_hook(self._grad_hook(acc))

    def _grad_hook(self, acc: _Acc):
        def hook(grad: torch.Tensor):
            acc.add_grad(grad, self.loss_scale)
            if acc.leaf:
                self._histogram(grad)

        return hook

    def _histogram(self, g: torch.Tensor) -> None:
        """Exponents of a strided sample of the gradient (zeros and non-finite go to a dropped bin)."""
        g = g.detach().reshape(-1)
        if g.numel() > _HIST_SAMPLE:
            g = g[:: g.numel() // _HIST_SAMPLE]
        g = g.float()
        exp = torch.frexp(g).exponent.long() + _EXP_OFFSET
        keep = torch.isfinite(g) & (g != 0)
        exp = torch.where(keep, exp.clamp(0, _EXP_BINS - 1), torch.full_like(exp, _EXP_BINS))
        self.hist.append(torch.bincount(exp, minlength=_EXP_BINS + 1)[:_EXP_BINS])

    # ---------------------------------------------------------------- results
    def finish(self, param_grads: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        """Module statistics (worst first) and the gradient-exponent histogram, after backward."""
        for pname, g in param_grads.items():
            owner = pname.rpartition(".")[0]
            if owner in self.acc:
                self.acc[owner].add_grad(g, self.loss_scale)
            self._histogram(g)
        # one host sync for everything
        keys = []
        flat: List[torch.Tensor] = []
        reducers = {"act_max": "max", "in_max": "max", "g_max": "max", "g_min": "min"}
        for acc in self.acc.values():
            for k, vals in acc.t.items():
                if vals:
                    v = torch.stack([x.float() for x in vals])
                    red = reducers.get(k, "sum")
                    flat.append(v.amax() if red == "max" else v.amin() if red == "min" else v.sum())
                    keys.append((acc.name, k))
        values = dict(zip(keys, torch.stack(flat).tolist() if flat else []))
        hist = torch.stack(self.hist).sum(0).tolist() if self.hist else [0] * _EXP_BINS
        rows = [self._row(acc, values) for acc in self.acc.values()]
        self._mark_sources(rows)
        for r in rows:
            r["flags"] = _flags(r, self.loss_scale)
        rows.sort(key=_severity, reverse=True)
        for r in rows:
            del r["_order"], r["_raw"]
        return {"modules": rows, "histogram": hist, "loss_scale": self.loss_scale}

    def _row(self, acc: _Acc, v: Dict) -> Dict[str, Any]:
        g = lambda k: v.get((acc.name, k))  # noqa: E731
        n, gn, gnz = g("act_n") or 0, g("g_n") or 0, g("g_nz") or 0
        act_max, in_max = g("act_max"), g("in_max")
        g_min = g("g_min")
        return {
            "name": display_name(acc.name),
            "type": acc.type,
            "calls": acc.calls,
            "act_max": finite_number(act_max),
            "input_max": finite_number(in_max),
            "fp16_overflow": (g("act_over") or 0) / n if n else 0.0,
            "overflow_source": False,
            "nonfinite": bool(g("nonfinite")),
            "grad_max": finite_number(g("g_max")) if gn else None,
            "grad_min": finite_number(g_min) if gnz else None,
            "fp16_underflow": (g("g_under") or 0) / gnz if gnz else (0.0 if gn else None),
            "grad_overflow": (g("g_over") or 0) / gn if gn else None,
            "_order": acc.order,
            "_raw": acc.name,
        }

    @staticmethod
    def _mark_sources(rows: List[Dict[str, Any]]) -> None:
        """An overflow source: input fits fp16, output does not, and no submodule explains it."""
        cand = [r for r in rows if r["fp16_overflow"] > 0 and (r["input_max"] or 0.0) <= FP16_MAX]
        names = [r["_raw"] for r in cand]
        for r in cand:
            me = r["_raw"]
            if not any(o != me and (me == "" or o.startswith(me + ".")) for o in names):
                r["overflow_source"] = True


def _frac(x: float) -> str:
    return f"{x:.1%}" if x >= 0.001 else f"{x:.1e}"


def _flags(r: Dict[str, Any], scale: float) -> List[str]:
    f = []
    if r["nonfinite"]:
        f.append("non-finite even in fp32")
    if r["overflow_source"]:
        f.append(f"fp16 overflow starts here ({_frac(r['fp16_overflow'])} of outputs > {FP16_MAX:g})")
    elif r["fp16_overflow"] > 0:
        f.append(f"fp16 overflow inherited ({_frac(r['fp16_overflow'])} of outputs > {FP16_MAX:g})")
    elif (r["input_max"] or 0.0) > FP16_MAX:
        f.append(f"input beyond fp16 range (max {r['input_max']:.3g}): inherited overflow")
    if r["grad_overflow"]:
        f.append(f"{_frac(r['grad_overflow'])} of gradients overflow fp16 at loss scale {scale:g}")
    if r["fp16_underflow"]:
        f.append(f"{_frac(r['fp16_underflow'])} of gradients underflow to 0 in fp16 at loss scale {scale:g}")
    return f


def _severity(r: Dict[str, Any]):
    return (
        r["nonfinite"],
        r["overflow_source"],
        r["fp16_overflow"] > 0 or (r["input_max"] or 0.0) > FP16_MAX,
        r["grad_overflow"] or 0.0,
        r["fp16_underflow"] or 0.0,
        (r["act_max"] or 0.0) / FP16_MAX,
        -r["_order"],
    )


def underflow_fraction_at(hist: List[int], scale: float) -> float:
    """Estimated fraction of non-zero gradients that flush to zero in fp16 at ``scale``.

    A value with frexp exponent e lies in [2^(e-1), 2^e); scaled by 2^k it is certainly below half
    the smallest fp16 subnormal (2^-25, which rounds to 0) when e + k <= -25.
    """
    total = sum(hist)
    if not total:
        return 0.0
    k = math.log2(scale)
    under = sum(c for i, c in enumerate(hist) if (i - _EXP_OFFSET) + k <= -25)
    return under / total


def recommend_init_scale(grad_max: Optional[float], hist: List[int]) -> Dict[str, Any]:
    """The largest power of two that keeps ``grad_max * scale * HEADROOM`` within fp16's 65504.

    Underflow falls as the scale rises and overflow rises with it, so the largest scale that does
    not overflow (with headroom for batches with larger gradients) removes the most underflow.
    Clamped to [2^-16, 2^24]. Also returns the gradient range and the underflow expected there.
    """
    nz = [i - _EXP_OFFSET for i, c in enumerate(hist) if c]
    if not grad_max or not nz:
        return {"init_scale": 2.0**16, "underflow_at_init_scale": 0.0, "grad_binades": None,
                "note": "no non-zero gradients seen: kept torch's default 65536"}
    k = math.floor(math.log2(FP16_MAX / (grad_max * HEADROOM)))
    scale = min(MAX_INIT_SCALE, max(MIN_INIT_SCALE, 2.0**k))
    binades = max(nz) - min(nz) + 1
    under = underflow_fraction_at(hist, scale)
    note = ""
    if under > 0:
        note = (f"gradients span {binades} binades, more than fp16 holds without loss at any scale "
                f"({under:.2%} still underflow): prefer bf16, or keep the modules with the smallest "
                "gradients in fp32")
    return {"init_scale": scale, "underflow_at_init_scale": under, "grad_binades": binades, "note": note}


def fp32_candidates(rows: List[Dict[str, Any]]) -> List[str]:
    """Modules that must run in fp32 for fp16 not to overflow (worst first, innermost only).

    The source of an overflow and every module that receives or produces values beyond 65504
    (an fp32 island's output is cast back to fp16 by the next autocast op, so the consumers of a
    too-large output must be fp32 too). A container is listed only when none of its submodules is.
    """
    from .hooks import ROOT

    big = [r["name"] for r in rows
           if r["fp16_overflow"] > 0 or (r["input_max"] or 0.0) > FP16_MAX]
    raw = ["" if n == ROOT else n for n in big]
    keep = [n for n in raw if not any(o != n and (n == "" or o.startswith(n + ".")) for o in raw)]
    return [n for n in keep if n != ""]
