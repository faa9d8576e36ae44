"""apex's opt-level table (O0-O3) and its override rules, resolved to one ampkit precision mode.

apex documented four levels as defaults for five properties, each overridable by a keyword
of ``amp.initialize``::

    level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
    O0     float32          False                  None                 False           1.0
    O1     None             True  (autocast)       None                 None            "dynamic"
    O2     float16          False                  True                 True            "dynamic"
    O3     float16          False                  False                False           1.0

The combination maps onto one row of ampkit's mode table (``ampkit.precision.modes``):
autocast -> ``*-mixed``; a cast model with master weights -> ``*-master``; a cast model
without -> ``*-pure``; no cast -> ``fp32``. Contradictions apex refused (O1 with a model cast,
master weights or keep_batchnorm_fp32) are refused here too, with a one-line fix.

ampkit extension: ``dtype=torch.bfloat16`` (or ``cast_model_type=torch.bfloat16`` for O2/O3)
runs the same level in bf16; bf16 has fp32's exponent range, so its default loss scale is a
static 1.0 instead of dynamic.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from ...precision.loss_scale import parse_loss_scale

__all__ = ["AmpProperties", "OPT_LEVELS", "resolve_properties"]

_LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AmpProperties:
    opt_level: str
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    #: "dynamic" or a positive float (static)
    loss_scale: Union[str, float]
    #: the 16-bit dtype this run computes in (ampkit extension; apex: always float16)
    dtype: torch.dtype = torch.float16

    @property
    def mode(self) -> str:
        """The ampkit precision mode these properties describe."""
        low = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        if self.patch_torch_functions:
            return f"{low}-mixed"
        if self.cast_model_type in (None, torch.float32):
            return "fp32"
        return f"{low}-master" if self.master_weights else f"{low}-pure"

    @property
    def masters(self) -> bool:
        """A ``*-master`` mode: the model's parameters stay fp32 (the master weights), computed as 16-bit copies."""
        return self.mode.endswith("-master")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"


OPT_LEVELS = {
    "O0": AmpProperties("O0", torch.float32, False, None, False, 1.0),
    "O1": AmpProperties("O1", None, True, None, None, "dynamic"),
    "O2": AmpProperties("O2", torch.float16, False, True, True, "dynamic"),
    "O3": AmpProperties("O3", torch.float16, False, False, False, 1.0),
}

_LEVEL_BRIEF = {
    "O0": "pure fp32",
    "O1": "autocast (fp32 weights, 16-bit compute where safe)",
    "O2": "fp32 master weights computed as 16-bit copies, norms fp32",
    "O3": "pure 16-bit model",
}


def _check_level(opt_level) -> str:
    level = str(opt_level).strip()
    if level.upper() in OPT_LEVELS:
        return level.upper()
    hint = ""
    if level.startswith("0"):
        hint = " The prefix is the letter O, not the digit zero."
    raise ValueError(
        f"Unexpected opt_level {opt_level!r}: use 'O0' (fp32), 'O1' (autocast), 'O2' (16-bit model + "
        f"fp32 master weights) or 'O3' (pure 16-bit).{hint}"
    )


def _bool_or_str(name: str, value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True, False, 'True', 'False' or None, got {value!r}.")


def resolve_properties(
    opt_level: str = "O1",
    cast_model_type: Optional[torch.dtype] = None,
    patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32=None,
    master_weights: Optional[bool] = None,
    loss_scale=None,
    dtype: Optional[torch.dtype] = None,
) -> AmpProperties:
    """The opt level's defaults with every non-None override applied and checked."""
    level = _check_level(opt_level)
    props = OPT_LEVELS[level]
    keep_batchnorm_fp32 = _bool_or_str("keep_batchnorm_fp32", keep_batchnorm_fp32)
    master_weights = _bool_or_str("master_weights", master_weights)

    if dtype is not None and dtype not in _LOW_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
    if cast_model_type is not None and cast_model_type not in _LOW_DTYPES + (torch.float32,):
        raise ValueError(
            f"cast_model_type must be torch.float16, torch.bfloat16 or torch.float32, got {cast_model_type}."
        )
    if cast_model_type in _LOW_DTYPES:
        if dtype is not None and dtype != cast_model_type:
            raise ValueError(f"cast_model_type={cast_model_type} contradicts dtype={dtype}: pass one of them.")
        dtype = cast_model_type

    if level == "O1":
        if cast_model_type not in (None, torch.float32):
            raise ValueError(
                "O1 autocasts around torch functions and keeps the model's weights fp32, so "
                f"cast_model_type must be None (got {cast_model_type}): use opt_level='O2' or 'O3' "
                "to cast the model, or dtype=torch.bfloat16 for bf16 autocast."
            )
        if keep_batchnorm_fp32 is not None:
            raise ValueError(
                "With opt_level O1 batchnorm already runs in fp32 (the model is not cast), so "
                f"keep_batchnorm_fp32 must be None, got {keep_batchnorm_fp32}."
            )
        if master_weights is not None:
            raise ValueError(
                "With opt_level O1 the model's weights stay fp32, so master_weights must be None "
                f"(got {master_weights}): use opt_level='O2' for a 16-bit model with fp32 master weights."
            )
    if patch_torch_functions and level != "O1":
        raise ValueError("patch_torch_functions=True (autocast) is only valid with opt_level='O1'.")

    if dtype is None:
        dtype = torch.float16
    changes = {"dtype": dtype}
    if props.cast_model_type in _LOW_DTYPES:
        changes["cast_model_type"] = dtype
    if cast_model_type is not None:
        changes["cast_model_type"] = cast_model_type
    if patch_torch_functions is not None:
        changes["patch_torch_functions"] = bool(patch_torch_functions)
    if keep_batchnorm_fp32 is not None:
        changes["keep_batchnorm_fp32"] = keep_batchnorm_fp32
    if master_weights is not None:
        changes["master_weights"] = master_weights
    if loss_scale is not None:
        static = parse_loss_scale(loss_scale)
        changes["loss_scale"] = "dynamic" if static is None else static
    elif dtype == torch.bfloat16 and props.loss_scale == "dynamic":
        changes["loss_scale"] = 1.0  # bf16 gradients do not underflow
    return replace(props, **changes)


def describe(props: AmpProperties) -> str:
    scale = "dynamic loss scale" if props.dynamic else f"static loss scale {props.loss_scale:g}"
    return f"opt_level {props.opt_level} ({_LEVEL_BRIEF[props.opt_level]}) -> ampkit mode {props.mode}, {scale}"
