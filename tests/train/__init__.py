"""Tests of ampkit.train (module names train.test_*: the package keeps equal basenames in other folders apart)."""
