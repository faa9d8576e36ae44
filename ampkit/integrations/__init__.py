"""Plugins that give other training frameworks every ampkit mode (import the one you use: it needs that package)."""
