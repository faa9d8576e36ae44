"""Tests of ampkit.optim (module names optim.test_*: the package keeps equal basenames in other folders apart)."""
