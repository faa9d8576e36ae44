"""The readable text of a check report (the CLI prints it; ``str(ampkit.check(...))`` returns it)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .hooks import FP16_MAX

__all__ = ["format_check", "jsonable"]


def jsonable(obj: Any) -> Any:
    """A copy with NaN/inf floats as None and tuples as lists, so ``json.dumps(..., allow_nan=False)`` holds."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def _g(x: Optional[float], spec: str = ".2g") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else (f"{x:.1%}" if x >= 0.001 else f"{x:.1e}")


def _scale(s: Optional[float]) -> str:
    if s is None:
        return "-"
    import math

    k = math.log2(s)
    return f"2^{int(k)}" if k == int(k) else f"{s:g}"


def _table(headers: List[str], rows: List[List[str]], indent: str = "  ") -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(headers)] + [fmt(r) for r in rows]


def format_check(r: Dict[str, Any], top: int = 10) -> str:
    lines: List[str] = []
    d = r["device"]
    fast = [k for k, v in (("bf16", d["bf16_fast"]), ("fp16", d["fp16_fast"])) if v]
    lines.append(f"Device: {d['device']} ({d['name']}); matrix units: {d['matrix_units']}; "
                 f"fast 16-bit: {', '.join(fast) or 'none'}")
    for note in d.get("notes") or []:
        lines.append(f"  {note}")
    a = r["auto"]
    lines.append(f"auto on this device: {a['device_choice']} ({a['device_reason']})")
    lines.append(f"auto with this check: {a['mode']} ({a['reason']})")
    lines.append("")

    ref = r["reference"]
    lines.append(f"AMP check against fp32 (loss {_g(ref['loss'], '.4g')}, grad norm {_g(ref['grad_norm'], '.3g')}):")
    if ref.get("first_nonfinite"):
        lines.append(f"  fp32 itself is non-finite: {ref['first_nonfinite']['message']}")
    rows = []
    for name, v in r["verdicts"].items():
        rows.append([name, v["verdict"].upper() if v["verdict"] != "ok" else "ok",
                     _g(v.get("output_rel_err")), _g(v.get("loss_rel_err")), _g(v.get("grad_norm_rel_err")),
                     _g(v.get("grad_rel_err")), _pct(v.get("grad_lost")), _scale(v.get("loss_scale"))])
    lines += _table(["precision", "verdict", "output err", "loss err", "grad-norm err", "grad err",
                     "grads lost", "scale"], rows)
    for name, v in r["verdicts"].items():
        for reason in v.get("reasons") or []:
            if reason != "the reference":
                lines.append(f"  {name}: {reason}")
        if v.get("first_nonfinite"):
            lines.append(f"  {name}: {v['first_nonfinite']['message']}")
        fix = v.get("with_fp32_modules")
        if fix:
            lines.append(f"  {name} with fp32 modules {', '.join(fix['modules'])}: {fix['verdict']}"
                         + (f" ({'; '.join(fix['reasons'])})" if fix["reasons"] else ""))
    lines.append("")

    mods = r["modules"]
    lines.append(f"Modules, worst first (fp16 max {FP16_MAX:g}; underflow at loss scale {_scale(r['loss_scale'])}; "
                 f"{min(top, len(mods))} of {len(mods)}):")
    rows = [[m["name"], m["type"], _g(m["act_max"]), _pct(m["fp16_overflow"]), _g(m["grad_max"]),
             _g(m["grad_min"]), _pct(m["fp16_underflow"]), "; ".join(m["flags"]) or "ok"] for m in mods[:top]]
    lines += _table(["module", "type", "max|act|", ">65504", "max|grad|", "min|grad|", "underflow", "flags"], rows)
    g = r["gradients"]
    lines.append(f"  gradients: max {_g(g['max'])}, smallest non-zero {_g(g['min_nonzero'])}"
                 + (f" ({g['binades']} binades)" if g.get("binades") else "")
                 + f"; {_pct(g['underflow_at_loss_scale'])} underflow in fp16 at {_scale(r['loss_scale'])}")
    lines.append("")

    s = r["stale_updates"]
    parts = [f"{dt} {_pct(s[dt]['fraction'])}" for dt in ("bfloat16", "float16") if dt in s]
    if parts:
        lines.append(f"Stale updates (Adam-like step, lr {s['lr']:g}; elements whose update rounds away "
                     f"in 16-bit storage): {', '.join(parts)}")
        worst = s.get("bfloat16", {}).get("worst") or []
        if worst:
            lines.append("  worst in bf16: " + ", ".join(f"{w['name']} {_pct(w['fraction'])}" for w in worst[:3]))
        lines.append("  (fp32 params with autocast or master weights keep these updates; bf16-pure recovers "
                     "them with Kahan compensation)")
        lines.append("")

    for name, recs in (r.get("audit") or {}).items():
        lines.append(f"Dtype audit ({name}): which dtype each op ran in")
        rows = [[e["name"], e["type"], ", ".join(f"{c} {'/'.join(ds)}" for c, ds in e["ops"].items()),
                 "; ".join(e["flags"])] for e in recs]
        shown = [row for row in rows if row[3]][:top] or rows[:min(top, 5)]
        lines += _table(["module", "type", "ops", "flags"], shown)
        if len(shown) < len(rows):
            lines.append(f"  ({len(rows) - len(shown)} more modules without flags; see --json)")
        lines.append("")

    if r.get("fp8"):
        lines += format_fp8(r["fp8"], top)
    if r.get("blockscale"):
        lines += format_blockscale(r["blockscale"], top)
    rec = r["recommendation"]
    lines.append("Recommendation:")
    lines.append(f"  precision:    {rec['precision']}")
    value = f"{rec['init_scale']:.0f}" if rec["init_scale"] >= 1 else f"{rec['init_scale']:g}"
    lines.append(f"  init_scale:   {_scale(rec['init_scale'])} = {value} (from the gradient range; "
                 + ("used by this precision)" if rec["loss_scaling"] else "for fp16 modes; this precision needs no scaling)"))
    lines.append(f"  fp32_modules: {', '.join(rec['fp32_modules']) or 'none'}")
    for note in rec.get("notes") or []:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def format_fp8(f: Dict[str, Any], top: int = 10) -> List[str]:
    """The fp8 section: per-layer damage under each recipe, the model-level SQNR, a verdict per recipe."""
    lines = ["FP8 (per converted Linear, against the bf16 GEMM; what-if for recipes not asked for):"]
    kept = {n: why for n, why in f["plan"].items() if why != "fp8"}
    if kept:
        lines.append("  kept in bf16: " + "; ".join(f"{n} ({why[6:]})" for n, why in kept.items()))
    if f.get("roofline"):
        lines.append(f"  roofline: {f['roofline']}")
    rows = []
    for name, per in list(f["layers"].items())[:top]:
        for mode, s in per.items() if isinstance(per, dict) and "note" not in per else []:
            t = s["tensors"]
            rows.append([name, mode[4:], _pct(t["input"]["underflow"]), _pct(t["weight"]["underflow"]),
                         _pct(t["grad_output"]["underflow"]),
                         _pct(max(d["saturated"] for d in t.values())), f"{s['output_sqnr']:.1f}",
                         f"{s['worst_row_sqnr']:.1f}", f"{min(s['grad_input_sqnr'], s['grad_weight_sqnr']):.1f}",
                         s["verdict"] if s["verdict"] == "ok" else s["verdict"].upper()])
    if rows:
        lines += _table(["layer", "recipe", "in underflow", "w underflow", "gout underflow", "saturated",
                         "out dB", "worst row dB", "grad dB", "verdict"], rows)
    for mode, m in f["model_sqnr"].items():
        lines.append(f"  {mode} whole model vs bf16-mixed: output {_g(m['output_sqnr'], '.1f')} dB, "
                     f"gradients {_g(m['grad_sqnr'], '.1f')} dB ({m['layers_in_fp8']} layer(s) in fp8)")
    why_not = next((v["why_not"] for v in f["recipes"].values() if v.get("why_not")), None)
    if why_not:  # the same for every recipe: the model, not the recipe, leaves fp8 little to do
        lines.append(f"  not worth an fp8 mode: {why_not.split(': ', 1)[1]}")
    for mode, v in f["recipes"].items():
        asked = "" if mode in f["requested"] else " (what-if)"
        level = v["verdict"].upper() if v["verdict"] != "ok" else "ok"
        lines.append(f"  {mode}{asked}: {level if v.get('applies', True) else 'n/a (too little converts)'}"
                     + (f"; keep in bf16: {', '.join(v['keep_bf16'])}" if v["keep_bf16"] else ""))
        for reason in v["reasons"][:3]:
            lines.append(f"    {reason}")
    rec = f["recommendation"]
    lines.append(f"  fp8 advice: {rec['precision']}"
                 + (f" with {', '.join(rec['keep_bf16'])} in bf16" if rec["keep_bf16"] else "")
                 + f" ({rec['reason']})")
    lines.append("")
    return lines


def format_blockscale(b: Dict[str, Any], top: int = 10) -> List[str]:
    """The block-scaled section: per layer and format the GEMM SQNRs and the worst operand; a verdict per format."""
    lines = [f"Block-scaled formats (per GEMM layer against the fp32 GEMM of its bf16 operands, first "
             f"{b['max_rows']} tokens; what-if for formats not asked for):"]
    rows = []
    for name, per in list(b["layers"].items())[:top]:
        for fmt, s in per.items():
            ops = s["operands"]
            ch = min(ops, key=lambda o: ops[o]["worst_channel_sqnr"])
            und = max(ops, key=lambda o: ops[o]["underflow"])
            lo = min(o["scale_log2"][0] for o in ops.values())
            hi = max(o["scale_log2"][1] for o in ops.values())
            rows.append([name, fmt, f"{s['output_sqnr']:.1f}", f"{s['grad_input_sqnr']:.1f}",
                         f"{s['grad_weight_sqnr']:.1f}", f"{ch} {ops[ch]['worst_channel_sqnr']:.1f}",
                         f"{und} {_pct(ops[und]['underflow'])}", _pct(max(o["saturated"] for o in ops.values())),
                         f"2^{lo:g}..2^{hi:g}", s["verdict"] if s["verdict"] == "ok" else s["verdict"].upper()])
    if rows:
        lines += _table(["layer", "format", "out dB", "dgrad dB", "wgrad dB", "worst channel dB",
                         "most underflow", "saturated", "scales", "verdict"], rows)
    for fmt, v in b["recipes"].items():
        asked = "" if fmt in b["requested"] else " (what-if)"
        level = v["verdict"] if v["verdict"] == "ok" else v["verdict"].upper()
        lines.append(f"  {fmt}{asked}: {level if v['applies'] else 'not worth it'}; {v['reason']} "
                     f"(needs {v['hardware']})")
        kept = v["keep_bf16"]
        if kept:
            lines.append("    keep in bf16: " + "; ".join(f"{n} ({why})" for n, why in list(kept.items())[:top])
                         + (f"; {len(kept) - top} more" if len(kept) > top else ""))
    lines.append("")
    return lines
