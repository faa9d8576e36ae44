"""The options of a `Precision`, grouped by the part that uses them, each group a frozen, checked dataclass.

``Precision(name, device, **options)`` takes flat keywords (``init_scale=...``, ``fp8_filter=...``); they are
routed here, once, to their owner:

* :class:`ScalerOptions`: the loss scaler's (``loss_scale``, ``init_scale``, ``growth_interval``...);
* :class:`ModelOptions`: what ``convert_module`` does to the model (``fp32_modules``, ``channels_last``...);
* :class:`OptimizerOptions`: what ``wrap_optimizer`` does to the optimizer (``optimizer_state``,
  ``compensation``, ``fused_optimizer``);
* :class:`Fp8Config`: the fp8 modes' recipe and layer filter (keywords ``fp8_recipe``, ``fp8_skip``...).

Each group checks its own ranges and says, in one line, which of its options a mode does not use
(:meth:`refused`); ``Precision`` asks every group once. A new option group is one dataclass here (its
fields, ``PREFIX`` for its keywords, ``refused``) and one field of :class:`PrecisionOptions`: the keywords
route themselves from the fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..optim.state import normalise_state_precision
from .loss_scale import check_scaler_ranges, parse_loss_scale
from .modes import Mode

__all__ = ["PrecisionOptions", "ScalerOptions", "ModelOptions", "OptimizerOptions", "Fp8Config", "COMPENSATIONS",
           "STRATEGIES"]

#: the ``compensation`` values a bf16-pure precision takes (``"none"``: plain rounding)
COMPENSATIONS = ("kahan", "stochastic", "none")
#: what ``strategy`` may name: how the run is spread over processes (None: one process, or the caller's own)
STRATEGIES = ("ddp", "fsdp")


def _names(option: str, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str):  # tuple("encoder") would be its letters
        raise ValueError(f"{option}={value!r} must be a list of module names: use {option}=[{value!r}].")
    return tuple(value or ())


@dataclass(frozen=True)
class ScalerOptions:
    """The loss scaler's options. ``loss_scale`` keeps the value as given (errors quote it); its parse is
    :attr:`static_scale` (None: dynamic). ``scaler``: a ready ``LossScaler`` used instead of building one."""

    loss_scale: Union[str, float, None] = None
    init_scale: Optional[float] = None
    growth_interval: int = 2000
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    hysteresis: int = 1
    max_consecutive_skips: Optional[int] = None
    nonfinite: str = "skip"
    scaler: Any = None
    #: the static loss scale ``loss_scale`` asks for; None = dynamic (or not given): parsed once, here
    static_scale: Optional[float] = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "static_scale", parse_loss_scale(self.loss_scale))
        check_scaler_ranges(self.init_scale, self.growth_interval, self.min_scale, self.max_scale, self.hysteresis,
                            self.max_consecutive_skips)
        if self.nonfinite not in ("skip", "stop", "off"):
            raise ValueError(f"nonfinite={self.nonfinite!r} is not supported: use 'skip' (skip and count the step), "
                             "'stop' (stop the run) or 'off' (no check).")

    def refused(self, mode: Mode) -> Optional[str]:
        """The one-line error for a loss scale given to a mode that does not scale (or ``nonfinite`` other than
        ``"skip"`` to one that does: a scaled step must skip an overflow to lower its scale), else None."""
        if mode.scaled and self.nonfinite != "skip":
            return (f"precision={mode.name!r} scales the loss, and a dynamic loss scale skips overflowing steps to "
                    f"find its scale: drop nonfinite={self.nonfinite!r} (it applies to the unscaled modes: fp32, bf16, "
                    "fp8).")
        if mode.scaled or (self.loss_scale is None and self.scaler is None and self.init_scale is None):
            return None
        found = self.loss_scale if self.loss_scale is not None else self.init_scale
        what = "a scaler" if self.scaler is not None else f"loss scale {found!r}"
        why = ("bf16 has fp32's exponent range, so gradients do not underflow" if "bf16" in mode.name
               else "fp32 gradients do not underflow")
        return (f"precision={mode.name!r} does not use loss scaling, found {what}. {why}: drop the loss scale, "
                "or pick an fp16 mode (fp16-mixed, fp16-master).")


@dataclass(frozen=True)
class ModelOptions:
    """What ``convert_module`` does to the model besides the mode's cast (docs on ``Precision``)."""

    fp32_modules: Sequence[str] = ()
    keep_norm_fp32: bool = True
    cast_outputs: bool = True
    channels_last: Optional[bool] = None
    op_policy: Optional[bool] = None
    #: the pure modes: ``"cast"`` rounds frozen parameters to the 16-bit dtype in place with the rest, ``"keep"``
    #: leaves them in their dtype (a frozen fp32 base under LoRA adapters) and computes with 16-bit copies
    frozen: str = "cast"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fp32_modules", _names("fp32_modules", self.fp32_modules))
        if self.frozen not in ("cast", "keep"):
            raise ValueError(f"frozen={self.frozen!r} is not supported: use 'cast' (frozen parameters rounded with the "
                             "rest in the pure modes) or 'keep' (left in their dtype).")

    def refused(self, mode: Mode) -> Optional[str]:
        """Every mode takes these."""
        return None


@dataclass(frozen=True)
class OptimizerOptions:
    """What ``wrap_optimizer`` does to the optimizer. ``compensation`` is lower case, None when not given
    (``"none"`` is plain rounding: :attr:`plain_rounding`); ``optimizer_state`` ``fp32``/``bf16``/``8bit`` or None."""

    optimizer_state: Optional[str] = None
    compensation: Optional[str] = None
    fused_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.compensation is not None:
            comp = str(self.compensation).lower()
            if comp not in COMPENSATIONS:
                raise ValueError(f"compensation={self.compensation!r} is not supported: use 'kahan', 'stochastic' "
                                 "or 'none'.")
            object.__setattr__(self, "compensation", comp)
        object.__setattr__(self, "optimizer_state", normalise_state_precision(self.optimizer_state))

    @property
    def plain_rounding(self) -> bool:
        """``compensation="none"``: bf16 updates rounded plainly (``ampkit.optim`` spells it ``None``)."""
        return self.compensation == "none"

    @property
    def optim_compensation(self) -> Optional[str]:
        """``compensation`` as ``ampkit.optim`` spells it (``"kahan"``, ``"stochastic"``, None = plain)."""
        return None if self.plain_rounding else self.compensation

    def refused(self, mode: Mode) -> Optional[str]:
        """The one-line error for ``compensation`` given to a mode without compensated updates, else None."""
        if self.compensation is None or mode.compensated:
            return None
        return (f"compensation={self.compensation!r} applies to precision='bf16-pure' only (got {mode.name!r}): "
                "drop it, or use precision='bf16-pure'.")


@dataclass(frozen=True)
class Fp8Config:
    """The fp8 modes' options (keywords ``fp8_recipe``, ``fp8_skip``...): a recipe object of the mode
    (``ampkit.precision.fp8.DelayedScaling(...)``), Linear names kept in bf16 or converted although
    first/last, the layer filter rule and the GPU class and tokens it judges speed for (docs/FP8.md)."""

    PREFIX = "fp8_"  # the keywords are fp8_recipe, fp8_skip...; a plain class attribute, not a field

    recipe: Any = None
    skip: Sequence[str] = ()
    force: Sequence[str] = ()
    filter: Optional[str] = None
    gpu: Optional[str] = None
    tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("skip", "force"):
            object.__setattr__(self, name, _names(f"fp8_{name}", getattr(self, name)))

    def given(self) -> bool:
        return self != Fp8Config()

    def refused(self, mode: Mode) -> Optional[str]:
        """The one-line error for fp8 options given to a mode that is not fp8, else None."""
        if mode.fp8 is not None or not self.given():
            return None
        return (f"fp8_recipe/fp8_skip/fp8_force apply to the fp8 modes only (got {mode.name!r}): drop them "
                "(fp8_filter/fp8_gpu/fp8_tokens too), or use precision='fp8-rowwise', 'fp8-tensorwise' or 'fp8-delayed'.")


@dataclass(frozen=True)
class PrecisionOptions:
    """Every keyword of ``Precision(...)`` (``name`` and ``tuned`` aside), checked once and grouped by owner.

    Built from the flat keywords by :meth:`from_kwargs`; :meth:`kwargs` hands them back, :meth:`replace` changes
    some. ``strategy`` (``"ddp"``, ``"fsdp"`` or None) is what the run is spread with: FSDP shards contiguous
    parameters only (no ``channels_last``), DDP all-reduces the gradients (the scaler needs no found-inf
    collective). The arguments are documented on :class:`~ampkit.precision.Precision`.
    """

    device: Any = None
    strategy: Optional[str] = None
    # the groups, in the order their refusals are checked
    optimizer: OptimizerOptions = OptimizerOptions()
    fp8: Fp8Config = Fp8Config()
    scaling: ScalerOptions = ScalerOptions()
    model: ModelOptions = ModelOptions()

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not supported: use 'ddp', 'fsdp' or None (one process).")
        if self.strategy == "fsdp" and self.model.channels_last:
            raise ValueError("channels_last=True cannot be used with strategy 'fsdp' (FSDP shards contiguous "
                             "parameters only): leave channels_last unset, or use strategy 'ddp'.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "PrecisionOptions":
        """The options from ``Precision``'s flat keywords; an unknown one is a TypeError listing the known ones."""
        return cls().replace(**kwargs)

    def replace(self, **changes: Any) -> "PrecisionOptions":
        """These options with some flat keywords changed (checked again); an unknown one is a TypeError."""
        unknown = sorted(set(changes) - set(_KEYWORDS) - {"device", "strategy"})
        if unknown:
            raise TypeError(f"Precision() got an unexpected keyword argument {unknown[0]!r}: the options are "
                            f"{', '.join(sorted({*_KEYWORDS, 'strategy'}))}.")
        top = {k: changes[k] for k in ("device", "strategy") if k in changes}
        for group in _GROUPS:
            mine = {_KEYWORDS[k][1]: v for k, v in changes.items() if _KEYWORDS.get(k, ("",))[0] == group}
            if mine:
                top[group] = dataclasses.replace(getattr(self, group), **mine)
        return dataclasses.replace(self, **top)

    def kwargs(self) -> Dict[str, Any]:
        """The flat keyword arguments that build these options again (``Precision.options()``)."""
        return {"device": self.device, "strategy": self.strategy,
                **{k: getattr(getattr(self, group), name) for k, (group, name) in _KEYWORDS.items()}}

    def refusal(self, mode: Mode) -> Optional[str]:
        """The one-line error for the first option given that ``mode`` does not use, else None."""
        return next((text for group in _GROUPS if (text := getattr(self, group).refused(mode))), None)


#: the option groups: PrecisionOptions' fields that hold one, in order
_GROUPS = tuple(f.name for f in dataclasses.fields(PrecisionOptions) if dataclasses.is_dataclass(f.default))
#: each flat keyword of ``Precision(...)`` -> (group field, the group's field)
_KEYWORDS = {getattr(type(getattr(PrecisionOptions, g)), "PREFIX", "") + f.name: (g, f.name) for g in _GROUPS
             for f in dataclasses.fields(getattr(PrecisionOptions, g)) if f.init}
