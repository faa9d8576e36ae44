"""Tests of ampkit.bench (module names bench.test_*: the package keeps equal basenames in other folders apart)."""
