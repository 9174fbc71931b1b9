"""facegate.metrics."""
