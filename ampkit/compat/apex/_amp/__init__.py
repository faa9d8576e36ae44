"""The parts of ``ampkit.compat.apex.amp``, one job each (see that module)."""
