"""The options of a `Precision`, built once from the user's arguments: one frozen, validated object.

``Precision(name, device, **options)`` builds a :class:`PrecisionOptions` from its keywords; the loss
scale is parsed here (once), ``compensation`` and ``optimizer_state`` are normalised here (once), and
each option's range is checked here. Which options a mode takes is the kind's decision
(``Precision.own_options``); the kind that owns a group words its refusal (``Precision.refusal``).
``Precision.retuned`` and ``Precision.with_options`` rebuild from this object (``dataclasses.replace``).
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..optim.state import normalise_state_precision
from .loss_scale import parse_loss_scale, positive_finite
from .modes import Mode

__all__ = ["PrecisionOptions", "COMPENSATIONS", "OPTION_GROUPS"]

#: the ``compensation`` values a bf16-pure precision takes (``"none"``: plain rounding)
COMPENSATIONS = ("kahan", "stochastic", "none")
#: the option groups only some modes take, in the order they are refused (:meth:`PrecisionOptions.given`)
OPTION_GROUPS = ("compensation", "fp8", "scaling")


@dataclass(frozen=True)
class PrecisionOptions:
    """Every keyword of ``Precision(...)`` (``name`` and ``tuned`` aside), checked and normalised once.

    ``loss_scale`` keeps the value as given (``options()`` hands it back; errors quote it); its parse is
    :attr:`static_scale` (None: dynamic). ``compensation`` is lower case, None when not given
    (``"none"`` is plain rounding: :attr:`plain_rounding`); ``optimizer_state`` is ``fp32``/``bf16``/``8bit``
    or None. The arguments are documented on :class:`~ampkit.precision.Precision`.
    """

    device: Any = None
    loss_scale: Union[str, float, None] = None
    init_scale: Optional[float] = None
    growth_interval: int = 2000
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    hysteresis: int = 1
    max_consecutive_skips: Optional[int] = None
    fp32_modules: Sequence[str] = ()
    keep_norm_fp32: bool = True
    cast_outputs: bool = True
    skip_nonfinite: bool = True
    channels_last: Optional[bool] = None
    op_policy: Optional[bool] = None
    scaler: Any = None
    compensation: Optional[str] = None
    optimizer_state: Optional[str] = None
    fused_optimizer: bool = True
    fp8_recipe: Any = None
    fp8_skip: Sequence[str] = ()
    fp8_force: Sequence[str] = ()
    fp8_filter: Optional[str] = None
    fp8_gpu: Optional[str] = None
    fp8_tokens: Optional[int] = None
    #: the static loss scale ``loss_scale`` asks for; None = dynamic (or not given): parsed once, here
    static_scale: Optional[float] = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__.__get__(self)
        put("static_scale", parse_loss_scale(self.loss_scale))
        if self.compensation is not None:
            comp = str(self.compensation).lower()
            if comp not in COMPENSATIONS:
                raise ValueError(f"compensation={self.compensation!r} is not supported: use 'kahan', 'stochastic' "
                                 "or 'none'.")
            put("compensation", comp)
        put("optimizer_state", normalise_state_precision(self.optimizer_state))
        for name in ("fp32_modules", "fp8_skip", "fp8_force"):
            put(name, _names(name, getattr(self, name)))
        _check_ranges(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "PrecisionOptions":
        """The options from ``Precision``'s keywords; an unknown one is a TypeError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Precision() got an unexpected keyword argument {unknown[0]!r}: the options are "
                            f"{', '.join(sorted(known - {'device'}))}.")
        return cls(**kwargs)

    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments that build these options again (``Precision.options()``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @property
    def plain_rounding(self) -> bool:
        """``compensation="none"``: bf16 updates rounded plainly (``ampkit.optim`` spells it ``None``)."""
        return self.compensation == "none"

    @property
    def optim_compensation(self) -> Optional[str]:
        """``compensation`` as ``ampkit.optim`` spells it (``"kahan"``, ``"stochastic"``, None = plain)."""
        return None if self.plain_rounding else self.compensation

    def given(self, group: str) -> bool:
        """Whether an option of ``group`` (:data:`OPTION_GROUPS`) was given."""
        if group == "compensation":
            return self.compensation is not None
        if group == "fp8":
            return (self.fp8_recipe is not None or bool(self.fp8_skip or self.fp8_force)
                    or any(v is not None for v in (self.fp8_filter, self.fp8_gpu, self.fp8_tokens)))
        return self.loss_scale is not None or self.scaler is not None or self.init_scale is not None


def _names(option: str, value: Any) -> Tuple[str, ...]:
    if isinstance(value, str):  # tuple("encoder") would be its letters
        raise ValueError(f"{option}={value!r} must be a list of module names: use {option}=[{value!r}].")
    return tuple(value or ())


def _check_ranges(o: PrecisionOptions) -> None:
    """The range of each numeric option (the loss scaler's, as ``LossScaler`` words them, and ``growth_interval``)."""
    if o.init_scale is not None and not positive_finite(o.init_scale):
        raise ValueError(f"init_scale must be a positive finite number (e.g. 65536), got {o.init_scale!r}: "
                         "a scale of 0 zeroes every gradient, so no step would ever be judged non-finite.")
    if isinstance(o.growth_interval, bool) or not isinstance(o.growth_interval, numbers.Integral) or o.growth_interval < 1:
        raise ValueError(f"growth_interval must be a positive integer (clean steps before the scale grows), "
                         f"got {o.growth_interval!r}.")
    if o.hysteresis < 1:
        raise ValueError(f"hysteresis must be >= 1 (1 = back off on every overflow), got {o.hysteresis}.")
    if o.max_consecutive_skips is not None and o.max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be a positive integer or None, got {o.max_consecutive_skips}.")
    if o.min_scale is not None and not 0 <= o.min_scale < float("inf"):
        raise ValueError(f"min_scale must be a finite number >= 0 or None, got {o.min_scale!r}.")
    if o.max_scale is not None and not positive_finite(o.max_scale):
        raise ValueError(f"max_scale must be a positive finite number or None, got {o.max_scale!r}.")
    if o.min_scale is not None and o.max_scale is not None and o.min_scale > o.max_scale:
        raise ValueError(f"min_scale ({o.min_scale}) must not exceed max_scale ({o.max_scale}).")
