"""Tests of ampkit.utils (module names utils.test_*: the package keeps equal basenames in other folders apart)."""
