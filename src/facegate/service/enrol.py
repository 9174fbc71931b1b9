"""Bulk enrolment for ``facegate enrol`` (docs/gallery.md): photos through the pipeline in full batches, each
batch's subjects in one transaction so that an acknowledged subject survives a crash (a rerun skips those whose
``meta.source_digest`` matches the same files); template imports in transactions of :data:`IMPORT_CHUNK` subjects.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from facegate.config import Limits
from facegate.errors import EmptyInputError, FacegateError, InvalidParameterError, SubjectNotFoundError
from facegate.gallery.base import EnrolItem, GalleryStore, validate_subject_id
from facegate.service.gallery import decide_enrolments

IMAGE_EXT = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif"})  # photo file endings
IMPORT_CHUNK = 10_000  # subjects per transaction of a template import
ENROL_CHUNK = 1_000  # the same, when subjects have several rows each


@dataclass
class EnrolReport:
    """What a bulk enrolment did: subjects enrolled, skipped (already enrolled from the same files) and
    refused (no photo passed), faces enrolled, and ``refused``: ``{path, subject_id, code, reason}`` of every
    image not used."""

    subjects_enrolled: int = 0
    subjects_skipped: int = 0
    subjects_refused: int = 0
    faces: int = 0
    refused: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "images_refused": len(self.refused)}


def plan(source: Path) -> dict[str, list[Path]]:
    """``{subject_id: [photo paths]}`` from a folder per subject or a ``path,subject_id`` CSV, sorted."""
    subjects: dict[str, list[Path]] = {}
    if source.is_file() and source.suffix.lower() == ".csv":
        try:  # UTF-8, with the BOM Excel writes or without
            with open(source, newline="", encoding="utf-8-sig") as fh:
                rows = list(csv.reader(fh))
        except UnicodeDecodeError as exc:
            raise InvalidParameterError(f"{source} is not UTF-8: {exc}", detail={"path": str(source)}) from None
        for i, row in enumerate(rows):
            if not row or (i == 0 and [c.strip() for c in row[:2]] == ["path", "subject_id"]):
                continue
            if len(row) < 2:
                raise InvalidParameterError(f"{source}:{i + 1}: expected path,subject_id", detail={"line": i + 1})
            # an absolute path stays as it is; a relative one is relative to the CSV's folder
            subjects.setdefault(validate_subject_id(row[1].strip(), new=True), []).append(source.parent / row[0])
    elif source.is_dir():
        for sub in sorted(d for d in source.iterdir() if d.is_dir()):
            files = sorted(f for f in sub.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXT)
            if files:
                subjects[validate_subject_id(sub.name, new=True)] = files
    else:
        raise InvalidParameterError(f"{source} is neither a folder nor a .csv file", detail={"path": str(source)})
    if not subjects:
        raise EmptyInputError(f"no subjects with photos under {source}")
    return {k: sorted(v) for k, v in sorted(subjects.items())}


def source_digest(paths: list[Path]) -> str:
    """SHA-256 over the photos' names and bytes: the same files give the same digest. A file that cannot be read
    counts as its name alone (the pipeline refuses it, with its reason, as an image not used)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with contextlib.suppress(OSError):
            h.update(p.read_bytes())
    return h.hexdigest()


def enrol_photos(
    store: GalleryStore,
    gallery: str,
    subjects: dict[str, list[Path]],
    pipeline: Any,
    limits: Limits,
    *,
    batch_size: int,
    verdict: Callable[[Any], Any] | None,
    progress: Callable[[int, int], None] = lambda *_: None,
) -> EnrolReport:
    """Enrol every subject's photos, about ``batch_size`` photos (whole subjects) per :func:`pipeline_faces`, gated by
    ``verdict(face)`` (None: every face is enrolled; :func:`~facegate.service.gallery.decide_enrolments`);
    ``progress(photos, images refused so far)`` runs after each batch and each subject skipped. The photos are a
    subject's source: one already in the gallery from other files, or enrolled by other means (no
    ``source_digest``), is replaced (embeddings and meta), as a template import does; appending would enrol the
    unchanged photos again on every rerun."""
    report = EnrolReport()
    digests: dict[str, str] = {}
    groups: list[list[tuple[str, Path]]] = [[]]  # per pipeline call: its (subject_id, photo) pairs
    for sid, paths in subjects.items():
        digests[sid] = source_digest(paths)
        with contextlib.suppress(SubjectNotFoundError):
            if store.get_subject(gallery, sid).meta.get("source_digest") == digests[sid]:  # enrolled from these
                report.subjects_skipped += 1
                progress(len(paths), 0)
                continue
        if len(groups[-1]) >= batch_size:
            groups.append([])
        groups[-1] += [(sid, p) for p in paths]
    for group in (g for g in groups if g):
        paths = [p for _, p in group]
        faces = pipeline_faces(pipeline, paths, limits)
        items: list[EnrolItem] = []
        for sid, rows, decision in decide_enrolments([sid for sid, _ in group], faces, verdict=verdict):
            report.refused += [
                {"path": str(paths[rows[r.index]]), "subject_id": sid, "code": str(r.code), "reason": r.reason}
                for r in decision.refused
            ]
            if decision.error is not None:
                report.subjects_refused += 1
                continue
            emb, q = decision.stacked()
            items.append((sid, emb, q, {"source_digest": digests[sid], "source_files": len(rows)}))
            report.faces += len(emb)  # an error below leaves with no report
        # one transaction: acknowledged from here
        report.subjects_enrolled += len(store.enrol_many(gallery, items, replace=True))
        progress(len(paths), len(report.refused))
    return report


def read_templates(path: Path, *, model: str, dim: int) -> tuple[list[str], np.ndarray, np.ndarray | None, int]:
    """``(subject_ids, (n, D) float32, (n,) float32 qualities or None, faces refused)`` from an ``.npz`` of ``ids``
    or ``paths`` beside ``embeddings`` of ``model`` (``dim`` wide, finite non-zero rows: checked here, before any
    gallery is created). With ``paths`` the subject is the photo's folder and a photo gives one face, the largest
    by ``boxes`` (else its first row), as :func:`pipeline_faces` takes; a subject's rows stay apart. A face whose
    ``enrol_accepted`` (written by ``facegate embed``: it passed the enrolment gate) is false is left out."""
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InvalidParameterError(f"cannot read templates from {path}: {exc}", detail={"path": str(path)}) from None
    if "embeddings" not in z or not {"ids", "paths"} & set(z.files):
        raise InvalidParameterError(f"{path} needs 'ids' or 'paths' beside 'embeddings'", detail={"path": str(path)})

    def bad(key: str, why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{path}: {key!r} {why}", detail={"path": str(path), "field": key})

    def array(key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        try:  # an object array (not loadable without pickle), or text where numbers belong
            a = np.asarray(z[key], dtype)
        except (TypeError, ValueError) as exc:
            raise bad(key, f"cannot be read: {exc}") from None
        if shape is not None and a.shape != shape:
            raise bad(key, f"must have shape {shape}, got {a.shape}")
        return a

    key = "ids" if "ids" in z else "paths"
    if (names := array(key)).ndim != 1:
        raise bad(key, f"must be 1-d, got shape {names.shape}")
    n = len(names)
    emb = array("embeddings", np.float32, (n, dim))
    norms = np.linalg.norm(emb, axis=1)
    if not (ok := np.isfinite(norms) & (norms > 1e-12)).all():
        raise bad("embeddings", f"row {int(np.argmin(ok))} is not finite or is zero")
    if "model" in z and str(found := array("model")) != model:
        raise bad("model", f"is {str(found)!r}, not {model!r}")
    q = array("quality", np.float32, (n,)) if "quality" in z else None
    accepted = array("enrol_accepted", bool, (n,)) if "enrol_accepted" in z else np.ones(n, bool)
    one = np.ones(n, bool)
    if key == "paths":
        box = array("boxes", np.float32, (n, 4)) if "boxes" in z else np.zeros((n, 4), np.float32)
        area = np.maximum(box[:, 2] - box[:, 0], 0) * np.maximum(box[:, 3] - box[:, 1], 0)
        first: dict[str, int] = {}
        for i in sorted(range(n), key=lambda i: -area[i]):  # stable: the first of equal areas, as max() takes
            first.setdefault(str(names[i]), i)
        one = np.isin(np.arange(n), list(first.values()))
    if q is not None and not (finite := np.isfinite(q)).all():
        raise bad("quality", f"row {int(np.argmin(finite))} is not finite")
    keep = one & accepted
    ids = [str(x) if key == "ids" else Path(str(x)).parent.name for x in names[keep]]
    for i, sid in enumerate(ids):  # one bad id would otherwise fail the import part-way
        try:
            validate_subject_id(sid, new=True)
        except InvalidParameterError as exc:
            raise bad(key, f"row {int(np.flatnonzero(keep)[i])}: {exc.message}") from None
    return ids, emb[keep], None if q is None else q[keep], int((one & ~accepted).sum())


def import_templates(
    store: GalleryStore,
    gallery: str,
    ids: list[str],
    embeddings: np.ndarray,
    qualities: np.ndarray | None = None,
    *,
    progress: Callable[[int], None] = lambda _: None,
) -> int:
    """Import templates (checked by :func:`read_templates`) in transactions of :data:`IMPORT_CHUNK` subjects;
    returns the subjects written. Rows sharing an id are enrolled together (the subject gets their quality-weighted
    template). Either way an import replaces: a subject that exists starts over from the imported rows."""
    n = len(ids)
    q = np.ones(n, np.float32) if qualities is None else np.clip(np.asarray(qualities, np.float32), 0.0, 1.0)
    emb = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)  # no zero row: read_templates refuses them
    written = 0
    if len(set(ids)) == n:
        for part in (slice(s, s + IMPORT_CHUNK) for s in range(0, n, IMPORT_CHUNK)):
            written += store.import_templates(gallery, ids[part], emb[part], q[part])
            progress(len(ids[part]))
        return written
    rows: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        rows.setdefault(sid, []).append(i)
    items: list[EnrolItem] = [(sid, emb[idx], q[idx], None) for sid, idx in rows.items()]
    for s in range(0, len(items), ENROL_CHUNK):
        chunk = items[s : s + ENROL_CHUNK]
        written += len(store.enrol_many(gallery, chunk, replace=True))
        progress(sum(len(x[1]) for x in chunk))
    return written


def read_photo(path: Path, limits: Limits) -> np.ndarray:
    """The ``(H, W, 3) uint8`` RGB image in the file at ``path``, within ``limits``' bytes and pixels. A file the
    OS cannot read is InvalidParameterError (a bad parameter, not undecodable bytes)."""
    from facegate.io.decode import decode_image

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidParameterError(f"cannot read {path}: {exc.strerror}", detail={"path": str(path)}) from None
    return decode_image(data, max_bytes=limits.max_upload_bytes, max_pixels=limits.max_pixels)


def pipeline_faces(pipeline: Any, paths: list[Path], limits: Limits) -> list[Any]:
    """Per photo at ``paths``: its largest face, from an in-process ``pipeline`` (every photo detected and embedded
    in one batch), or the FacegateError of a photo that cannot be read or has no face."""
    from facegate.pipeline.pipeline import select_faces

    out: list[Any] = [None] * len(paths)
    images, owners = [], []
    for i, p in enumerate(paths):
        try:
            images.append(read_photo(p, limits))
            owners.append(i)
        except FacegateError as exc:
            out[i] = exc
    if not images:
        return out
    chosen: list[list[Any]] = []  # per image its largest face, or none
    for j, dets in enumerate(pipeline.detect(images)):
        try:
            chosen.append(select_faces(dets))
        except FacegateError as exc:
            chosen.append([])
            out[owners[j]] = exc
    # gated with the crops: their statistics give the blur, exposure and occlusion reasons, as served
    for j, faces in enumerate(pipeline.faces_of(images, chosen)):
        if faces:
            out[owners[j]] = faces[0]
    return out
