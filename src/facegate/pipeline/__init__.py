"""facegate.pipeline."""
