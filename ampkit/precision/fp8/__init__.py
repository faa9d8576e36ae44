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

from ...utils.warn import user_stacklevel
from .delayed import DelayedScalingConv1D, DelayedScalingLinear, has_fp8_gemm, reduce_histories, watch_histories
from .detect import gemm_kind, is_conv1d
from .quant import amax, fake_quantise, quantise, saturates, scale_from_amax
from .recipes import (E4M3, E5M2, RECIPES, DelayedScaling, MXFP8Scaling, Recipe, RowwiseScaling, TensorwiseScaling, fp8_max,
                      needs, recipe_for)
from .roofline import DEFAULT_GPU, GPUS, MIN_SPEEDUP, TOKENS, default_gpu, estimate, gpu_class
from .swap import (DEFAULT_RULE, MIN_FLOP_SHARE, RULES, Fp8Filter, has_gemm, convert_to_fp8, coverage, coverage_warning,
                   fp8_layers, plan, skip_label)

__all__ = [
    "Fp8Plan", "DelayedScaling", "TensorwiseScaling", "RowwiseScaling", "MXFP8Scaling", "RECIPES", "recipe_for", "Recipe",
    "DelayedScalingLinear", "DelayedScalingConv1D", "Fp8Filter", "plan", "convert_to_fp8", "fp8_layers",
    "coverage", "coverage_warning", "MIN_FLOP_SHARE", "gemm_kind", "is_conv1d", "has_fp8_gemm",
    "E4M3", "E5M2", "fp8_max", "amax", "scale_from_amax", "quantise", "saturates", "fake_quantise",
    "EMULATED_NOTE", "EAGER_NOTE", "note_eager", "emulated_warning", "needs", "RULES", "DEFAULT_RULE", "estimate", "gpu_class", "GPUS", "TOKENS", "MIN_SPEEDUP", "DEFAULT_GPU", "default_gpu",
]

EMULATED_NOTE = "emulated: numerics only, not a speed claim"


def emulated_warning(mode: str, recipe: Recipe, capability) -> str:
    """The setup warning for a GPU of ``capability`` (major, minor) without tensor cores for ``recipe``'s GEMMs:
    what the recipe needs (8.9+ per-tensor, 9.0+ row-wise, 10.0+ MX) and what runs fast instead."""
    have = ".".join(map(str, capability))
    other = [] if capability < (8, 9) or mode == "fp8-tensorwise" else ["fp8-tensorwise (8.9+)"]
    if isinstance(recipe, MXFP8Scaling) and capability >= (9, 0):
        other.append("fp8-rowwise (9.0+)")
    return (f"{mode}: this GPU (compute capability {have}) has no tensor cores for its GEMMs, which need "
            f"{needs(recipe)}: they are emulated (same numerics, slower than bf16-mixed). For speed use "
            f"{' or '.join(other + ['bf16-mixed'])}.")


EAGER_NOTE = ("{mode} runs eagerly (the model is not under torch.compile): each fp8 Linear's casts and scales are "
              "separate kernels, so a step is slower than bf16-mixed (torchao's eager float8: 0.51x on an H200); "
              "torch.compile(model) (ampkit train --compile) fuses them and makes fp8 the faster one.")


class _EagerFp8Note:
    """A forward pre-hook on an fp8 model with real fp8 GEMMs: the first training forward that runs eagerly says
    once (a warning) what eager fp8 costs and that compiling fixes it; under torch.compile it says nothing
    (``is_compiling()`` is a constant there: no graph break). A class, so ``torch.save(model)`` pickles it."""

    def __init__(self, mode: str) -> None:
        self.mode, self.said = mode, False

    def __call__(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling() or self.said or not module.training:
            return
        self.said = True
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()):
            return  # compiled by region (``block.compile()``: ampkit train --compile), the fp8 Linears inside
        warnings.warn(EAGER_NOTE.format(mode=self.mode), stacklevel=user_stacklevel())


def note_eager(model: nn.Module, mode: str) -> None:
    """Hook :class:`_EagerFp8Note` on ``model`` (once)."""
    if not any(isinstance(h, _EagerFp8Note) for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_EagerFp8Note(mode))


class Fp8Plan:
    """What an fp8 mode does on top of bf16-mixed: Linears and Conv1Ds swapped for fp8 ones by ``apply``.

    ``coverage`` (after ``apply``): how many layers converted, why the others did not, and the
    converted share of their FLOPs (:func:`.swap.coverage`); ``apply`` warns once when nothing, or
    under half the FLOPs, converts.
    """

    def __init__(self, mode: str, recipe: Optional[Recipe] = None, skip: Sequence[str] = (),
                 force: Sequence[str] = (), keep_ends: bool = True, rule: Optional[str] = None,
                 gpu: Optional[str] = None, tokens: Optional[int] = None) -> None:
        self.recipe = recipe_for(mode, recipe)
        self.filter = Fp8Filter(tuple(skip or ()), tuple(force or ()), keep_ends, rule, gpu,
                                TOKENS if tokens is None else tokens, mode)
        self.mode = mode
        #: where the roofline's GPU class came from: "fp8_gpu" (given), "device" (this GPU's), "default" (DEFAULT_GPU)
        self.gpu_source = "fp8_gpu" if gpu is not None else "default"
        self._device_type = "cpu"
        self.layers: list = []
        self.emulated: Optional[bool] = None
        self.coverage: Optional[dict] = None
        self._delayed: list = []  # the delayed-scaling layers (``apply``)
        #: tensorwise under FSDP2: weights all-gathered in fp8 (torchao), their scales precomputed after each step
        self.fsdp_all_gather = False
        self._gathered: Optional[nn.Module] = None  # the model whose fp8 weights FSDP gathers (``apply``)

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        self.emulated = not has_gemm(device, self.recipe)
        if self.emulated and torch.device(device).type == "cuda":
            warnings.warn(emulated_warning(self.mode, self.recipe, torch.cuda.get_device_capability(device)),
                          stacklevel=user_stacklevel())
        if self.coverage is None:  # setup twice (resume, tune) warns once and swaps once
            self._device_type = torch.device(device).type
            if self.filter.gpu is None:  # judged for this GPU's class; on a CPU (or an unknown GPU) for DEFAULT_GPU
                own = gpu_class(device)
                self.gpu_source = "default" if own is None else "device"
                self.filter = dataclasses.replace(self.filter, gpu=own or default_gpu(self.mode))
            self.coverage = coverage(model, self.filter)
            note = coverage_warning(self.coverage, self.mode)
            if note:
                warnings.warn(note, stacklevel=user_stacklevel())
        if not fp8_layers(model):
            model = convert_to_fp8(model, self.recipe, self.filter, device, fsdp_all_gather=self.fsdp_all_gather)
        self.layers = fp8_layers(model)
        self._gathered = model if self.fsdp_all_gather else None
        if not self.emulated and self.layers:
            note_eager(model, self.mode)
        self._delayed = watch_histories(model)  # delayed scaling: one amax all-reduce per micro-batch
        return model

    def reduce_amaxes(self) -> None:
        """Delayed scaling under data parallelism: the amaxes recorded since the last reduction, all-reduced in
        one collective (``Precision.step`` calls it, so a checkpoint after a step holds every rank's max)."""
        if self._delayed:
            reduce_histories(self._delayed)

    def gather_in_fp8(self) -> bool:
        """Under FSDP2, have the fp8 Linears' weights all-gathered in fp8 (before ``apply``): torchao's
        ``enable_fsdp_float8_all_gather``, tensorwise recipes only. Returns whether it is on."""
        self.fsdp_all_gather = isinstance(self.recipe, TensorwiseScaling) and not self.layers
        return self.fsdp_all_gather

    def precompute_scales(self) -> None:
        """After an optimizer step under FSDP2 with fp8 all-gather: every fp8 weight's scale from its new amax in
        one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), so the next all-gathers need
        no collective of their own. Nothing before the model is sharded."""
        if self._gathered is not None:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self._gathered)

    def summary(self) -> dict:
        """For the run's summary.json: the recipe, the converted count and why the rest stayed bf16."""
        cov = self.coverage or {}
        return {"recipe": self.recipe.name, "layers_in_fp8": len(self.layers), "candidates": cov.get("candidates"),
                "conv1d_in_fp8": cov.get("conv1d"), "flop_share": cov.get("flop_share"),
                "skipped": dict(cov.get("skipped") or {}), "emulated": self.emulated,
                "converted": list(cov.get("layers") or []), "kept": dict(cov.get("kept") or {}),
                "filter": self.filter.rule, "target_gpu": self.filter.target, "target_gpu_from": self.gpu_source,
                "tokens": self.filter.tokens,
                "roofline_converts": list(cov.get("roofline_converts") or [])}

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
                if isinstance(r, DelayedScaling) else "MXFP8 block scaling (E4M3, one E8M0 scale per 32; torchao MX)"
                if isinstance(r, MXFP8Scaling) else f"{r.name} current scaling (torchao)")
        where = "" if self.emulated is None else (f"; {EMULATED_NOTE}" if self.emulated else
                                                  "; torchao MX kernels" if isinstance(r, MXFP8Scaling)
                                                  else "; torch._scaled_mm")
        n = ""
        if self.emulated is not None:
            cov = self.coverage or {}
            n = f", {len(self.layers)} of {cov.get('candidates', len(self.layers))} Linear/Conv1D layers in fp8"
            extra = [f"{cov['flop_share']:.0%} of their FLOPs"] if cov.get("flop_share") is not None else []
            extra += [f"{c} {skip_label(why, cov.get('mult', 16))} in bf16" for why, c in (cov.get("skipped") or {}).items()]
            n += f" ({'; '.join(extra)})" if extra else ""
            n += f"; {self._target_note(cov)}"
        gathered = "; FSDP2 gathers the fp8 Linears' weights in fp8" if self.fsdp_all_gather else ""
        return f"fp8 {what}{n}{where}{gathered}"

    def _target_note(self, cov: dict) -> str:
        """The filter and what the roofline says for the target GPU class (``fp8_gpu``, else the run's own GPU's,
        else the default class, which the note names as such)."""
        f = self.filter
        k, c = len(cov.get("roofline_converts") or []), cov.get("roofline_candidates", 0)
        where = f"{f.target} at {f.tokens} tokens per GEMM"
        if self.gpu_source == "default":
            where += f" (the default target class on {self._device_type}; fp8_gpu= names another)"
        if f.rule == "auto":
            return f"fp8_filter auto: roofline on {where}"
        return f"fp8_filter {f.rule}; the roofline on {where} would convert {k} of {c}"
