"""Helpers for tests, benchmarks and chaos runs: launching jobs with deadlines, injecting faults."""
