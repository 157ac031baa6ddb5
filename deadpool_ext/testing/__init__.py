"""Helpers for tests, benchmarks and chaos runs: launching jobs with deadlines, injecting faults.

**A tool beside the product, not part of it**: nothing in the core or the integrations imports this package (the
import contracts in ``pyproject.toml`` forbid it), and a user's job never runs it.
"""
