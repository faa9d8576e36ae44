"""fp16-mixed / bf16-mixed: fp32 params, ``torch.autocast`` in fp16/bf16 (fp16 with a loss scaler)."""
from __future__ import annotations

import torch

from .base import Precision

__all__ = ["AutocastPrecision"]


class AutocastPrecision(Precision):
    """fp16-mixed / bf16-mixed: ``torch.autocast`` in the compute dtype."""

    kind = "autocast"

    def autocast(self):
        """``torch.autocast`` in the compute dtype: torch's own object (build it once and re-enter it, nest it,
        use it as a decorator; ``torch.compile`` traces it). The CPU attention kernels ``ampkit.tune`` measured
        are switched on by the tuning layer, on the model (``ampkit.tuning.attention``)."""
        return torch.autocast(device_type=self.device.type, dtype=self.mode.autocast_dtype)
