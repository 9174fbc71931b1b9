"""Reading a gallery store's templates back, for the store, service and enrolment tests (pyproject.toml puts
``tests/`` on the path)."""

from __future__ import annotations

import numpy as np

from facegate.gallery.base import GalleryStore


def stored_templates(store: GalleryStore, gallery: str) -> tuple[list[str], np.ndarray]:
    """``(subject_ids, (S, D) float32)`` of ``gallery`` as stored (the start-up load), by subject id."""
    _, ids, templates = store.load_snapshot()[1][gallery]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return [ids[i] for i in order], templates[order]


def stored_template(store: GalleryStore, gallery: str, subject_id: str) -> np.ndarray:
    """A subject's stored ``(D,) float32`` template."""
    ids, templates = stored_templates(store, gallery)
    return templates[ids.index(subject_id)]
