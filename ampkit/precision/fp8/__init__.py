"""FP8 training: recipes, the delayed-scaling Linear, the module filter/swap, and the mode's hooks.

``Fp8Plan`` is everything an fp8 mode adds to the bf16-mixed policy (the swap in ``setup``, a
line in ``describe``); ``Precision`` holds one when its mode is fp8. See docs/FP8.md.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from .delayed import DelayedScalingLinear, has_fp8_gemm
from .quant import amax, fake_quantise, quantise, scale_from_amax
from .recipes import (E4M3, E5M2, RECIPES, DelayedScaling, Recipe, RowwiseScaling, TensorwiseScaling, fp8_max,
                      recipe_for)
from .swap import Fp8Filter, convert_to_fp8, fp8_layers, plan

__all__ = [
    "Fp8Plan", "DelayedScaling", "TensorwiseScaling", "RowwiseScaling", "RECIPES", "recipe_for", "Recipe",
    "DelayedScalingLinear", "Fp8Filter", "plan", "convert_to_fp8", "fp8_layers", "has_fp8_gemm",
    "E4M3", "E5M2", "fp8_max", "amax", "scale_from_amax", "quantise", "fake_quantise", "EMULATED_NOTE",
]

EMULATED_NOTE = "emulated: numerics only, not a speed claim"


class Fp8Plan:
    """What an fp8 mode does on top of bf16-mixed: Linears swapped for fp8 ones by ``apply``."""

    def __init__(self, mode: str, recipe: Optional[Recipe] = None, skip: Sequence[str] = (),
                 force: Sequence[str] = (), keep_ends: bool = True) -> None:
        self.recipe = recipe_for(mode, recipe)
        self.filter = Fp8Filter(tuple(skip or ()), tuple(force or ()), keep_ends)
        self.layers: list = []
        self.emulated: Optional[bool] = None

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        self.emulated = not has_fp8_gemm(device, self.recipe.rowwise)
        if self.emulated and torch.device(device).type == "cuda":
            warnings.warn("fp8: this GPU has no fp8 tensor cores for this recipe (compute capability 8.9+, 9.0+ for "
                          "row-wise): the fp8 GEMMs "
                          "are emulated (same numerics, slower than bf16-mixed). Use bf16-mixed for speed.",
                          stacklevel=3)
        if not fp8_layers(model):  # setup twice (resume, tune) swaps once
            model = convert_to_fp8(model, self.recipe, self.filter, device)
        self.layers = fp8_layers(model)
        return model

    def state_dict(self) -> dict:
        """The recipe, so a resume can refuse another one (the amax histories live in the model's state_dict)."""
        return {"recipe": type(self.recipe).__name__, **dataclasses.asdict(self.recipe)}

    def check_state(self, state: Optional[dict]) -> None:
        if state and state != self.state_dict():
            raise ValueError(f"Checkpoint was trained with fp8 recipe {state}, this run uses {self.state_dict()}: "
                             "resume with the run's own fp8_recipe, or start a new run.")

    def describe(self) -> str:
        r = self.recipe
        what = (f"delayed scaling (history {r.amax_history_len}, {r.amax_compute_algo}, margin {r.margin}, {r.format})"
                if isinstance(r, DelayedScaling) else f"{r.name} current scaling (torchao)")
        where = "" if self.emulated is None else (f"; {EMULATED_NOTE}" if self.emulated else "; torch._scaled_mm")
        n = f", {len(self.layers)} Linear(s) in fp8" if self.emulated is not None else ""
        return f"fp8 {what}{n}{where}"
