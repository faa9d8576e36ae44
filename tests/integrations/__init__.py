"""Tests of ampkit.integrations (module names integrations.test_*: the package keeps equal basenames in other folders apart)."""
