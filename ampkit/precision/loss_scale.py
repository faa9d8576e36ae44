"""apex's loss-scale convention, parsed once for every entry point (``Precision(loss_scale=...)``, the
CLI's ``--loss-scale``, ``LossScaler(loss_scale=...)``, apex's ``amp.initialize``)."""
from __future__ import annotations

from typing import Any, Optional, Union

__all__ = ["parse_loss_scale", "positive_finite"]


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
