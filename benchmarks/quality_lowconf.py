"""The ``low_confidence`` reason ("face hard to find"): which per-face signal says the detector is unsure, measured on
labelled strata of LFW photos.

Every pairs.txt photo (``--clean-photos``, default all) goes through the CPU pipeline as served (largest face): the
negatives of every limit, the real stratum (a face fails when its pairs.txt genuine comparison, clean against
clean, misses the match threshold) and the clean-refusal guardrail at the verify gate. A sample of ``--photos`` of
them also goes through as each degradation that makes a face harder to find: sensor-like grain
(``facegate.eval.degrade.noise``), the face partly out of the frame (``cut``: 10-50 % of the clean face box's width
cut off, ``quality_strata.frame_cut``) and heavy JPEG compression (``facegate.eval.degrade.jpeg``), each at
severity 1-5. Positives: a family's faces at severity ≥ 3, found; a photo whose face is not found is a failure to
acquire, not a positive.

Recorded per face: the detector's score as shipped (``sqrt(cls · obj)``, OpenCV's rule), its class and objectness
probabilities apart (the kept anchor's), the landmarks, the box (clipped to the photo, as served) and the box as
the network predicted it (unclipped), the photo's size, the quality score and the other reasons. Signals compared:

- ``det_score``, ``cls``, ``obj``: fire below the limit;
- ``lm_residual``: RMS distance, in 112-crop pixels, of the 5 landmarks from the ArcFace template after the
  similarity (Umeyama) fit that alignment makes (:func:`lowconf_analysis.landmark_residual`);
- ``out_of_box``: share of the face region that the landmarks imply (the aligned crop's face region, mapped back
  to the photo) lying outside the detected box as served (:func:`facegate.quality_reasons.face_outside_box`);
- ``out_of_photo``: the same region's share outside the photo (needs the photo's size, which a detection does not
  carry), and ``box_out_of_photo``: the unclipped box's share outside the photo.

Each limit is chosen on nine identity folds and measured on the tenth by the rule of
``quality_eval.reasons_study`` (at most 0.2 % of clean faces, the most lenient limit finding 85 % of the
positives). Two signals together ("either fires") get each a limit at half that clean budget (0.1 %), so that
their union keeps it. The shipped rule (``face_reasons`` at the shipped settings) is measured as served.

    python benchmarks/quality_lowconf.py --photos 500 --raw out/lowconf_raw.npz
    python benchmarks/quality_lowconf.py --from-raw out/lowconf_raw.npz   # the analysis again, no pipeline
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, pair_photo_sample
from facegate.config import Settings
from facegate.errors import NoFaceError
from facegate.eval.degrade import path_rng
from facegate.eval.lfw import pair_images, read_pairs
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from lowconf_analysis import analyse
from quality_strata import VARIANTS

log = logging.getLogger("quality_lowconf")
FAMILIES = ("grain", "cut", "jpeg")
DEGRADED = tuple(f"{fam}{s}" for fam in FAMILIES for s in range(1, 6))


class RawTap:
    """Keeps the detector's last preprocessed batch and finds the kept detection's anchor again in the network's raw
    outputs: its class and objectness probabilities, whose ``sqrt(cls · obj)`` is the detector's score. The CPU
    detector runs the network through ONNX Runtime, which returns the score only, so the batch is run again through
    the torch network the runtime's graph was exported from (the two agree to the parity check's 2e-4)."""

    def __init__(self, pipe: FacePipeline) -> None:
        det = pipe.detector
        self.model = getattr(det.model, "torch_model", det.model)
        self.inner = det._host_outputs
        self.batch: Any = None
        det._host_outputs = self  # type: ignore[method-assign]

    def __call__(self, batch: Any) -> Any:
        self.batch = batch
        return self.inner(batch)

    def anchor(self, score: float, box: np.ndarray) -> tuple[float, float, np.ndarray]:
        """``(cls, obj, unclipped box (4,) in photo pixels)`` of the one-photo batch's anchor with the nearest score
        to ``score`` (within 2e-3) and, among those, the nearest clipped box to ``box``."""
        import torch

        from facegate.models.yunet import decode_yunet

        batch = self.batch
        x = torch.from_numpy(np.ascontiguousarray(batch.images)).permute(0, 3, 1, 2).flip(1).float()
        with torch.inference_mode():
            cls, obj, bbox, kps = self.model(x)
        boxes, _, scores = decode_yunet(cls, obj, bbox, kps, input_hw=batch.input_hw)
        c = torch.cat(list(cls), 1)[0, :, 0].numpy()
        o = torch.cat(list(obj), 1)[0, :, 0].numpy()
        s = scores[0].numpy()
        scale = batch.orig_sizes[0, ::-1] / batch.resized_sizes[0, ::-1]  # (sx, sy)
        b = boxes[0].numpy().astype(np.float64) * np.tile(scale, 2)
        hw = batch.orig_sizes[0]
        clipped = np.minimum(np.maximum(b, 0), np.tile(hw[::-1], 2))
        cand = np.flatnonzero(np.abs(s - score) <= 2e-3)
        if cand.size == 0:
            cand = np.array([int(np.argmin(np.abs(s - score)))])
        i = cand[np.argmin(np.abs(clipped[cand] - box).sum(1))]
        return float(c[i]), float(o[i]), b[i]


def collect(a: argparse.Namespace) -> dict[str, np.ndarray]:
    """Every clean photo, and the sample's degradations, through the CPU pipeline; one row per photo and variant."""
    folds, sample = pair_photo_sample(a.lfw, a.photos)
    sample_set = set(sample)
    every = sorted(pair_images(read_pairs(a.lfw)))
    every = every[:: max(1, len(every) // a.clean_photos)][: a.clean_photos] if a.clean_photos else []
    every = sorted(set(every) | sample_set)
    pipe = FacePipeline.from_settings(Settings(device="cpu", precision="fp32"))
    tap = RawTap(pipe)
    keys = ("path", "variant", "found", "score", "cls", "obj", "box", "rawbox", "lm", "hw", "quality", "other", "emb")
    rows: dict[str, list[Any]] = {k: [] for k in keys}
    nan4 = np.full(4, np.nan)

    def add(q: str, name: str, img: np.ndarray, keep_emb: bool) -> np.ndarray | None:
        try:
            face = pipe.faces([img])[0][0]
        except NoFaceError:
            face = None
        d = None if face is None else face.detection
        cls, obj, rawbox = (np.nan, np.nan, nan4) if d is None else tap.anchor(d.score, np.asarray(d.box, np.float64))
        other = face is not None and any(r.code != "low_confidence" for r in face.quality.reasons)
        vals = (
            q,
            name,
            face is not None,
            np.nan if d is None else d.score,
            cls,
            obj,
            nan4 if d is None else np.asarray(d.box, np.float64),
            rawbox,
            np.full((5, 2), np.nan) if d is None else np.asarray(d.landmarks, np.float64),
            np.asarray(img.shape[:2], np.int64),
            np.nan if face is None else face.quality.score,
            other,
            np.full(128, np.nan, np.float32) if face is None or not keep_emb else face.embedding,
        )
        for k, v in zip(keys, vals, strict=True):
            rows[k].append(v)
        return None if d is None else np.asarray(d.box, np.float64)

    t0 = time.perf_counter()
    for n, q in enumerate(every, 1):
        img = decode_image((a.lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        box = add(q, "clean", img, True)
        if q in sample_set:
            for k, name in enumerate(DEGRADED):
                if box is None and name.startswith("cut"):  # the clean face was not found: nothing to cut around
                    continue
                add(q, name, np.ascontiguousarray(VARIANTS[name](img, path_rng(q, 60 + k), box)), False)
        if n % 500 == 0:
            log.info("%d/%d photos, %.0f s", n, len(every), time.perf_counter() - t0)
    out = {k: np.asarray(v) for k, v in rows.items()}
    out["fold"] = np.asarray([folds[p.split("/")[0]] for p in out["path"]], np.int64)
    gate, match = float(pipe.operating.quality_threshold), float(pipe.operating.match_threshold)
    out["meta"] = np.asarray([gate, match, time.perf_counter() - t0, a.photos, len(every)], np.float64)
    env = env_record()
    out["collected"] = np.asarray(
        [" ".join(["python benchmarks/quality_lowconf.py", *sys.argv[1:]]), env["git_commit"], env["time_utc"]]
    )
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "../shared/data/lfw")))
    ap.add_argument("--photos", type=int, default=500, help="photos also run degraded")
    ap.add_argument("--clean-photos", type=int, default=7701, help="clean pairs.txt photos (the sample's are added)")
    ap.add_argument("--raw", type=Path, help="also write the per-face rows here (.npz)")
    ap.add_argument("--from-raw", type=Path, help="analyse these rows instead of running the pipeline")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_lowconf-cpu2.json"))
    a = ap.parse_args()
    if a.from_raw:
        r = dict(np.load(a.from_raw, allow_pickle=False))
    else:
        r = collect(a)
        if a.raw:
            a.raw.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(a.raw, **r)
    rep = analyse(r, read_pairs(a.lfw), FAMILIES)
    rep = {
        "command": "python benchmarks/quality_lowconf.py " + " ".join(sys.argv[1:]),
        **rep,
        "env": env_record(photos=int(r["meta"][3]), clean_photos=int(r["meta"][4]), seconds=round(r["meta"][2], 1)),
    }
    a.out.write_text(json.dumps(rep, indent=1))
    log.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
