"""facegate.serving."""
