"""facegate.bench: load generators (``facegate bench http``)."""

from __future__ import annotations

from facegate.bench.http import BenchResult, arun_http_bench, run_http_bench

__all__ = ["BenchResult", "arun_http_bench", "run_http_bench"]
