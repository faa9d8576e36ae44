"""Optimizers for 16-bit weights: updates that survive 16-bit weights without fp32 masters (the ``*-master``
modes need no optimizer of their own: the model's fp32 parameters are the masters, any torch optimizer steps them).

* :class:`AdamW`, :class:`Adam`, :class:`SGD`: torch's update rules (foreach), with
  ``compensation="kahan"`` (a 16-bit buffer per param, default), ``"stochastic"`` (stochastic
  rounding, no extra state) or None (plain rounding, which stalls at small learning rates).
* ``ampkit.optim.onepass``: Adam/AdamW's and SGD's updates as one function each, compiled into one pass over each
  tensor.
* :func:`compensated_from`: the compensated equivalent of a torch AdamW/Adam/SGD; what
  ``Precision("bf16-pure").setup`` uses.
* :func:`with_state_precision`: moments in bf16 or 8-bit (torchao): ``Precision(optimizer_state=...)``.
* :func:`state_bytes`: measured bytes of training state per parameter (``ampkit bench``).
* :func:`stochastic_round`, :func:`kahan_add_`: the rounding primitives; :class:`RoundingNoise`: their
  random bits as a counter-based hash (traceable by torch.compile).

See docs/BF16_PURE.md for the why and the numbers.
"""
from .adamw import Adam, AdamW
from .base import COMPENSATIONS, CompensatedOptimizer
from .convert import SUPPORTED, compensated_from
from .memory import state_bytes
from .noise import RoundingNoise
from .rounding import kahan_add_, stochastic_round, stochastic_round_
from .sgd import SGD
from .state import STATE_PRECISIONS, with_state_precision

__all__ = [
    "AdamW", "Adam", "SGD", "CompensatedOptimizer", "COMPENSATIONS", "SUPPORTED",
    "compensated_from", "state_bytes", "stochastic_round", "stochastic_round_", "kahan_add_",
    "RoundingNoise", "STATE_PRECISIONS", "with_state_precision",
]
