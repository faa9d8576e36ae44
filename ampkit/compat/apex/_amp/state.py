"""amp's state: what ``initialize`` set up, and apex's per-loss scaler view (``_amp_state.loss_scalers``)."""
from __future__ import annotations

from typing import List, Optional

from ....precision import Precision
from ....precision.scaling.loss_scaler import LossScaler
from ..opt_levels import AmpProperties

__all__ = ["_AmpState", "_LossScalerView"]


class _LossScalerView:
    """apex's per-loss scaler object as scripts poke at it (``_amp_state.loss_scalers[0]``)."""

    def __init__(self, scaler: LossScaler, dynamic: bool) -> None:
        self.scaler = scaler
        self.dynamic = dynamic

    def loss_scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def _unskipped(self) -> int:
        return self.scaler.get_growth_tracker()


class _AmpState:
    """Everything ``amp.initialize`` set up: the properties, the precision, one scaler per loss."""

    def __init__(self) -> None:
        self.initialized = False
        self.enabled = True
        self.verbosity = 1
        self.props: Optional[AmpProperties] = None
        self.precision: Optional[Precision] = None
        self.scalers: List[LossScaler] = []
        self.loss_scalers: List[_LossScalerView] = []
        self.views: list = []

    def print(self, msg: str) -> None:
        if self.verbosity > 0:
            print(msg)
