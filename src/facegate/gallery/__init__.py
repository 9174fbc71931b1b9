"""facegate.gallery: the store of record (SQLite or PostgreSQL) with its change feed, and the search index."""

from __future__ import annotations

from pathlib import Path

from facegate.errors import InvalidParameterError
from facegate.gallery.base import GalleryStore


def open_store(url: str | None, *, data_dir: Path | str = "./data", open_retry_s: float = 60.0) -> GalleryStore:
    """The store ``url`` names: ``postgresql://…`` or ``postgres://…``; ``sqlite:///path`` or a plain path; None:
    SQLite at ``<data_dir>/gallery.sqlite3``. ``open_retry_s``: how long opening retries a busy or unreachable store."""
    if url and url.startswith(("postgresql://", "postgres://")):
        from facegate.gallery.postgres import PostgresGalleryStore

        return PostgresGalleryStore(url, connect_timeout_s=min(max(open_retry_s, 1.0), 30.0))
    from facegate.gallery.sqlite import SQLiteGalleryStore

    if url and "://" in url and not url.startswith("sqlite:///"):
        raise InvalidParameterError(
            f"unsupported gallery URL scheme in {url.split('://')[0]!r}://…: use postgresql:// or sqlite:///",
            detail={"field": "gallery_url"},
        )
    path = (url.removeprefix("sqlite:///") or ":memory:") if url else Path(data_dir) / "gallery.sqlite3"
    return SQLiteGalleryStore(path, open_retry_s=open_retry_s)


__all__ = ["open_store"]
