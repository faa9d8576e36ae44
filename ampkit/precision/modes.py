"""The precision-mode table: canonical names, the aliases users already know, and what each mode does.

One row per mode. Everything else in ampkit (the `Precision` policy, the CLI, the apex and
Keras compatibility layers) resolves names through :func:`resolve`, so an alias accepted in
one place is accepted everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Mode", "MODES", "ALIASES", "KERAS_DIFFERENCES", "resolve", "valid_names"]


@dataclass(frozen=True)
class Mode:
    name: str
    #: dtype the model's parameters are stored in (norm layers stay fp32 in the pure modes; the master
    #: modes store fp32 and compute with 16-bit copies: ``ampkit.precision.convert.ComputeCopies``)
    param_dtype: torch.dtype
    #: dtype that autocast runs eligible ops in; None = autocast off
    autocast_dtype: Optional[torch.dtype]
    #: whether the loss is scaled (dynamic unless a static scale is given)
    scaled: bool
    #: fp32 master weights own the update: the model's own fp32 parameters, computed with 16-bit copies
    master_weights: bool = False
    #: pure low-precision update with a compensation buffer (Kahan) instead of masters
    compensated: bool = False
    summary: str = ""
    #: fp8 recipe name ("tensorwise", "rowwise", "delayed", "mxfp8"): Linears run fp8 GEMMs (ampkit.precision.fp8)
    fp8: Optional[str] = None

    @property
    def low_dtype(self) -> Optional[torch.dtype]:
        """The 16-bit dtype this mode computes in, or None for fp32."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.param_dtype if self.param_dtype != torch.float32 else None

    @property
    def updates_in_16bit(self) -> bool:
        """The update lands in 16-bit weights (no fp32 params, no fp32 masters): the pure kind."""
        return self.kind == "pure"

    @property
    def carries_rounding(self) -> bool:
        """A 16-bit update's rounding is carried (Kahan buffer or stochastic rounding), not lost."""
        return self.compensated

    @property
    def kind(self) -> str:
        """Which class runs this row (``ampkit.precision.kinds``): ``fp32``, ``autocast`` (fp32 params,
        16-bit autocast), ``master`` (fp32 params computed as 16-bit copies: the masters), ``pure`` (16-bit params and
        state, compensated updates where the row says so) or ``fp8`` (bf16 autocast plus fp8 Linears)."""
        if self.fp8 is not None:
            return "fp8"
        if self.master_weights:
            return "master"
        if self.param_dtype != torch.float32:
            return "pure"
        return "fp32" if self.autocast_dtype is None else "autocast"


_f32, _f16, _bf16 = torch.float32, torch.float16, torch.bfloat16

MODES = {
    m.name: m
    for m in [
        Mode("fp32", _f32, None, False, summary="fp32 params and compute, no loss scaling"),
        Mode("fp16-mixed", _f32, _f16, True,
             summary="fp32 params, autocast fp16 compute, loss scaling"),
        Mode("bf16-mixed", _f32, _bf16, False,
             summary="fp32 params, autocast bf16 compute, no loss scaling"),
        Mode("fp16-master", _f32, _f16, True, master_weights=True,
             summary="fp32 params (the master weights), fp16 compute copies (norms fp32), loss scaling"),
        Mode("bf16-master", _f32, _bf16, False, master_weights=True,
             summary="fp32 params (the master weights), bf16 compute copies (norms fp32), no loss scaling"),
        Mode("bf16-pure", _bf16, _bf16, False, compensated=True,
             summary="bf16 params (norms fp32) and optimizer state, compensated updates, no master copy"),
        Mode("fp16-pure", _f16, _f16, True,
             summary="fp16 params (norms fp32), fp16 compute, loss scaling, no master copy"),
        Mode("fp8-tensorwise", _f32, _bf16, False, fp8="tensorwise",
             summary="bf16-mixed with Linears in fp8, one scale per tensor (torchao current scaling)"),
        Mode("fp8-rowwise", _f32, _bf16, False, fp8="rowwise",
             summary="bf16-mixed with Linears in fp8, one scale per row (torchao current scaling)"),
        Mode("fp8-delayed", _f32, _bf16, False, fp8="delayed",
             summary="bf16-mixed with Linears in fp8, scales from an amax history (Transformer Engine's "
                     "delayed scaling, E4M3 forward / E5M2 backward)"),
        Mode("mxfp8", _f32, _bf16, False, fp8="mxfp8",
             summary="bf16-mixed with Linears in MXFP8, one power-of-two scale per 32 elements (torchao MX "
                     "training; emulated off Blackwell)"),
    ]
}

# alias -> canonical name (lower-case keys; lookups are case-insensitive). The one table every entry
# point resolves through: Precision, the CLI (--precision), ampkit.set_global_policy, the Keras policies
# (with KERAS_DIFFERENCES on top) and apex's opt levels (O0-O3, whose table must agree with these rows).
ALIASES = {
    # fp32
    "32": "fp32", "32-true": "fp32", "float32": "fp32", "o0": "fp32", "no": "fp32",
    "none": "fp32", "off": "fp32",
    # fp16 autocast (Lightning, Keras, apex O1, accelerate, torch); a bare dtype name means autocast in it
    "16-mixed": "fp16-mixed", "16": "fp16-mixed", "mixed_float16": "fp16-mixed", "o1": "fp16-mixed",
    "fp16": "fp16-mixed", "amp": "fp16-mixed", "float16-mixed": "fp16-mixed", "float16": "fp16-mixed",
    "half": "fp16-mixed",  # torch.half is float16's other name: a bare dtype name (torch's .half() model: fp16-pure)
    # bf16 autocast
    "bf16-mixed": "bf16-mixed", "mixed_bfloat16": "bf16-mixed", "bf16": "bf16-mixed",
    "bfloat16-mixed": "bf16-mixed", "bfloat16": "bf16-mixed",
    # master weights (apex O2)
    "o2": "fp16-master",
    # pure
    "bf16-true": "bf16-pure", "o3": "fp16-pure", "16-true": "fp16-pure",
    # fp8 (torchao recipe names, Transformer Engine's recipe)
    "float8-tensorwise": "fp8-tensorwise", "float8-rowwise": "fp8-rowwise",
    "fp8-hybrid": "fp8-delayed",
    # MXFP8 (Transformer Engine's recipe, torchao's recipe name)
    "mxfp8blockscaling": "mxfp8", "mxfp8-rceil": "mxfp8", "mx-fp8": "mxfp8",
}

# The only names whose meaning depends on the entry point. In Keras a policy named after a plain dtype
# holds variables *and* compute in it (``Policy("bfloat16")``: bf16 weights, no fp32 copy), so through
# ``ampkit.compat.keras`` these two name the pure modes; everywhere else a bare dtype name means
# autocast in that dtype, as "fp16"/"bf16" do (Lightning, accelerate).
KERAS_DIFFERENCES = {"float16": "fp16-pure", "bfloat16": "bf16-pure"}
DIALECTS = {"ampkit": {}, "keras": KERAS_DIFFERENCES}

AUTO = "auto"


def valid_names() -> str:
    """A one-line listing of every accepted name, for error messages."""
    aliases = ", ".join(f"{a}={c}" for a, c in sorted(ALIASES.items()) if a != c)
    return f"canonical: {', '.join(list(MODES) + [AUTO])}; aliases: {aliases}"


def resolve(name: str, dialect: str = "ampkit") -> str:
    """Map a precision name or alias to its canonical name ('auto' stays 'auto').

    ``dialect="keras"``: Keras' meaning of the names in ``KERAS_DIFFERENCES``.
    Raises ValueError naming every valid choice when the name is unknown.
    """
    if isinstance(name, Mode):
        return name.name
    if not isinstance(name, (str, int)):
        raise ValueError(f"precision must be a string, got {type(name).__name__}. Valid: {valid_names()}")
    key = str(name).strip().lower()
    if key in DIALECTS[dialect]:
        return DIALECTS[dialect][key]
    for k in (key, key.replace("_", "-")):
        if k in MODES or k == AUTO:
            return k
        if k in ALIASES:
            return ALIASES[k]
    raise ValueError(f"Unknown precision {name!r}{_nearest(key)} The modes: {', '.join(list(MODES) + [AUTO])}; "
                     "or an alias (O0-O3, 16-mixed, bf16-true, mixed_bfloat16, ...: ampkit.precision.ALIASES).")


def _nearest(key: str) -> str:
    """': did you mean a, b?' for the names closest to ``key`` (those it begins, else spelled alike), else '.'.
    An alias is offered with the mode it names ('none (= fp32)'), so a suggestion never reads as a mode of its own."""
    import difflib

    names = list(MODES) + [AUTO] + [a for a in ALIASES if a not in MODES]
    found = [n for n in MODES if key and n.startswith(key)] or difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    named = [n if n in MODES or n == AUTO else f"{n} (= {ALIASES[n]})" for n in found]
    return f": did you mean {', '.join(named)}?" if found else "."
