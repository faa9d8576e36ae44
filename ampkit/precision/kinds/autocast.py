"""fp16-mixed / bf16-mixed: fp32 params, ``torch.autocast`` in fp16/bf16 (fp16 with a loss scaler), plus
the scoped per-op attention policy."""
from __future__ import annotations

from typing import Optional

import torch

from ..attention import AttentionPolicy, forced_kernel, policy_setting
from ..autocast_context import AutocastContext
from .base import Precision

__all__ = ["AutocastPrecision"]


class AutocastPrecision(Precision):
    """fp16-mixed / bf16-mixed: ``torch.autocast`` in the compute dtype, with the attention policy."""

    kind = "autocast"

    def autocast(self):
        """``torch.autocast`` in the compute dtype; with the attention policy, an :class:`AutocastContext`
        (both entered afresh on every ``with``: build it once, enter it every micro-step, nest it, share
        it between threads or use it as a decorator, as a ``torch.autocast`` object)."""
        policy = self._attention_policy()
        if policy is None:  # torch's own object: torch.compile traces it without a graph break
            return torch.autocast(device_type=self.device.type, dtype=self.mode.autocast_dtype)
        return AutocastContext(self.device.type, self.mode.autocast_dtype, policy)

    def _attention_policy(self) -> Optional[AttentionPolicy]:
        """The scoped attention policy ``autocast()`` enters, or None where every call runs torch's kernel:
        a device other than CPU, ``op_policy=False``, ``AMPKIT_OP_POLICY=off``, or no tuned shape whose
        fastest kernel differs from torch's (then no mode is pushed at all)."""
        if not self._op_policy_applies:
            return None
        forced = forced_kernel()
        if forced == "native":
            return None
        kernels = {k: v for k, v in self.tuned.attention.items() if v != "native"}
        if forced is None and not kernels:
            return None
        cached = getattr(self, "_attention", None)
        if cached is None or cached.forced != forced:
            cached = self._attention = AttentionPolicy(kernels, forced=forced)
        return cached

    @property
    def _op_policy_applies(self) -> bool:
        if self.op_policy is False or (self.op_policy is None and self.device.type != "cpu"):
            return False
        return policy_setting() != "off"
