"""LFW open-set identification: the model's impostor tail (for the 1:N operating point) and FNIR at FPIR.

Step 1 embeds every LFW image once (centre-most face, as ``facegate eval lfw``) and caches the
embeddings in ``data/lfw_embeddings/<model>.npz`` (an ignored folder; LFW is never committed).

Step 2 writes ``src/facegate/models/impostors/<model>.json``: the model's impostor score distribution
over every pair of images of different people (≈ 87 M pairs), as FMR(t) on a grid of thresholds, the
smallest FMR those pairs can measure, and a stated tail model for FMRs beyond it (see
:mod:`facegate.service.fpir`).

Step 3 runs the open-set protocol and writes ``benchmarks/results/lfw_open_set-<machine>-<model>.json``
(``--machine``, e.g. ``cpu2``):

* gallery: one photo (the first) of each identity with at least 2 photos, for gallery sizes N drawn at
  random from those identities;
* mated probes: the other photos of the enrolled identities;
* non-mated probes: every photo of the identities with exactly one photo (never enrolled).

For each N it reports FNIR (the mate is not the rank-1 hit at or above the threshold) at FPIR 1e-2 and
1e-3, once with the threshold measured on the non-mated probes and once with the threshold that
:func:`facegate.service.fpir.threshold_for` predicts from the impostor tail (with the FPIR it measured).

Usage (about 15 minutes of CPU on two cores for the embeddings, seconds on a GPU)::

    FACEGATE_LFW_ROOT=/path/to/lfw python benchmarks/lfw_open_set.py --model sface [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("lfw_open_set")
REPO = Path(__file__).resolve().parents[1]


def embed_all(root: Path, model: str, device: str, cache: Path) -> tuple[list[str], np.ndarray]:
    """``(paths, (n, D) float32)`` of every LFW image (NaN rows where no face was found), cached."""
    if cache.is_file():
        z = np.load(cache)
        return [str(p) for p in z["paths"]], z["embeddings"]
    from tqdm import tqdm

    from facegate.config import Settings
    from facegate.eval.lfw import embed_lfw
    from facegate.pipeline.pipeline import FacePipeline

    base = root / "lfw-deepfunneled"
    paths = sorted(str(p.relative_to(base)) for p in base.glob("*/*.jpg"))
    pipeline = FacePipeline.from_settings(Settings(model=model, device=device))
    with tqdm(total=len(paths), unit="img", desc="embed", file=sys.stderr) as bar:
        out = embed_lfw(pipeline, root, paths, batch_size=64, progress=bar.update)["embeddings"]
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(cache, paths=np.array(paths), embeddings=out)
    return paths, out


def impostor_histogram(emb: np.ndarray, ids: np.ndarray, bins: int = 4000) -> tuple[np.ndarray, np.ndarray, int]:
    """Counts of every impostor pair's score in ``bins`` equal bins over ``[-1, 1]``: ``(edges, counts, n)``."""
    edges = np.linspace(-1.0, 1.0, bins + 1)
    counts = np.zeros(bins, np.int64)
    n = len(emb)
    for s in range(0, n, 1024):
        block = emb[s : s + 1024] @ emb.T
        rows = np.arange(s, min(s + 1024, n))
        mask = (np.arange(n)[None, :] > rows[:, None]) & (ids[rows][:, None] != ids[None, :])
        counts += np.histogram(block[mask], bins=edges)[0]
    return edges, counts, int(counts.sum())


def tail_table(edges: np.ndarray, counts: np.ndarray, n: int, model: str) -> dict[str, object]:
    """FMR(t) at each bin edge with at least 10 impostors above it, and the exponential tail fitted to the
    measured points with FMR in [100/n, 1e-3] (log FMR linear in t), used beyond the measured range."""
    above = n - np.concatenate(([0], np.cumsum(counts)))  # pairs with score >= edges[i]
    keep = above >= 10
    t, fmr = edges[keep], above[keep] / n
    fit = (fmr <= 1e-3) & (fmr >= 100.0 / n)
    slope, intercept = np.polyfit(t[fit], np.log(fmr[fit]), 1)
    step = max(1, int(keep.sum() // 400))
    return {
        "model": model,
        "impostor_pairs": n,
        "source": "every pair of LFW images of different people (benchmarks/lfw_open_set.py)",
        "thresholds": [round(float(x), 5) for x in t[::step]] + [round(float(t[-1]), 5)],
        "fmr": [float(f) for f in fmr[::step]] + [float(fmr[-1])],
        "min_measured_fmr": float(fmr[-1]),
        "tail": {
            "model": "log FMR(t) = intercept + slope * t, fitted where 100/n <= FMR <= 1e-3",
            "slope": float(slope),
            "intercept": float(intercept),
        },
    }


def open_set(paths: list[str], emb: np.ndarray, sizes: list[int], seed: int = 0) -> list[dict[str, object]]:
    """FNIR at FPIR 1e-2 / 1e-3 per gallery size (see the module docstring)."""
    from facegate.models.registry import get_spec
    from facegate.service.fpir import ImpostorTail, threshold_for

    ids = np.array([p.split("/", 1)[0] for p in paths])
    ok = ~np.isnan(emb).any(axis=1)
    by_id: dict[str, list[int]] = {}
    for i in np.flatnonzero(ok):
        by_id.setdefault(str(ids[i]), []).append(int(i))
    multi = sorted(k for k, v in by_id.items() if len(v) >= 2)
    single = [v[0] for k, v in by_id.items() if len(v) == 1]
    point = get_spec(MODEL).thresholds
    tail = ImpostorTail.load(MODEL, fallback=(point.match, point.match_fmr))
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        chosen = rng.permutation(multi)[: min(n, len(multi))]
        gal = np.array([by_id[c][0] for c in chosen])
        mated = [(j, r) for j, c in enumerate(chosen) for r in by_id[c][1:]]
        g = emb[gal]
        s_non = (emb[single] @ g.T).max(axis=1)
        s_mat = emb[[r for _, r in mated]] @ g.T
        top = s_mat.argmax(axis=1)
        top_s = s_mat.max(axis=1)
        right = top == np.array([j for j, _ in mated])
        row: dict[str, object] = {"gallery": len(gal), "mated_probes": len(mated), "non_mated_probes": len(single)}
        for fpir in (1e-2, 1e-3):
            t_emp = float(np.quantile(s_non, 1 - fpir))
            t_mod, _ = threshold_for(tail, len(gal), fpir)
            row[f"fpir_{fpir:g}"] = {
                "threshold_measured": round(t_emp, 4),
                "fnir_measured_threshold": round(float(np.mean(~(right & (top_s >= t_emp)))), 4),
                "threshold_model": round(t_mod, 4),
                "fpir_at_model_threshold": round(float(np.mean(s_non >= t_mod)), 5),
                "fnir_at_model_threshold": round(float(np.mean(~(right & (top_s >= t_mod)))), 4),
            }
        out.append(row)
    return out


MODEL = "sface"


def main() -> None:
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sface")
    ap.add_argument("--machine", default="cpu2", help="machine name in the result's file name (h200, cpu2, ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--root", default=os.environ.get("FACEGATE_LFW_ROOT"))
    ap.add_argument("--sizes", default="100,300,1000,1680")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    MODEL = args.model
    root = Path(args.root)
    t0 = time.perf_counter()
    paths, emb = embed_all(root, args.model, args.device, REPO / "data" / "lfw_embeddings" / f"{args.model}.npz")
    log.info("embeddings of %d images in %.1f s", len(paths), time.perf_counter() - t0)
    ok = ~np.isnan(emb).any(axis=1)
    ids = np.array([p.split("/", 1)[0] for p in paths])
    edges, counts, n = impostor_histogram(emb[ok], ids[ok])
    table = tail_table(edges, counts, n, args.model)
    dest = REPO / "src" / "facegate" / "models" / "impostors" / f"{args.model}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(table, indent=1) + "\n")
    log.info("wrote %s (%d impostor pairs)", dest, n)
    rows = open_set(paths, emb, [int(x) for x in args.sizes.split(",")])
    res = REPO / "benchmarks" / "results" / f"lfw_open_set-{args.machine}-{args.model.replace('_', '')}.json"
    res.write_text(
        json.dumps(
            {
                "protocol": "gallery: first photo of each identity with >= 2 photos (N at random); mated probes: "
                "their other photos; non-mated probes: identities with one photo",
                "images": len(paths),
                "images_without_face": int((~ok).sum()),
                "by_gallery_size": rows,
                "command": " ".join(["python", *sys.argv]),
            },
            indent=1,
        )
        + "\n"
    )
    log.info("wrote %s", res)


if __name__ == "__main__":
    main()
