"""Which GEMM layers run in fp8, the explicit module swap that converts them (torch is never patched),
and how much of the model that covers.

Candidates are ``nn.Linear`` and Conv1D (a Linear with an ``(in, out)`` weight: Hugging Face's GPT-2
projections; :mod:`.detect`). The default filter (``"auto"``) converts one when both its dims are
multiples of 16 (what fp8 tensor cores need), it is neither the model's first nor its last candidate
(embedding-side and output projections are the most sensitive layers; TE and torchao users keep
them in bf16) and its roofline on the target GPU class predicts a gain (:mod:`.roofline`); ``"ends"``
drops the roofline condition, ``"all"`` the first/last one too. ``skip`` names are kept in bf16
whatever their dims; ``force`` names are converted even when first/last or under the roofline (dims
must still be multiples of 16). A name matches a module and everything under it.

:func:`coverage` counts what converts and why the rest does not, with the converted share of the
candidates' FLOPs (a GEMM's FLOPs per token are proportional to its weight's size); ``setup`` warns
when that share is under :data:`MIN_FLOP_SHARE` (an "fp8" run that is mostly bf16-mixed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from .delayed import DelayedScalingConv1D, DelayedScalingLinear, has_fp8_gemm
from .detect import gemm_dims, gemm_kind
from .mx import convert_mx, has_mx_gemm
from .recipes import DelayedScaling, MXFP8Scaling, Recipe
from .roofline import GPUS, TOKENS, default_gpu, estimate

__all__ = ["skip_label", "Fp8Filter", "plan", "convert_to_fp8", "fp8_layers", "coverage", "coverage_warning", "MIN_FLOP_SHARE",
           "RULES", "DEFAULT_RULE", "has_gemm"]

#: below this share of the Linear/Conv1D FLOPs in fp8, ``setup`` warns that the run is mostly bf16
MIN_FLOP_SHARE = 0.5

#: why a candidate stays in bf16 (the keys of ``coverage()["skipped"]``)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
DIMS, ENDS, NAMED, SLOW = "dims not multiples of 16", "first/last layer", "named in fp8_skip", "roofline"
_LABEL = {DIMS: "with dims not multiples of 16", ENDS: "first/last", NAMED: "named in fp8_skip",
          SLOW: "too small to gain (roofline)"}
#: ``fp8_filter`` values: the first/last + dims rule, that plus the per-layer roofline, every layer whose dims fit
RULES = ("ends", "auto", "all")
#: the ``fp8_filter`` used when none is given: a layer converts only where the roofline predicts a gain
DEFAULT_RULE = "auto"


def skip_label(why: str, mult: int = 16) -> str:
    """How a ``coverage()["skipped"]`` key reads after its count ("2 first/last"); ``mult``: the dims' multiple
    the recipe needs (``coverage()["mult"]``: 32 for mxfp8, whose scales cover blocks of 32)."""
    return _LABEL.get(why, why).replace("16", str(mult)) if why == DIMS else _LABEL.get(why, why)


def has_gemm(device, recipe: Recipe) -> bool:
    """Whether ``device`` runs ``recipe``'s GEMMs on tensor cores (else they are emulated)."""
    return has_mx_gemm(device) if isinstance(recipe, MXFP8Scaling) else has_fp8_gemm(device, recipe.rowwise)


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def is_fp8_module(m: nn.Module) -> bool:
    """An fp8 GEMM module: ampkit's (delayed or current scaling) or torchao's own ``Float8Linear``."""
    return bool(getattr(type(m), "fp8_gemm", False)) or type(m).__name__ == "Float8Linear"


@dataclass(frozen=True)
class Fp8Filter:
    """``skip``: layer names (or parents) kept in bf16; ``force``: converted even if first/last or too small;
    ``keep_ends``: keep the first and last Linear/Conv1D in bf16 (default True).

    ``rule``: ``"auto"`` (the default, :data:`DEFAULT_RULE`: dims multiples of 16, not first/last, and the
    layer's roofline on ``gpu`` at ``tokens`` tokens per GEMM predicts at least :data:`.roofline.MIN_SPEEDUP`
    for ``recipe``), ``"ends"`` (dims multiples of 16, not first/last), ``"all"`` (every layer whose dims are
    multiples of 16); ``gpu`` None: :func:`.roofline.default_gpu`.
    """

    skip: Tuple[str, ...] = ()
    force: Tuple[str, ...] = ()
    keep_ends: bool = True
    rule: Optional[str] = None
    gpu: Optional[str] = None
    tokens: int = TOKENS
    recipe: str = "fp8-tensorwise"

    @property
    def target(self) -> str:
        """The GPU class the roofline judges for."""
        return self.gpu or default_gpu(self.recipe)

    def __post_init__(self):
        if self.rule is None:
            object.__setattr__(self, "rule", DEFAULT_RULE)
        if self.rule not in RULES:
            raise ValueError(f"fp8_filter={self.rule!r} is not a filter: use 'auto' (roofline per layer), 'ends' "
                             "(dims multiples of 16, not first/last) or 'all'.")
        if self.gpu is not None and self.gpu not in GPUS:
            raise ValueError(f"fp8_gpu={self.gpu!r} is not a GPU class the roofline knows: use one of "
                             f"{', '.join(GPUS)}.")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"fp8_tokens must be a positive int (tokens per GEMM: batch x sequence, e.g. 8192), "
                             f"got {self.tokens!r}.")
        for field in ("skip", "force"):
            v = getattr(self, field)
            if isinstance(v, str) or not all(isinstance(n, str) and n for n in v):
                raise ValueError(f"fp8 {field} must be a list of module names, got {v!r}.")
            object.__setattr__(self, field, tuple(v))
        clash = set(self.skip) & set(self.force)
        if clash:
            raise ValueError(f"module(s) {sorted(clash)} are both kept in bf16 and forced to fp8: name each once.")

    def check_names(self, model: nn.Module, layers: Sequence[str]) -> None:
        names = {n for n, _ in model.named_modules()}
        unknown = [n for n in self.skip + self.force if n not in names]
        if unknown:
            raise ValueError(f"fp8: no module named {unknown[0]!r} in the model (Linear/Conv1D names: "
                             f"{', '.join(layers) or 'none'}).")


def _decide(model: nn.Module, filt: Optional[Fp8Filter]) -> List[Dict[str, Any]]:
    """One record per candidate GEMM (and per fp8 module already swapped in), in module order."""
    filt = filt if filt is not None else Fp8Filter()
    rows = []
    for name, m in model.named_modules():
        if is_fp8_module(m):
            kind = "conv1d" if getattr(type(m), "transposed", False) or hasattr(m, "nf") else "linear"
            rows.append({"name": name, "kind": kind, "dims": gemm_dims(m, kind), "why": "fp8"})
        else:
            kind = gemm_kind(m)
            if kind is not None:
                rows.append({"name": name, "kind": kind, "dims": gemm_dims(m, kind), "why": None})
    filt.check_names(model, [r["name"] for r in rows])
    ends = {rows[0]["name"], rows[-1]["name"]} if rows and filt.keep_ends and filt.rule != "all" else set()
    for r in rows:
        if r["why"] is not None:
            continue
        i, o = r["dims"]
        forced = _under(r["name"], filt.force)
        r["roofline"] = estimate(i, o, filt.recipe, filt.target, filt.tokens)
        r["mult"] = mult = 32 if filt.recipe == "mxfp8" else 16  # MX scales blocks of 32 along each contraction dim
        if i % mult or o % mult:
            r["why"] = DIMS
        elif _under(r["name"], filt.skip):
            r["why"] = NAMED
        elif r["name"] in ends and not forced:
            r["why"] = ENDS
        elif filt.rule == "auto" and not forced and not r["roofline"]["pays"]:
            r["why"] = SLOW
        else:
            r["why"] = "fp8"
    return rows


def _text(r: Dict[str, Any]) -> str:
    what = "Conv1D" if r["kind"] == "conv1d" else "Linear"
    if r["why"] == SLOW:
        return f"bf16: {r['roofline']['why']}"
    return {"fp8": "fp8", DIMS: f"bf16: dims {r['dims'][0]}x{r['dims'][1]} not multiples of {r.get('mult', 16)}",
            NAMED: "bf16: kept by name", ENDS: f"bf16: first/last {what} (force it by name to convert)"}[r["why"]]


def plan(model: nn.Module, filt: Optional[Fp8Filter] = None) -> Dict[str, str]:
    """``{layer name: "fp8" or the reason it stays bf16}`` for every ``nn.Linear`` and Conv1D of ``model``."""
    return {r["name"]: _text(r) for r in _decide(model, filt)}


def coverage(model: nn.Module, filt: Optional[Fp8Filter] = None) -> Dict[str, Any]:
    """What an fp8 swap covers: ``{"converted", "candidates", "flop_share", "conv1d", "skipped": {why: n},
    "kept": {name: why}, "sizes": {name: in*out}, "convolutions"}`` (``flop_share``: converted share of the candidates' weight sizes,
    None without candidates; ``convolutions``: torch Conv layers, which fp8 does not convert)."""
    rows = _decide(model, filt)
    size = {r["name"]: r["dims"][0] * r["dims"][1] for r in rows}
    done = [r for r in rows if r["why"] == "fp8"]
    skipped: Dict[str, int] = {}
    for r in rows:
        if r["why"] != "fp8":
            skipped[r["why"]] = skipped.get(r["why"], 0) + 1
    total = sum(size.values())
    return {
        "converted": len(done),
        "candidates": len(rows),
        "conv1d": sum(r["kind"] == "conv1d" for r in done),
        "flop_share": (sum(size[r["name"]] for r in done) / total) if total else None,
        "skipped": skipped,
        "kept": {r["name"]: _text(r)[6:] for r in rows if r["why"] != "fp8"},
        "sizes": size,
        "convolutions": sum(isinstance(m, _CONVS) for m in model.modules()),
        "mult": 32 if filt.recipe == "mxfp8" else 16,  # both GEMM dims must be multiples of it
        "layers": [r["name"] for r in done],
        "rule": filt.rule, "gpu": filt.target, "tokens": filt.tokens,
        # what the roofline alone would convert on the target GPU (dims fit, not first/last or named)
        "roofline_converts": [r["name"] for r in rows if r["why"] in ("fp8", SLOW) and r.get("roofline", {}).get("pays")],
        "roofline_candidates": sum(r["why"] in ("fp8", SLOW) for r in rows),
    }


def coverage_warning(cov: Dict[str, Any], mode: str) -> Optional[str]:
    """The setup warning when fp8 covers nothing or under :data:`MIN_FLOP_SHARE` of the GEMM FLOPs (else None)."""
    convs = (f"; its {cov['convolutions']} convolution(s) are not converted by fp8 (Linear/Conv1D only)"
             if cov["convolutions"] else "")
    if not cov["candidates"]:
        return (f"{mode}: the model has no nn.Linear or Conv1D layer, so nothing runs in fp8 and this run is "
                f"bf16-mixed{convs}: use precision='bf16-mixed'.")
    share = cov["flop_share"] or 0.0
    if cov["converted"] and share >= MIN_FLOP_SHARE:
        return None
    mult = cov.get("mult", 32 if mode == "mxfp8" else 16)  # MX scales blocks of 32
    why = ", ".join(f"{n} {skip_label(k, mult)}" for k, n in cov["skipped"].items())
    fix = []
    if ENDS in cov["skipped"]:
        fix.append("fp8_force=[names] converts first/last layers")
    if DIMS in cov["skipped"]:
        fix.append(f"{mode} needs both dims multiples of {mult}")
    if SLOW in cov["skipped"]:
        fix.append(f"on {cov['gpu']} at {cov['tokens']} tokens per GEMM the roofline finds no gain for these layers "
                   f"(fp8_filter='ends' or 'all', --fp8-filter ends|all, converts them anyway; fp8_gpu= and "
                   f"fp8_tokens= state your GPU class and batch x sequence)")
    fix.append("precision='bf16-mixed' runs the same without fp8")
    if not cov["converted"]:
        head = f"{mode}: no layer runs in fp8, so this run is bf16-mixed"
    else:
        head = (f"{mode}: only {cov['converted']} of {cov['candidates']} Linear/Conv1D layers "
                f"({share:.0%} of their FLOPs) run in fp8, so this run is mostly bf16-mixed")
    return f"{head} (of {cov['candidates']} Linear/Conv1D layers, in bf16: {why}){convs}. {'; '.join(fix)}."


def convert_to_fp8(model: nn.Module, recipe: Recipe, filt: Optional[Fp8Filter] = None, device=None,
                   fsdp_all_gather: bool = False) -> nn.Module:
    """Swap the layers :func:`plan` selects for fp8 modules of ``recipe`` (in place; returns the model).

    Linears become fp8 Linears, Conv1Ds fp8 Conv1Ds (same ``(in, out)`` weight, no copy). The GEMM is
    real (``torch._scaled_mm``) on sm89+ GPUs and emulated elsewhere. Parameters are the same objects
    afterwards, so an optimizer built before the swap keeps working; except with ``fsdp_all_gather`` (tensorwise,
    for FSDP2, whose optimizer is built on the shards anyway): the Linears' weights are new Parameters then,
    torchao's fp8-all-gather weights around the same data.
    """
    if gemm_kind(model) is not None:
        raise ValueError("fp8: the model is a single Linear (its first and last layer): wrap it in a module, "
                         "or use a bf16 mode.")
    chosen = {r["name"]: r["kind"] for r in _decide(model, filt) if r["why"] == "fp8"}
    chosen = {n: k for n, k in chosen.items() if not is_fp8_module(model.get_submodule(n))}
    dev = device if device is not None else next((p.device for p in model.parameters()), "cpu")
    emulate = not has_gemm(dev, recipe)
    if isinstance(recipe, MXFP8Scaling):
        return convert_mx(model, chosen, emulate)
    if not isinstance(recipe, DelayedScaling):
        from .current_modules import convert_current  # imports torchao

        return convert_current(model, recipe, chosen, emulate, fsdp_all_gather=fsdp_all_gather)
    for name, kind in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        new = (DelayedScalingLinear.from_linear(old, recipe, emulate=emulate) if kind == "linear"
               else DelayedScalingConv1D.from_conv1d(old, recipe, emulate=emulate))
        setattr(parent, attr, new)
    return model


def fp8_layers(model: nn.Module) -> List[str]:
    """Names of the modules of ``model`` that run fp8 GEMMs (any kind)."""
    return [n for n, m in model.named_modules() if is_fp8_module(m)]
