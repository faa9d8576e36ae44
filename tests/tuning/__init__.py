"""Tests of ampkit.tuning (module names tuning.test_*: the package keeps equal basenames in other folders apart)."""
