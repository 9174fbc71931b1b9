"""facegate.api: the HTTP API (FastAPI on uvicorn).

Entry points: :func:`facegate.api.app.create_app` (the app factory) and
:func:`facegate.api.app.run` (what ``facegate serve`` calls). Imported lazily, so that importing
``facegate.api.errors`` or ``.schemas`` alone stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from facegate.api import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
