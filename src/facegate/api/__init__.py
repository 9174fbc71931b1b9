"""facegate.api: the HTTP API (FastAPI on uvicorn): ``app.create_app``; ``facegate serve`` runs it."""
