"""Which Linears run in fp8, and the explicit module swap that converts them (torch is never patched).

The default filter converts an ``nn.Linear`` when both its dims are multiples of 16 (what fp8
tensor cores need) and it is neither the model's first nor its last Linear (embedding-side and
output projections are the most sensitive layers; TE and torchao users keep them in bf16).
``skip`` names are kept in bf16 whatever their dims; ``force`` names are converted even when
first/last (dims must still be multiples of 16). A name matches a module and everything under it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from torch import nn

from .current import convert_current
from .delayed import DelayedScalingLinear, has_fp8_gemm
from .recipes import DelayedScaling, Recipe

__all__ = ["Fp8Filter", "plan", "convert_to_fp8", "fp8_layers"]


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Fp8Filter:
    """``skip``: Linear names (or parents) kept in bf16; ``force``: converted even if first/last;
    ``keep_ends``: keep the first and last Linear in bf16 (default True)."""

    skip: Tuple[str, ...] = ()
    force: Tuple[str, ...] = ()
    keep_ends: bool = True

    def __post_init__(self):
        for field in ("skip", "force"):
            v = getattr(self, field)
            if isinstance(v, str) or not all(isinstance(n, str) and n for n in v):
                raise ValueError(f"fp8 {field} must be a list of module names, got {v!r}.")
            object.__setattr__(self, field, tuple(v))
        clash = set(self.skip) & set(self.force)
        if clash:
            raise ValueError(f"module(s) {sorted(clash)} are both kept in bf16 and forced to fp8: name each once.")

    def check_names(self, model: nn.Module) -> None:
        names = {n for n, _ in model.named_modules()}
        unknown = [n for n in self.skip + self.force if n not in names]
        if unknown:
            raise ValueError(f"fp8: no module named {unknown[0]!r} in the model (Linear names: "
                             f"{', '.join(n for n, m in model.named_modules() if isinstance(m, nn.Linear))}).")


def plan(model: nn.Module, filt: Fp8Filter = Fp8Filter()) -> Dict[str, str]:
    """``{linear name: "fp8" or the reason it stays bf16}`` for every ``nn.Linear`` of ``model``."""
    filt.check_names(model)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    ends = {linears[0][0], linears[-1][0]} if linears and filt.keep_ends else set()
    out = {}
    for name, m in linears:
        if m.in_features % 16 or m.out_features % 16:
            out[name] = f"bf16: dims {m.in_features}x{m.out_features} not multiples of 16"
        elif _under(name, filt.skip):
            out[name] = "bf16: kept by name"
        elif name in ends and not _under(name, filt.force):
            out[name] = "bf16: first/last Linear (force it by name to convert)"
        else:
            out[name] = "fp8"
    return out


def convert_to_fp8(model: nn.Module, recipe: Recipe, filt: Fp8Filter = Fp8Filter(), device=None) -> nn.Module:
    """Swap the Linears :func:`plan` selects for fp8 Linears of ``recipe`` (in place; returns the model).

    The GEMM is real (``torch._scaled_mm``) on sm89+ GPUs and emulated elsewhere. Parameters are the
    same objects afterwards, so an optimizer built before the swap keeps working.
    """
    chosen = {n for n, v in plan(model, filt).items() if v == "fp8"}
    if isinstance(model, nn.Linear):
        raise ValueError("fp8: the model is a single Linear (its first and last layer): wrap it in a module, "
                         "or use a bf16 mode.")
    dev = device if device is not None else next((p.device for p in model.parameters()), "cpu")
    emulate = not has_fp8_gemm(dev, recipe.rowwise)
    keep = lambda m, name: name in chosen  # noqa: E731
    if isinstance(recipe, DelayedScaling):
        for name in chosen:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, DelayedScalingLinear.from_linear(getattr(parent, attr), recipe, emulate=emulate))
        return model
    return convert_current(model, recipe, keep, emulate)


def fp8_layers(model: nn.Module) -> List[str]:
    """Names of the modules of ``model`` that run fp8 GEMMs (either kind)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, DelayedScalingLinear) or type(m).__name__ == "Float8Linear"]
