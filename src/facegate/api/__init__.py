"""facegate.api: the HTTP API (FastAPI on uvicorn); ``create_app`` and ``run`` are imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["create_app", "run"]

_HOMES = {"create_app": "facegate.api.app", "run": "facegate.api.server"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
