"""Policy shared by the HTTP API and the CLI: the face service over the engine (quality gate, compare)."""
