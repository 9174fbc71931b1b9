"""LFW verification protocol (View 2): 10 identity-disjoint folds × 600 pairs.

Accuracy: mean ± std over the folds, each at the threshold best on the other nine; TAR at FMR 1e-3 over all
6,000 pairs. LFW is read from the caller's folder (``--root`` or ``FACEGATE_LFW_ROOT``), never shipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from facegate.errors import InvalidParameterError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pair:
    """One LFW pair: two image paths relative to ``lfw-deepfunneled/``, the fold, and whether it is genuine."""

    a: str
    b: str
    fold: int
    same: bool


def read_pairs(root: Path, *, check_images: bool = False) -> list[Pair]:
    """Parse ``pairs.txt`` (first line ``10 300``: folds × pairs of each kind per fold); ``check_images``: refuse
    it unless every image it lists is under ``lfw-deepfunneled/``."""
    path = Path(root) / "pairs.txt"
    if not path.is_file():
        raise InvalidParameterError(f"no pairs.txt under {root}", detail={"root": str(root)})
    lines = path.read_text().strip().splitlines() or [""]
    try:
        n_folds, n_each = (int(v) for v in lines[0].split())
    except ValueError:
        raise InvalidParameterError(f"{path} line 1 must be '<folds> <pairs each>', not {lines[0]!r}") from None
    rows = [ln.split() for ln in lines[1:]]
    if len(rows) != n_folds * 2 * n_each:
        raise InvalidParameterError(f"pairs.txt has {len(rows)} pairs, expected {n_folds * 2 * n_each}")
    pairs: list[Pair] = []
    for k, r in enumerate(rows):
        if len(r) not in (3, 4) or not (r[1].isdigit() and r[-1].isdigit()):
            raise InvalidParameterError(f"malformed pairs.txt line {k + 2}: {' '.join(r)}")
        other, idx = (r[0], r[2]) if len(r) == 3 else (r[2], r[3])  # genuine: name i j; impostor: name i other j
        a, b = f"{r[0]}/{r[0]}_{int(r[1]):04d}.jpg", f"{other}/{other}_{int(idx):04d}.jpg"  # 1-based image numbers
        pairs.append(Pair(a, b, k // (2 * n_each), len(r) == 3))
    images = pair_images(pairs) if check_images else []
    if missing := [p for p in images if not (Path(root) / "lfw-deepfunneled" / p).is_file()]:
        msg = f"{len(missing)} images of {path} are not under {root}/lfw-deepfunneled, e.g. {', '.join(missing[:3])}"
        raise InvalidParameterError(msg, detail={"root": str(root), "missing": missing[:10]})
    if n_folds < 2 or n_each < 1:  # each fold's threshold is picked on the other folds
        raise InvalidParameterError(f"{path} line 1: {lines[0]!r}; the protocol needs 2 folds or more, 1 pair or more")
    return pairs


def pair_images(pairs: Sequence[Pair]) -> list[str]:
    """Unique image paths used by the pairs, in first-use order."""
    return list(dict.fromkeys(img for p in pairs for img in (p.a, p.b)))


def best_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """Threshold maximising accuracy of ``score >= t`` on (scores, labels); midpoints between sorted scores."""
    order = np.argsort(scores)
    s, y = scores[order], labels[order].astype(bool)
    # predicting "same" for index >= i: correct = (#neg below i) + (#pos at/after i)
    neg_below = np.concatenate([[0], np.cumsum(~y)])
    pos_after = np.concatenate([np.cumsum(y[::-1])[::-1], [0]])
    edges = np.concatenate([[s[0] - 1e-6], (s[:-1] + s[1:]) / 2, [s[-1] + 1e-6]])  # candidate i: below s[i]
    return float(edges[int(np.argmax(neg_below + pos_after))])


def threshold_at_fmr(impostor: np.ndarray, fmr: float) -> float:
    """Smallest threshold ``t`` with ``mean(impostor >= t) <= fmr`` (``fmr`` < 1; ties broken conservatively), in
    the scores' own precision: a float64 step above a float32 score rounds back onto it when they are compared."""
    imp = np.sort(np.asarray(impostor))[::-1]
    k = int(np.floor(fmr * len(imp)))  # number of impostors allowed at or above t
    return float(np.nextafter(imp[k], np.asarray(np.inf, imp.dtype)))


def evaluate_scores(scores: np.ndarray, pairs: Sequence[Pair], *, fmr: float = 1e-3) -> dict[str, Any]:
    """10-fold accuracy (threshold picked on the other folds) and TAR at ``fmr`` over all pairs, from each pair's
    score ``(P,)``."""
    scores = np.asarray(scores, np.float64)
    labels = np.array([p.same for p in pairs], bool)
    folds = np.array([p.fold for p in pairs])
    accs, ths = [], []
    for f in np.unique(folds):
        train, test = folds != f, folds == f
        t = best_threshold(scores[train], labels[train])
        accs.append(float(np.mean((scores[test] >= t) == labels[test])))
        ths.append(t)
    t_fmr = threshold_at_fmr(scores[~labels], fmr)
    return {
        "accuracy_mean": float(np.mean(accs)),
        "accuracy_std": float(np.std(accs)),
        "fold_accuracies": accs,
        "fold_thresholds": ths,
        "tar_at_fmr": float(np.mean(scores[labels] >= t_fmr)),
        "fmr": fmr,
        "threshold_at_fmr": t_fmr,
        "n_pairs": len(scores),
    }


def detect_centre(pipeline, images: Sequence[np.ndarray]) -> list:
    """Per ``(H, W, 3) uint8`` image the centre-most detection, retried at detector score 0.3, or ``None``."""
    out = []
    for im, ds in zip(images, pipeline.detect(images), strict=True):
        if not ds:
            old = pipeline.detector.score_threshold
            pipeline.detector.score_threshold = 0.3
            try:
                ds = pipeline.detect([im])[0]
            finally:
                pipeline.detector.score_threshold = old
        h, w = im.shape[:2]  # LFW's subject is the face nearest the centre
        out.append(min(ds, key=lambda d: (d.box[0] + d.box[2] - w) ** 2 + (d.box[1] + d.box[3] - h) ** 2, default=None))
    return out


def embed_lfw(
    pipeline,
    root: Path,
    paths: Sequence[str],
    *,
    batch_size: int = 32,
    progress: Callable[[int], None] = lambda _: None,
) -> dict[str, np.ndarray]:
    """Per path, in order, of :func:`detect_centre`'s face: ``embeddings (N, D)``, ``quality``, ``raw`` (quality) and
    ``det_score`` ``(N,)``, all float32; NaN (``det_score`` 0) where no face was found."""
    from facegate.io.decode import decode_image

    n = len(paths)
    nan = np.full(n, np.nan, np.float32)
    emb = np.full((n, pipeline.spec.embedding_dim), np.nan, np.float32)
    out = {"embeddings": emb, "quality": nan, "raw": nan.copy(), "det_score": np.zeros(n, np.float32)}
    base = Path(root) / "lfw-deepfunneled"
    for start in range(0, n, batch_size):
        chunk = paths[start : start + batch_size]
        images = [decode_image((base / p).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26) for p in chunk]
        found = detect_centre(pipeline, images)
        for p in (p for p, d in zip(chunk, found, strict=True) if d is None):
            log.warning("no face in %s even at score 0.3", p)
        owners = [i for i, d in enumerate(found) if d is not None]
        rows = start + np.asarray(owners, np.int64)
        crops = pipeline.align(images, [found[i] for i in owners], owners)
        out["embeddings"][rows], out["quality"][rows], out["raw"][rows] = pipeline.embed(crops)
        out["det_score"][rows] = [found[i].score for i in owners]
        progress(len(chunk))
    return out


def pair_scores(pairs: Sequence[Pair], emb: Mapping[str, np.ndarray]) -> np.ndarray:
    """Cosine score per pair of the images' embeddings ``emb`` (path → ``(D,)``); −1 when either had no face."""
    s = np.empty(len(pairs), np.float64)
    for i, p in enumerate(pairs):
        a, b = emb[p.a], emb[p.b]
        s[i] = -1.0 if (np.isnan(a).any() or np.isnan(b).any()) else float(np.dot(a, b))
    return s
