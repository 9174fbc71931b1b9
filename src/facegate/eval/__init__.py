"""facegate.eval."""
