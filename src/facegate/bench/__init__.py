"""facegate.bench: load generators (``facegate bench http``)."""
