"""facegate.service: policy shared by the HTTP API and the command line (API keys, ...)."""
