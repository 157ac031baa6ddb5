"""Security tests (issue: trust). Property-based fuzzing runs a few hundred cases per target in CI; the
committed campaign (benchmarks/bench_fuzz.py -> benchmarks/results/fuzz.md) runs at least 10,000 each, set
through DEADPOOL_FUZZ_EXAMPLES."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("deadpool", max_examples=int(os.environ.get("DEADPOOL_FUZZ_EXAMPLES", "200")),
                          deadline=None, derandomize=os.environ.get("DEADPOOL_FUZZ_SEED") is None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("deadpool")
