"""The front-end ↔ engine-process protocol: Unix-socket messages plus a shared-memory arena per front-end."""
