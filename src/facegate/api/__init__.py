"""facegate.api: the HTTP API (FastAPI on uvicorn).

Entry points: :func:`facegate.api.app.create_app` (the app factory) and
:func:`facegate.api.server.run` (what ``facegate serve`` calls). Imported lazily, so that importing
``facegate.api.errors`` or ``.schemas`` alone stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["create_app", "run"]

_HOMES = {"create_app": "facegate.api.app", "run": "facegate.api.server"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
