"""Tests of ampkit.cli (module names cli.test_*: the package keeps equal basenames in other folders apart)."""
