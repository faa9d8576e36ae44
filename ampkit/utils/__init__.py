"""Small helpers that import nothing else of ampkit (any layer may use them)."""
from .tree import cast_floating, first_tensor, iter_tensors, map_tensors, to_device

__all__ = ["map_tensors", "iter_tensors", "cast_floating", "to_device", "first_tensor"]
from .batch import batch_size_of, batch_target, call_model, output_logits, own_loss

__all__ += ["call_model", "own_loss", "output_logits", "batch_target", "batch_size_of"]
