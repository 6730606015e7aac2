"""Integrations with model libraries (imported on demand: they need the library installed)."""
