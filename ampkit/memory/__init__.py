"""Memory planning: the peak of a training step per precision mode, traced on fake tensors (no compute,
no real memory), and the largest batch that fits a budget. ``ampkit.plan`` / ``ampkit plan``."""
from .budget import available_memory, format_bytes, parse_bytes
from .measure import measured_peak
from .plan import ORDER, BatchChoice, MemoryPlan, auto_batch_size, plan

__all__ = ["plan", "MemoryPlan", "BatchChoice", "ORDER", "parse_bytes", "format_bytes", "available_memory",
           "measured_peak", "auto_batch_size"]
