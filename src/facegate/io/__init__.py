"""facegate.io."""
