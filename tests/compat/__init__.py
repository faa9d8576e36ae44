"""Tests of ampkit.compat (module names compat.test_*: the package keeps equal basenames in other folders apart)."""
