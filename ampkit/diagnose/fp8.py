"""FP8 numerics for ``ampkit check``: per converted Linear, what each fp8 recipe does to it.

One bf16-mixed pass over the batch records, for every Linear the fp8 filter would convert, its input,
weight and grad-output. Then, for every recipe (the ones asked for and, as a what-if, the others,
as Transformer Engine's debug stats do), on those recorded tensors:

* the fraction of non-zero values that **underflow** to zero in fp8, and that **saturate** (land
  beyond fp8's max before clamping), per tensor;
* the **SQNR** (dB) of the layer's output and of its two gradients (input, weight) against the bf16
  GEMM, and the **worst row**'s output SQNR (one token): a global figure hides an outlier row
  that flushes every other row, the failure tensor-wise scaling has and row-wise does not.

A layer is ``ok`` when its output SQNR >= 18 dB and gradient SQNR >= 17 dB (torchao's bars), its
worst row >= 10 dB and under 1% of any tensor underflows; ``unsafe`` below 8 dB (any of them) or 10%
underflow; ``risky`` between. A recipe's verdict is its worst layer's; its advice names the layers
to keep in bf16. The model-level SQNR of each requested fp8 mode (the whole model run, output and
all gradients, against bf16-mixed) is measured too. Delayed scaling is judged with a history of
this one batch (its best case): saturation from a growing amax shows in training, not here.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..precision import MODES
from ..precision.auto import FP8_ORDER  # fastest first
from ..precision.fp8 import (DEFAULT_RULE, default_gpu, MIN_FLOP_SHARE, MIN_SPEEDUP, RECIPES, TOKENS, Fp8Filter,
                             gpu_class, amax, coverage, coverage_warning, fake_quantise,
                             gemm_kind, has_fp8_gemm, plan, quantise, saturates, scale_from_amax)
from .runner import prepare, run_once

__all__ = ["fp8_check", "sqnr", "FP8_BARS", "FP8_ORDER"]

#: (ok at or above, unsafe below) in dB; underflow fractions (risky above, unsafe above)
FP8_BARS = {"output_sqnr": (18.0, 8.0), "grad_sqnr": (17.0, 8.0), "worst_row_sqnr": (10.0, 3.0),
            "underflow": (0.01, 0.10)}


def sqnr(ref: torch.Tensor, got: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Signal-to-quantisation-noise ratio in dB: 10 log10(|ref|^2 / |ref - got|^2) (per row with ``dim``)."""
    ref, got = ref.float(), got.float()
    s = ref.pow(2).sum() if dim is None else ref.pow(2).sum(dim)
    n = (ref - got).pow(2).sum() if dim is None else (ref - got).pow(2).sum(dim)
    return 10 * torch.log10(s.clamp(min=1e-30) / n.clamp(min=1e-30))


def _fq(x: torch.Tensor, dtype: torch.dtype, axis: Optional[int], margin: int = 0) -> torch.Tensor:
    return fake_quantise(x, dtype, margin=margin, dim=axis)


def _damage(x: torch.Tensor, dtype: torch.dtype, axis: Optional[int], margin: int) -> Dict[str, float]:
    """The fractions of ``x``'s non-zero values that underflow to 0 and that saturate in fp8."""
    scale = scale_from_amax(amax(x, dim=axis), dtype, margin)
    nz = x != 0
    n = max(int(nz.sum()), 1)
    under = (nz & (quantise(x, scale, dtype).float() == 0)).sum()
    sat = saturates(x, scale, dtype).sum()
    return {"underflow": float(under) / n, "saturated": float(sat) / n}


def _layer_stats(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, recipe) -> Dict[str, Any]:
    """x (M, K), w (N, K), go (M, N), fp32 copies of what the bf16 GEMMs saw."""
    dt = recipe.dtypes()
    row = recipe.rowwise
    margin = getattr(recipe, "margin", 0)
    # the contraction dim of each GEMM is the scaled axis for row-wise (torchao's axiswise scaling)
    ax = lambda a: a if row else None  # noqa: E731
    tensors = {"input": _damage(x, dt["input"], ax(-1), margin), "weight": _damage(w, dt["weight"], ax(-1), margin),
               "grad_output": _damage(go, dt["grad_output"], ax(-1), margin)}
    y_ref, y = x @ w.t(), _fq(x, dt["input"], ax(-1), margin) @ _fq(w, dt["weight"], ax(-1), margin).t()
    gi_ref = go @ w
    gi = _fq(go, dt["grad_output"], ax(-1), margin) @ _fq(w, dt["weight"], ax(0), margin)
    gw_ref = go.t() @ x
    gw = _fq(go, dt["grad_output"], ax(0), margin).t() @ _fq(x, dt["input"], ax(0), margin)
    rows = sqnr(y_ref, y, dim=-1)
    live = y_ref.pow(2).sum(-1) > 0
    return {
        "tensors": tensors,
        "output_sqnr": float(sqnr(y_ref, y)),
        "worst_row_sqnr": float(rows[live].min()) if bool(live.any()) else float("inf"),
        "grad_input_sqnr": float(sqnr(gi_ref, gi)),
        "grad_weight_sqnr": float(sqnr(gw_ref, gw)),
    }


def _judge(s: Dict[str, Any]) -> Dict[str, Any]:
    reasons, level = [], 0
    grad = min(s["grad_input_sqnr"], s["grad_weight_sqnr"])
    for key, value, what in (("output_sqnr", s["output_sqnr"], "output SQNR"), ("grad_sqnr", grad, "gradient SQNR"),
                             ("worst_row_sqnr", s["worst_row_sqnr"], "worst row's output SQNR")):
        ok, bad = FP8_BARS[key]
        if value < ok:
            level = max(level, 2 if value < bad else 1)
            reasons.append(f"{what} {value:.1f} dB < {ok:g}")
    risky, unsafe = FP8_BARS["underflow"]
    for t, d in s["tensors"].items():
        if d["underflow"] > risky:
            level = max(level, 2 if d["underflow"] > unsafe else 1)
            reasons.append(f"{d['underflow']:.1%} of {t} underflows to 0")
    return {"verdict": ("ok", "risky", "unsafe")[level], "reasons": reasons}


def _capture(model: nn.Module, names: Sequence[str], store: Dict[str, Dict[str, torch.Tensor]],
             rows: Optional[int] = None):
    """Context: forward hooks keep each named Linear's input and a hook on its output keeps grad-output
    (the first ``rows`` tokens of each, all without ``rows``)."""
    class Ctx:
        def __enter__(self):
            self.handles = []
            for name in names:
                mod = model.get_submodule(name)

                transposed = gemm_kind(mod) == "conv1d"  # Conv1D stores its weight (in, out)

                def hook(m, args, out, name=name, transposed=transposed):
                    x = args[0]
                    w = m.weight.detach().t() if transposed else m.weight.detach()
                    store[name] = {"input": x.detach().reshape(-1, x.shape[-1])[:rows].float(),
                                   "weight": w.to(x.dtype).float()}
                    if out.requires_grad:
                        out.register_hook(lambda g, name=name: store[name].__setitem__(
                            "grad_output", g.detach().reshape(-1, g.shape[-1])[:rows].float()))
                self.handles.append(mod.register_forward_hook(hook))
            return self

        def __exit__(self, *exc):
            for h in self.handles:
                h.remove()
    return Ctx


def fp8_check(model: nn.Module, batch: Any, loss_fn: Callable, forward_fn: Callable, device: torch.device,
              requested: Sequence[str], skip: Sequence[str] = (), force: Sequence[str] = (),
              rule: Optional[str] = None, gpu: Optional[str] = None, tokens: Optional[int] = None) -> Dict[str, Any]:
    """The ``fp8`` section of the check report (see the module docstring); ``requested``: fp8 modes asked for;
    ``rule``/``gpu``/``tokens``: the filter (``Precision(fp8_filter=, fp8_gpu=, fp8_tokens=)``)."""
    recipe = requested[0] if requested else "fp8-tensorwise"
    filt = Fp8Filter(tuple(skip), tuple(force), rule=rule or DEFAULT_RULE,
                     gpu=gpu or gpu_class(device) or default_gpu(recipe), tokens=TOKENS if tokens is None else tokens,
                     recipe=recipe)
    layout = plan(model, filt)
    cov = coverage(model, filt)
    chosen = [n for n, v in layout.items() if v == "fp8"]
    ref_model, ref_prec = prepare(model, "bf16-mixed", device)
    store: Dict[str, Dict[str, torch.Tensor]] = {}
    ref = run_once(ref_model, ref_prec, batch, forward_fn, loss_fn, forward_ctx=_capture(ref_model, chosen, store))
    layers: Dict[str, Any] = {}
    for name in chosen:
        rec = store.get(name)
        if rec is None or "grad_output" not in rec:
            layers[name] = {"note": "not reached by forward/backward on this batch"}
            continue
        layers[name] = {}
        for mode in FP8_ORDER:
            s = _layer_stats(rec["input"], rec["weight"], rec["grad_output"], RECIPES[mode]())
            layers[name][mode] = {**s, **_judge(s)}
    recipes = {mode: _recipe_verdict(mode, layers, cov, device) for mode in FP8_ORDER}
    model_sqnr = {}
    for mode in requested:
        # each mode judged for its own default GPU (mxfp8: b200), as its end-to-end run in amp_verdicts was: the
        # first recipe's (h100 for fp8-tensorwise) would judge, and warn about, mxfp8 for a GPU without it
        m, p = prepare(model, mode, device, fp8_skip=filt.skip, fp8_force=filt.force, fp8_filter=filt.rule,
                       fp8_gpu=gpu or gpu_class(device) or default_gpu(mode), fp8_tokens=filt.tokens)
        got = run_once(m, p, batch, forward_fn, loss_fn)
        g_ref = [ref.grads[k].reshape(-1) for k in ref.grads if k in got.grads]
        g_got = [got.grads[k].reshape(-1) for k in ref.grads if k in got.grads]
        model_sqnr[mode] = {
            "output_sqnr": float(sqnr(ref.output, got.output)) if got.output.numel() == ref.output.numel() else None,
            "grad_sqnr": float(sqnr(torch.cat(g_ref), torch.cat(g_got))) if g_ref else None,
            "layers_in_fp8": len(p.fp8.layers),
        }
    return {
        "plan": layout,
        "layers": layers,
        "recipes": recipes,
        "model_sqnr": model_sqnr,
        "coverage": {k: v for k, v in cov.items() if k not in ("sizes", "kept")},
        "roofline": _roofline_note(cov) + ("" if gpu or gpu_class(device) else
                                           f"; {filt.target} is the default target class on "
                                           f"{torch.device(device).type} (--fp8-gpu names another)"),
        "recommendation": _recommend(recipes, chosen, cov, device),
        "bars": {k: {"ok": a, "unsafe": b} for k, (a, b) in FP8_BARS.items()},
        "requested": list(requested),
    }


def _share(cov: Dict[str, Any], names: Sequence[str]) -> float:
    total = sum(cov["sizes"].values())
    return sum(cov["sizes"][n] for n in names) / total if total else 0.0


def _recipe_verdict(mode: str, layers: Dict[str, Any], cov: Dict[str, Any], device) -> Dict[str, Any]:
    judged = {n: l[mode] for n, l in layers.items() if mode in l}
    bad = [n for n, v in judged.items() if v["verdict"] != "ok"]
    worst = max((("ok", "risky", "unsafe").index(v["verdict"]) for v in judged.values()), default=0)
    sq = [v["output_sqnr"] for v in judged.values()]
    why_not = coverage_warning(cov, mode)
    return {
        "verdict": ("ok", "risky", "unsafe")[worst],
        "keep_bf16": bad,
        "layers": len(judged),
        "min_output_sqnr": min(sq) if sq else None,
        "reasons": [f"{n}: {'; '.join(judged[n]['reasons'])}" for n in bad],
        # an fp8 mode that converts nothing, or under MIN_FLOP_SHARE of the GEMM FLOPs, is not worth choosing
        "applies": why_not is None,
        "why_not": why_not,
        "emulated": not has_fp8_gemm(device, RECIPES[mode].rowwise),
    }


def _speed_note(mode: str, device, emulated: bool) -> str:
    if emulated:
        return (f" (emulated on {torch.device(device).type}: numerics only, slower than bf16-mixed here; "
                f"on GPUs with fp8 tensor cores {FP8_ORDER[0]} is the fastest recipe)")
    return " (the fastest recipe)" if mode == FP8_ORDER[0] else f"; {FP8_ORDER[0]} does not"


def _recommend(recipes: Dict[str, Dict[str, Any]], chosen: List[str], cov: Dict[str, Any], device) -> Dict[str, Any]:
    if not chosen:
        return {"precision": "bf16-mixed", "keep_bf16": [],
                "reason": f"no Linear/Conv1D qualifies for fp8 under fp8_filter {cov['rule']} "
                          f"({'; '.join(sorted(set(cov['kept'].values()))[:3]) or 'no candidate'}): "
                          "fp8 would change nothing"
                          + ("; --fp8-filter ends (fp8_filter='ends') measures their fp8 numerics anyway"
                             if cov["rule"] == "auto" and cov["roofline_candidates"] else "")}
    if cov["flop_share"] is not None and cov["flop_share"] < MIN_FLOP_SHARE:
        return {"precision": "bf16-mixed", "keep_bf16": [],
                "reason": f"only {cov['converted']} of {cov['candidates']} Linear/Conv1D layers "
                          f"({cov['flop_share']:.0%} of their FLOPs) would run in fp8: not worth an fp8 mode"}
    ok = [m for m in FP8_ORDER if recipes[m]["verdict"] == "ok"]
    if ok:
        note = _speed_note(ok[0], device, recipes[ok[0]]["emulated"])
        return {"precision": ok[0], "keep_bf16": [], "reason": f"every converted layer passes under {ok[0]}{note}"}
    best = min(FP8_ORDER, key=lambda m: (len(recipes[m]["keep_bf16"]), FP8_ORDER.index(m)))
    keep = recipes[best]["keep_bf16"]
    left = [n for n in chosen if n not in keep]
    if not left:
        return {"precision": "bf16-mixed", "keep_bf16": [],
                "reason": "every converted layer fails under every fp8 recipe"}
    if _share(cov, left) < MIN_FLOP_SHARE:
        return {"precision": "bf16-mixed", "keep_bf16": [],
                "reason": f"{best} passes only with {len(keep)} of {len(chosen)} layer(s) in bf16, which leaves "
                          f"{_share(cov, left):.0%} of the Linear/Conv1D FLOPs in fp8: not worth an fp8 mode"}
    return {"precision": best, "keep_bf16": keep,
            "reason": f"{best} passes once {len(keep)} of {len(chosen)} layer(s) stay in bf16 (Precision(fp8_skip=...))"
                      + (f"; emulated on {torch.device(device).type}: numerics only, not a speed claim"
                         if recipes[best]["emulated"] else "")}


def _roofline_note(cov: Dict[str, Any]) -> str:
    """What the per-layer roofline says for the target GPU class, whatever filter the check used."""
    k, n = len(cov["roofline_converts"]), cov["roofline_candidates"]
    head = f"on {cov['gpu']} at {cov['tokens']} tokens per GEMM the roofline gains >= {MIN_SPEEDUP:g}x on {k} of {n} layer(s)"
    if n and not k:
        return head + ": fp8 would not pay for this model there (bf16-mixed is as fast or faster)"
    return head + (f" ({', '.join(cov['roofline_converts'][:5])}{', ...' if k > 5 else ''})" if k else "")


def is_fp8(name: str) -> bool:
    return name in MODES and MODES[name].fp8 is not None
