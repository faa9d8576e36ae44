"""apex's loss-scale convention, parsed once for every entry point (``Precision(loss_scale=...)``, the
CLI's ``--loss-scale``, ``LossScaler(loss_scale=...)``, apex's ``amp.initialize``), and the range of each
loss-scaler option (:func:`check_scaler_ranges`, the one wording for ``Precision`` and ``LossScaler``)."""
from __future__ import annotations

import numbers
from typing import Any, Optional, Union

__all__ = ["parse_loss_scale", "positive_finite", "check_scaler_ranges"]


def positive_finite(value: Any) -> bool:
    try:
        return 0 < float(value) < float("inf")
    except (TypeError, ValueError):
        return False


def parse_loss_scale(value: Union[str, float, int, None]) -> Optional[float]:
    """apex's convention: None/'dynamic'/0 -> None (dynamic); a positive number -> static scale.

    Raises ValueError with the accepted forms for anything else.
    """
    if value is None:
        return None
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("dynamic", "0", "0.0", ""):
            return None
        try:
            value = float(v)
        except ValueError:
            raise ValueError(
                f"loss scale {value!r} is not valid: use 'dynamic' or 0 for dynamic scaling, "
                "or a positive number (e.g. 1024) for a static scale."
            ) from None
    value = float(value)
    if value == 0:
        return None
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"loss scale {value!r} is not valid: use 'dynamic' or 0 for dynamic scaling, "
            "or a positive finite number (e.g. 1024) for a static scale."
        )
    return value


def check_scaler_ranges(init_scale: Optional[float] = None, growth_interval: int = 2000, min_scale: Optional[float] = None,
                        max_scale: Optional[float] = None, hysteresis: int = 1,
                        max_consecutive_skips: Optional[int] = None) -> None:
    """Raise a one-line ValueError naming the fix for a loss-scaler option out of its range (None: not given)."""
    if init_scale is not None and not positive_finite(init_scale):
        raise ValueError(f"init_scale must be a positive finite number (e.g. 65536), got {init_scale!r}: "
                         "a scale of 0 zeroes every gradient, so no step would ever be judged non-finite.")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral) or growth_interval < 1:
        raise ValueError(f"growth_interval must be a positive integer (clean steps before the scale grows), "
                         f"got {growth_interval!r}.")
    if hysteresis < 1:
        raise ValueError(f"hysteresis must be >= 1 (1 = back off on every overflow), got {hysteresis}.")
    if max_consecutive_skips is not None and max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be a positive integer or None, got {max_consecutive_skips}.")
    if min_scale is not None and not 0 <= min_scale < float("inf"):
        raise ValueError(f"min_scale must be a finite number >= 0 or None, got {min_scale!r}.")
    if max_scale is not None and not positive_finite(max_scale):
        raise ValueError(f"max_scale must be a positive finite number or None, got {max_scale!r}.")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
