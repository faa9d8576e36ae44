"""Tests of ampkit.precision (module names precision.test_*: the package keeps equal basenames in other folders apart)."""
