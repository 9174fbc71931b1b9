"""facegate.models."""
