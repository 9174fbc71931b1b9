"""Logging: one line per record (control characters escaped), optional JSON, no server paths in errors.

A request path can carry ``%0a``; logged as is, it would start a forged line: every control character is written
as ``\\xNN``. Subject ids and image contents are never logged above DEBUG.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: An absolute POSIX path of two or more components (``/srv/facegate/data/gallery.sqlite3``).
_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def escape(text: str) -> str:
    """``text`` with every control character (line breaks included) written as ``\\xNN`` / ``\\uNNNN``."""
    return _CONTROL.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text
    )


def redact_paths(value: Any) -> Any:
    """A copy of a JSON-ready value with absolute file paths in its strings replaced by ``<path>``."""
    if isinstance(value, str):
        return _PATH.sub("<path>", value)
    if isinstance(value, dict):
        return {k: redact_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_paths(v) for v in value]
    return value


class EscapingFormatter(logging.Formatter):
    """The text format, one line per record."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        s = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        # keep a traceback readable, but no line of it may pass for a record of its own
        for extra in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if extra:
                s += "\n" + "\n".join("    | " + escape(line) for line in extra.splitlines())
        return s


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``process``, ``message`` and, with one,
    ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=True, default=str)


def configure_logging() -> None:
    """Log to stderr at ``FACEGATE_LOG_LEVEL`` (default INFO) in ``FACEGATE_LOG_FORMAT`` (``text``, the default,
    or ``json``), replacing the root logger's handlers (uvicorn's loggers propagate to it)."""
    as_json = os.environ.get("FACEGATE_LOG_FORMAT", "text").lower() == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else EscapingFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("FACEGATE_LOG_LEVEL", "INFO").upper())
    # python-multipart warns once per malformed part header: a client could fill the log with them
    logging.getLogger("python_multipart").setLevel(logging.ERROR)
