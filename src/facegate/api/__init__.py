"""facegate.api: the HTTP API (FastAPI on uvicorn): ``app.create_app`` and ``server.run``."""
