"""FP8 recipes: how each tensor of a Linear is scaled into fp8, as frozen dataclasses checked on construction.

Four recipes, one per fp8 mode:

* :class:`TensorwiseScaling` (``fp8-tensorwise``): current scaling, one scale per tensor from
  this step's amax (torchao's ``tensorwise`` recipe);
* :class:`RowwiseScaling` (``fp8-rowwise``): current scaling, one scale per row along the
  contraction dimension (torchao's ``rowwise``): an outlier token only costs its own row;
* :class:`DelayedScaling` (``fp8-delayed``): Transformer Engine's recipe, the scale taken from a
  history of past amaxes (``max`` or ``most_recent`` of the last ``amax_history_len`` steps),
  divided by ``2**margin``; ``HYBRID`` = E4M3 forward (input, weight), E5M2 backward (grad-output);
* :class:`MXFP8Scaling` (``mxfp8``): block scaling, one E8M0 (power-of-two) scale per 32 elements
  (torchao's MX training; real on sm100+, emulated with the same casts elsewhere).

All three quantise input and weight to E4M3; grad-output is E4M3 in torchao's recipes and E5M2
under ``HYBRID`` (``format="E4M3"`` makes delayed use E4M3 everywhere, as TE allows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["E4M3", "E5M2", "fp8_max", "TensorwiseScaling", "RowwiseScaling", "DelayedScaling", "MXFP8Scaling", "Recipe",
           "recipe_for", "RECIPES", "needs"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


class _CurrentScaling:
    """torchao's current scaling: each scale from this tensor's amax now, E4M3 everywhere."""

    def dtypes(self):
        return {"input": E4M3, "weight": E4M3, "grad_output": E4M3}


@dataclass(frozen=True)
class TensorwiseScaling(_CurrentScaling):
    """Current scaling, one scale per tensor (E4M3 for input, weight and grad-output)."""

    name = "tensorwise"
    mode = "fp8-tensorwise"
    rowwise = False
    capability = (8, 9)  # torch._scaled_mm with per-tensor scales: Ada, Hopper, Blackwell


@dataclass(frozen=True)
class RowwiseScaling(_CurrentScaling):
    """Current scaling, one scale per row along the contraction dim (E4M3 everywhere)."""

    name = "rowwise"
    mode = "fp8-rowwise"
    rowwise = True
    capability = (9, 0)  # torch's row-wise _scaled_mm is an sm90 kernel


@dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's ``DelayedScaling``: scale = fp8_max / amax / 2**margin, where amax is the
    ``max`` (or ``most_recent``) of the last ``amax_history_len`` amaxes seen for that tensor.

    ``reduce_amax``: all-reduce (max) the amax histories across data-parallel ranks, all layers in one
    collective per micro-batch, so every rank uses one scale (TE's default).
    """

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    format: str = "HYBRID"
    reduce_amax: bool = True

    name = "delayed"
    mode = "fp8-delayed"
    rowwise = False
    capability = (8, 9)

    def __post_init__(self):
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int (e.g. 16), got {self.amax_history_len!r}.")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}.")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be a non-negative int (a power-of-2 headroom, e.g. 0), got {self.margin!r}.")
        if self.format not in ("HYBRID", "E4M3"):
            raise ValueError(f"format must be 'HYBRID' (E4M3 forward, E5M2 backward) or 'E4M3', got {self.format!r}.")

    def dtypes(self):
        return {"input": E4M3, "weight": E4M3, "grad_output": E5M2 if self.format == "HYBRID" else E4M3}


@dataclass(frozen=True)
class MXFP8Scaling(_CurrentScaling):
    """MXFP8 (OCP MX): E4M3 elements, one power-of-two E8M0 scale per 32 elements along each GEMM's
    contraction dim, RCEIL scale rounding (torchao's MX training recipe ``mxfp8_rceil``)."""

    name = "mxfp8"
    mode = "mxfp8"
    rowwise = True  # scales along the contraction dim, per block
    block = 32
    capability = (10, 0)  # MX block-scaled tensor cores: Blackwell (sm100); Hopper has none


Recipe = Union[TensorwiseScaling, RowwiseScaling, DelayedScaling, MXFP8Scaling]
RECIPES = {"fp8-tensorwise": TensorwiseScaling, "fp8-rowwise": RowwiseScaling, "fp8-delayed": DelayedScaling,
           "mxfp8": MXFP8Scaling}


_GPUS = {(8, 9): "Ada, Hopper, Blackwell", (9, 0): "Hopper, Blackwell", (10, 0): "Blackwell"}


def needs(recipe) -> str:
    """The CUDA compute capability ``recipe``'s fp8 GEMMs need, in words: "compute capability 10.0+ (Blackwell)"."""
    major, minor = recipe.capability
    return f"compute capability {major}.{minor}+ ({_GPUS[recipe.capability]})"


def recipe_for(mode: str, recipe: Recipe = None) -> Recipe:
    """The recipe a mode runs (``recipe`` overrides the default; it must belong to that mode)."""
    if mode not in RECIPES:
        raise ValueError(f"{mode!r} is not an fp8 mode: use one of {', '.join(RECIPES)}.")
    if recipe is None:
        return RECIPES[mode]()
    if not isinstance(recipe, RECIPES[mode]):
        raise ValueError(f"fp8_recipe={recipe!r} does not belong to precision={mode!r}: pass a "
                         f"{RECIPES[mode].__name__}, or use precision={getattr(recipe, 'mode', 'fp8-delayed')!r}.")
    return recipe
