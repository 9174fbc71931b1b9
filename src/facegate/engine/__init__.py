"""facegate.engine."""
