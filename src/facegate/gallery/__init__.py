"""facegate.gallery."""
