"""Recompute the crop statistics (sharpness, brightness, flat area) of a P1 feature file on the CPU.

Each face's aligned crop is rebuilt from the file's landmarks and the deterministic degradation of its photo
(``quality_p1_features.plan``), so a change to ``facegate.quality_reasons.crop_stats`` needs no new GPU pass:

    python benchmarks/quality_p1_restat.py out/p1_half1.npz out/p1_half1_r.npz

The crops are exactly those of the GPU pass: the unchanged statistics come out equal (checked, printed).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from facegate.eval.degrade import path_rng
from facegate.io.decode import decode_image
from facegate.pipeline.align import align_cpu
from facegate.quality_reasons import crop_stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_eval import load_table
from quality_p1_features import degrade, plan

log = logging.getLogger("quality_p1_restat")
COLUMNS = ("sharpness", "luma", "flat")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("features", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--lfw", type=Path, default=Path("/work/shared/data/lfw"))
    a = ap.parse_args()
    t = load_table([a.features])
    base = a.lfw / "lfw-deepfunneled"
    stats = np.full((t["path"].size, len(COLUMNS)), np.nan)
    img, lm = None, None
    for i, (q, v) in enumerate(zip(t["path"], t["variant"], strict=True)):
        if v == 0:  # a photo's rows start with its clean face, whose landmarks drew the face-drawn degradations
            img = decode_image((base / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
            lm = t["landmarks"][i].astype(np.float64) if t["found"][i] else None
        if not t["found"][i]:
            continue
        name, s = plan(q)[v]
        im = img if v == 0 else degrade(img, name, s, path_rng(q, 10 + int(v)), lm)
        stats[i] = crop_stats(align_cpu([im], t["landmarks"][i][None], np.zeros(1, np.int64)))[0]
    raw = dict(np.load(a.features))
    for c, k in enumerate(COLUMNS):
        f = t["found"]
        log.info("%s: largest change %.4g", k, float(np.nanmax(np.abs(stats[f, c] - raw[k][f]))))
        raw[k] = stats[:, c]
    np.savez(a.out, **raw)


if __name__ == "__main__":
    main()
