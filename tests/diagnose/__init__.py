"""Tests of ampkit.diagnose (module names diagnose.test_*: the package keeps equal basenames in other folders apart)."""
