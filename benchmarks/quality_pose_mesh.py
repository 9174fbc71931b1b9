"""The pose reason against mesh-rendered head turns and mesh-labelled real poses, through facegate's CPU pipeline.

Reads the ``.npz`` of ``benchmarks/pose_mesh.py`` (mediapipe's 3D FaceMesh of every pairs.txt photo, its yaw label,
the mesh's triangles, and the rendered turns' yaw labels measured again by FaceMesh). Each sampled photo is turned by
0-75° about a vertical axis with its own mesh (:func:`pose_mesh.render_turn`, the side from its path) and re-detected
(the CPU pipeline, the centre-most face): the shipped landmark yaw of the turned
face, where its 5 landmarks lie against the mesh's own turned surface, its quality and whether it still matches its
genuine pairs.txt partners. A render's yaw label is its photo's mesh yaw plus the turn.

Every clean pairs.txt photo goes through the CPU pipeline as served (largest face, quality, reasons): the negatives,
the real stratum (labelled by the mesh) and the clean-refusal guardrail at the verify gate.

Limits are chosen on nine identity-disjoint folds and measured on the tenth (at most 0.2 % of clean faces firing,
the most lenient limit finding 85 % of positives, as ``quality_eval.reasons_study``).

    /work/venv-mp/bin/python benchmarks/pose_mesh.py --out out/pose_mesh.npz
    python benchmarks/quality_pose_mesh.py --mesh out/pose_mesh.npz --raw out/pose_mesh_raw.npz
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
from facegate.config import QualitySettings, Settings
from facegate.errors import NoFaceError
from facegate.eval.lfw import detect_centre, read_pairs
from facegate.io.decode import decode_image
from facegate.pipeline.pipeline import FacePipeline
from facegate.quality_reasons import NOSE_DEPTH_IOD, NOSE_FRONTAL_T, landmark_geometry
from pose_mesh import lift, render_turn, turn_mesh
from quality_eval import choose_limit, past_limit, precision_recall

log = logging.getLogger("quality_pose_mesh")
THRESHOLDS = (45, 50, 60)
GUARDRAIL = 0.005  # clean faces refused at the verify gate, at most
YAW_BINS = ((0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 90))


def med(v: np.ndarray) -> float | None:
    """Median of the finite values of ``v``, None when there are none."""
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else None


def held_out(pos: np.ndarray, pos_fold: np.ndarray, neg: np.ndarray, neg_fold: np.ndarray) -> dict[str, Any]:
    """Precision and recall of a yaw limit (fires above it) chosen on nine folds, pooled over the tenths;
    ``pos``, ``neg``: ``(K,)`` |yaw| values, ``*_fold``: ``(K,) int`` their identity folds."""
    limits, pos_fired, neg_fired = [], [], []
    for f in range(10):
        lim = choose_limit(pos[pos_fold != f], neg[neg_fold != f], +1, max_clean=0.002, min_recall=0.85)
        limits.append(round(lim, 2))
        pos_fired.append(past_limit(pos[pos_fold == f], lim, 1))
        neg_fired.append(past_limit(neg[neg_fold == f], lim, 1))
    return {**precision_recall(np.concatenate(pos_fired), np.concatenate(neg_fired)), "fold_limits": limits}


def foreshortening(lm: np.ndarray) -> float:
    """Eye distance over eye-mouth height of ``(5, 2)`` landmarks: falls as ``cos(yaw)``, independent of the nose."""
    h = float(np.linalg.norm((lm[3] + lm[4] - lm[0] - lm[1]) / 2))
    return float(np.linalg.norm(lm[1] - lm[0])) / max(h, 1e-6)


_FIT_GRID = np.radians(np.arange(0.0, 90.25, 0.25))


def yaw_fit(lm: np.ndarray, frontal: float) -> float:
    """Yaw of ``(5, 2)`` landmarks from both cues a turn moves, fitted to a rigid mean face: over the eye-mouth
    height (which a turn leaves alone) the nose's offset reads ``NOSE_DEPTH_IOD · frontal · sin(yaw)`` and the eye
    distance ``frontal · cos(yaw)``; least squares over yaw on a 0.25° grid, the sign from the nose. ``frontal``:
    a frontal face's eye distance over eye-mouth height."""
    eyes, mouth = (lm[0] + lm[1]) / 2, (lm[3] + lm[4]) / 2
    axis = mouth - eyes
    h = float(np.linalg.norm(axis))
    if h < 1e-6:
        return 0.0
    u, rel = axis / h, lm[2] - eyes
    across = -float(u[0] * rel[1] - u[1] * rel[0]) / h
    f = float(np.linalg.norm(lm[1] - lm[0])) / h
    err = (abs(across) - NOSE_DEPTH_IOD * frontal * np.sin(_FIT_GRID)) ** 2 + (f - frontal * np.cos(_FIT_GRID)) ** 2
    return float(np.copysign(np.degrees(_FIT_GRID[int(np.argmin(err))]), across))


def read(lfw: Path, q: str) -> np.ndarray:
    """``(H, W, 3) uint8`` RGB photo ``person/file.jpg`` of LFW."""
    return decode_image((lfw / "lfw-deepfunneled" / q).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)


def collect(a: argparse.Namespace, m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Render, re-detect and embed the sample's turns; run every clean pairs.txt photo through the pipeline."""
    folds, sample = pair_photo_sample(a.lfw, a.photos)
    if list(m["sample"]) != [q for q in sample if q in set(m["sample"])]:
        raise SystemExit("the mesh file's sample is not this LFW's pairs.txt sample: run pose_mesh.py again")
    pipe = FacePipeline.from_settings(Settings(device="cpu", precision="fp32"))
    row = {q: i for i, q in enumerate(m["paths"])}
    tris, angles = m["triangles"], [int(v) for v in m["angles"]]
    nan5 = np.full((5, 2), np.nan)
    turn: dict[str, list[Any]] = {k: [] for k in ("path", "deg", "side", "lm0", "ideal", "det", "score", "emb")}
    t0 = time.perf_counter()
    for q, side in zip(m["sample"], m["sample_side"], strict=True):
        img, mesh = read(a.lfw, q), m["mesh"][row[q]].astype(np.float64)
        d0 = detect_centre(pipe, [img])[0]
        if d0 is None:
            continue
        lm0 = np.asarray(d0.landmarks, np.float64)
        idx, wts = lift(lm0, mesh, tris)
        for deg in angles:
            r = render_turn(img, mesh, tris, int(side) * deg)
            turned = turn_mesh(mesh, int(side) * deg)
            ideal = (turned[idx, :2] * wts[:, :, None]).sum(axis=1)
            d = detect_centre(pipe, [r])[0]
            if d is None:
                emb, score, got = np.full(128, np.nan, np.float32), np.nan, nan5
            else:
                e, qs, _ = pipe.embed(pipe.align([r], [d], [0]))
                emb, score, got = np.asarray(e[0], np.float32), float(qs[0]), np.asarray(d.landmarks, np.float64)
            for k, v in zip(turn, (q, deg, int(side), lm0, ideal, got, score, emb), strict=True):
                turn[k].append(v)
    t_turn = time.perf_counter() - t0
    gate = float(pipe.operating.quality_threshold)
    clean: dict[str, list[Any]] = {k: [] for k in ("path", "found", "lm", "score", "other_refusal", "emb")}
    for n, q in enumerate(m["paths"], 1):
        try:
            face = pipe.faces([read(a.lfw, q)])[0][0]
        except NoFaceError:
            face = None
        clean["path"].append(q)
        clean["found"].append(face is not None)
        clean["lm"].append(nan5 if face is None else np.asarray(face.detection.landmarks, np.float64))
        clean["score"].append(np.nan if face is None else face.quality.score)
        clean["emb"].append(np.full(128, np.nan, np.float32) if face is None else face.embedding)
        # refused for anything but pose (the pose reason is recomputed, under each limit)
        other = face is not None and (face.quality.score < gate or any(r.code != "pose" for r in face.quality.reasons))
        clean["other_refusal"].append(other)
        if n % 1000 == 0:
            log.info("%d/%d clean photos, %.0f s", n, len(m["paths"]), time.perf_counter() - t0)
    out = {k: np.asarray(v) for k, v in turn.items()} | {f"clean_{k}": np.asarray(v) for k, v in clean.items()}
    out["fold_of_path"] = np.asarray([folds[p.split("/")[0]] for p in out["path"]], np.int64)
    out["clean_fold"] = np.asarray([folds[p.split("/")[0]] for p in out["clean_path"]], np.int64)
    match = float(pipe.operating.match_threshold)
    out["meta"] = np.asarray([gate, t_turn, time.perf_counter() - t0, a.photos, match], np.float64)
    return out


def partners(paths: np.ndarray, lfw: Path) -> dict[str, list[str]]:
    """Each photo's genuine pairs.txt partners."""
    out: dict[str, list[str]] = {str(q): [] for q in paths}
    for p in read_pairs(lfw):
        if p.same:
            out.setdefault(p.a, []).append(p.b)
            out.setdefault(p.b, []).append(p.a)
    return out


def fixed_pr(pos: np.ndarray, neg: np.ndarray, limit: float) -> dict[str, float]:
    """Precision, recall and clean firing of ``|yaw| > limit`` on positive and negative ``|yaw|`` values."""
    return {**precision_recall(pos > limit, neg > limit), "limit": float(limit)}


def analyse(r: dict[str, np.ndarray], m: dict[str, np.ndarray], lfw: Path) -> dict[str, Any]:
    """Per-turn tables, held-out and shipped-limit precision and recall on the rendered and the real strata, the
    agreement of the landmark yaw with the mesh's, and the clean-refusal guardrail."""
    qs = QualitySettings()
    gate, match = float(r["meta"][0]), float(r["meta"][4])
    row = {q: i for i, q in enumerate(m["paths"])}
    mp_yaw = m["yaw"]
    cf = r["clean_found"].astype(bool)
    clm = r["clean_lm"][cf]
    cpath = r["clean_path"][cf]
    # frontal eye distance over eye-mouth height (for the fit of both cues): clean faces under 10° by the mesh
    c_mp = mp_yaw[[row[q] for q in cpath]]
    frontal = float(np.median([foreshortening(x) for x in clm[np.abs(c_mp) < 10]]))
    est = {"yaw": lambda lm: landmark_geometry(lm)[1], "yaw_fit": lambda lm: yaw_fit(lm, frontal)}
    c_yaw = {k: np.array([f(x) for x in clm]) for k, f in est.items()}
    ok = np.isfinite(c_mp)
    sign = float(np.sign(np.corrcoef(c_yaw["yaw"][ok], c_mp[ok])[0, 1]))  # the two conventions' relative sign
    emb_of = {q: e for q, e in zip(cpath, r["clean_emb"][cf], strict=True)}
    part = partners(m["paths"], lfw)

    def fails(q: str, e: np.ndarray) -> bool | None:
        """Whether embedding ``e`` of photo ``q`` misses the match threshold against one of its genuine partners."""
        sims = [float(e @ emb_of[p]) for p in part.get(q, []) if p in emb_of]
        return None if not sims or not np.isfinite(e).all() else min(sims) < match

    found = np.isfinite(r["det"][:, 0, 0])
    src_mp = mp_yaw[[row[q] for q in r["path"]]]
    label = src_mp + r["side"] * r["deg"]
    det_yaw = {k: np.array([f(x) if np.isfinite(x).all() else np.nan for x in r["det"]]) for k, f in est.items()}
    lm0_yaw = np.array([landmark_geometry(x)[1] for x in r["lm0"]])
    ideal_yaw = np.array([landmark_geometry(x)[1] for x in r["ideal"]])
    lm0_fit = np.array([yaw_fit(x, frontal) for x in r["lm0"]])
    iod0 = np.linalg.norm(r["lm0"][:, 1] - r["lm0"][:, 0], axis=1)
    lag = r["side"][:, None] * (r["det"][:, :, 0] - r["ideal"][:, :, 0]) / iod0[:, None]
    fail = np.array([fails(q, e) for q, e in zip(r["path"], r["emb"], strict=True)], dtype=object)
    s_idx = {q: k for k, q in enumerate(m["sample"])}
    angles = [int(v) for v in m["angles"]]
    per_angle = {}
    for deg in angles:
        mk, mf = r["deg"] == deg, (r["deg"] == deg) & found
        ch = sign * r["side"][mf] * (det_yaw["yaw"][mf] - lm0_yaw[mf])
        fl = [bool(v) for v in fail[mf] if v is not None]
        re = np.array([m["remeshed_yaw"][s_idx[q], angles.index(deg)] for q in r["path"][mk]])
        re0 = np.array([m["remeshed_yaw"][s_idx[q], 0] for q in r["path"][mk]])
        per_angle[str(deg)] = {
            "faces": int(mk.sum()),
            "found": float(found[mk].mean()),
            "yaw_change_median": med(ch),
            "yaw_change_iqr": [float(v) for v in np.quantile(ch, [0.25, 0.75])] if ch.size else None,
            "ideal_yaw_change_median": med(sign * r["side"][mk] * (ideal_yaw[mk] - lm0_yaw[mk])),
            "fit_change_median": med(sign * r["side"][mf] * (det_yaw["yaw_fit"][mf] - lm0_fit[mf])),
            "remeshed_change_median": med(r["side"][mk] * (re - re0)),
            "remeshed_found": float(np.isfinite(re).mean()),
            "abs_label_median": med(np.abs(label[mk])),
            "lag_iod": {
                "eyes": med(lag[mf][:, :2].mean(axis=1)),
                "nose": med(lag[mf][:, 2]),
                "mouth": med(lag[mf][:, 3:].mean(axis=1)),
            },
            "quality_median": med(r["score"][mf]),
            "below_gate": float((r["score"][mf] < gate).mean()) if mf.any() else None,
            "failing": float(np.mean(fl)) if fl else None,
            "compared": len(fl),
        }
    # the renders by their yaw label: how many fail, how the landmark yaw and FaceMesh (again) read them
    re_all = np.array(
        [m["remeshed_yaw"][s_idx[q], angles.index(int(d))] for q, d in zip(r["path"], r["deg"], strict=True)]
    )
    by_label = []
    for lo, hi in ((0, 15), (15, 30), (30, 45), (45, 60), (60, 75), (75, 120)):
        mk = found & (np.abs(label) >= lo) & (np.abs(label) < hi)
        fl = [bool(v) for v in fail[mk] if v is not None]
        pose = np.abs(det_yaw["yaw"][mk]) > qs.max_yaw_deg
        by_label.append(
            {
                "label": f"{lo}-{hi}",
                "faces": int(mk.sum()),
                "failing": float(np.mean(fl)) if fl else None,
                "landmark_abs_yaw_median": med(np.abs(det_yaw["yaw"][mk])),
                "remeshed_abs_yaw_median": med(np.abs(re_all[mk])),
                "below_gate": float((r["score"][mk] < gate).mean()) if mk.any() else None,
                "pose_fires": float(pose.mean()) if mk.any() else None,
                "pose_or_gate": float((pose | (r["score"][mk] < gate)).mean()) if mk.any() else None,
            }
        )
    neg_f = r["clean_fold"][cf]
    c_mp_abs = np.abs(c_mp)
    held: dict[str, Any] = {}
    for k in est:
        neg = np.abs(c_yaw[k])
        held[k] = {"clean_abs_yaw_quantiles": {str(p): float(np.quantile(neg, p)) for p in (0.5, 0.99, 0.998, 1.0)}}
        for t in THRESHOLDS:
            pm_ = found & (np.abs(label) >= t)
            pos = np.abs(det_yaw[k][pm_])
            calm = np.isfinite(c_mp) & (c_mp_abs < t)  # clean faces the mesh does not label as turned this far
            held[k][f"label_ge_{t}"] = {
                "held_out": held_out(pos, r["fold_of_path"][pm_], neg, neg_f),
                "shipped": fixed_pr(pos, neg, qs.max_yaw_deg),
                "held_out_mesh_clean": held_out(pos, r["fold_of_path"][pm_], neg[calm], neg_f[calm]),
                "all_folds_limit": choose_limit(pos, neg, +1, max_clean=0.002, min_recall=0.85),
            }
    # the real stratum: clean faces, labelled by the mesh
    cmp_ok = np.isfinite(c_mp)
    a_mp, a_fg = np.abs(c_mp), np.abs(c_yaw["yaw"])
    c_fail = np.array([fails(q, e) for q, e in zip(cpath, r["clean_emb"][cf], strict=True)], dtype=object)
    bins = []
    for lo, hi in YAW_BINS:
        mk = cmp_ok & (a_mp >= lo) & (a_mp < hi)
        fl = [bool(v) for v in c_fail[mk] if v is not None]
        bins.append(
            {
                "mesh_yaw": f"{lo}-{hi}",
                "faces": int(mk.sum()),
                "landmark_abs_yaw_median": med(a_fg[mk]),
                "landmark_abs_yaw_iqr": [float(v) for v in np.quantile(a_fg[mk], [0.25, 0.75])] if mk.any() else None,
                "pose_fires": float((a_fg[mk] > qs.max_yaw_deg).mean()) if mk.any() else None,
                "failing": float(np.mean(fl)) if fl else None,
            }
        )
    real: dict[str, Any] = {
        "bins": bins,
        "meshed": int(cmp_ok.sum()),
        "clean_faces": int(cf.sum()),
        "corr": float(np.corrcoef(c_yaw["yaw"][cmp_ok], c_mp[cmp_ok])[0, 1]),
        "abs_diff_median": float(np.median(np.abs(sign * c_yaw["yaw"][cmp_ok] - c_mp[cmp_ok]))),
    }
    for t in THRESHOLDS:
        p, n = cmp_ok & (a_mp >= t), cmp_ok & (a_mp < t)
        fired = cmp_ok & (a_fg > qs.max_yaw_deg)
        real[f"label_ge_{t}"] = {
            "shipped": fixed_pr(a_fg[p], a_fg[n], qs.max_yaw_deg),
            "held_out": held_out(a_fg[p], neg_f[p], a_fg[n], neg_f[n]) if p.sum() >= 10 else None,
            "fired_label_median": med(a_mp[fired]),
        }
    other = r["clean_other_refusal"][cf].astype(bool)
    pitch = np.abs(np.array([landmark_geometry(x)[2] for x in clm]))
    refusal = {}
    for k in est:
        pose = (np.abs(c_yaw[k]) > qs.max_yaw_deg) | (pitch > qs.max_pitch_deg)
        refusal[k] = {"pose_fires": float(pose.mean()), "refused": float((other | pose).mean())}
    # the lowest yaw limit whose clean refusal at the verify gate stays within the guardrail, and what it finds
    base = other | (pitch > qs.max_pitch_deg)
    grid = np.round(np.arange(qs.max_yaw_deg, 20.0, -0.1), 1)
    within = [g for g in grid if (base | (np.abs(c_yaw["yaw"]) > g)).mean() <= GUARDRAIL]
    low = float(min(within)) if within else None
    pm_ = found & (np.abs(label) >= qs.max_yaw_deg)
    guard = None
    if low is not None:
        guard = {
            "limit": low,
            "refused": float((base | (np.abs(c_yaw["yaw"]) > low)).mean()),
            **fixed_pr(np.abs(det_yaw["yaw"][pm_]), np.abs(c_yaw["yaw"]), low),
        }
    # pitch is not rendered; what the clean faces say about its frontal reference
    eyes, mouth = (clm[:, 0] + clm[:, 1]) / 2, (clm[:, 3] + clm[:, 4]) / 2
    axis = mouth - eyes
    height = np.linalg.norm(axis, axis=1)
    along = np.einsum("ij,ij->i", clm[:, 2] - eyes, axis / height[:, None]) / height
    pitch_rep = {
        "frontal_nose_place_median": float(np.median(along[ok & (np.abs(c_mp) < 10)])),
        "template_nose_place": NOSE_FRONTAL_T,
        "clean_abs_pitch_quantiles": {str(p): float(np.quantile(pitch, p)) for p in (0.5, 0.9, 0.99, 0.998, 1.0)},
    }
    return {
        "pitch": pitch_rep,
        "sign": sign,
        "foreshortening_frontal": frontal,
        "per_angle": per_angle,
        "renders_by_label": by_label,
        "held_out": held,
        "real_stratum": real,
        "clean_refusal": {
            "verify_gate": gate,
            "max_yaw_deg": qs.max_yaw_deg,
            "max_pitch_deg": qs.max_pitch_deg,
            "clean_faces": int(cf.sum()),
            "not_found": int((~cf).sum()),
            "other_reasons_or_gate": float(other.mean()),
            **refusal,
            "guardrail": GUARDRAIL,
            "lowest_limit_within_guardrail": guard,
        },
        "mesh": {
            "photos": len(m["paths"]),
            "meshed": int(np.isfinite(mp_yaw).sum()),
            "abs_yaw_quantiles": {str(p): float(np.nanquantile(np.abs(mp_yaw), p)) for p in (0.5, 0.9, 0.99, 1.0)},
            "mirror_involution": float(m["mirror_involution"]),
            "triangles": len(m["triangles"]),
            "seconds": [float(v) for v in m["seconds"]],
        },
        "match_threshold": match,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    ap.add_argument("--mesh", type=Path, default=Path("out/pose_mesh.npz"), help="pose_mesh.py's output")
    ap.add_argument("--photos", type=int, default=600, help="photos to turn (pose_mesh.py's --photos)")
    ap.add_argument("--raw", type=Path, help="where the detections are kept (.npz); read back if it exists")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_pose_mesh-cpu2.json"))
    a = ap.parse_args()
    m = dict(np.load(a.mesh))
    if a.raw is not None and a.raw.is_file():
        r = dict(np.load(a.raw))
    else:
        r = collect(a, m)
        if a.raw is not None:
            a.raw.parent.mkdir(parents=True, exist_ok=True)
            np.savez(a.raw, **r)
    rep = {
        "command": "python benchmarks/quality_pose_mesh.py " + " ".join(sys.argv[1:]),
        "mesh_command": str(m["command"]) if "command" in m else None,
        "mesh_versions": str(m["versions"]) if "versions" in m else None,
        "photos": int(r["meta"][3]),
        "turned_photos": len(set(r["path"])),
        "clean_photos": int(r["clean_path"].size),
        "angles_deg": [int(v) for v in m["angles"]],
        "thresholds_deg": list(THRESHOLDS),
        **analyse(r, m, a.lfw),
        "env": env_record(
            photos=int(r["meta"][3]), seconds=round(float(r["meta"][2]), 1), turn_seconds=round(float(r["meta"][1]), 1)
        ),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rep, indent=1))
    for deg, v in rep["per_angle"].items():
        log.info("%s°: %s", deg, v)
    for k, v in rep["held_out"].items():
        log.info("held out %s: %s", k, v)
    log.info("real stratum: %s", rep["real_stratum"])
    log.info("clean refusal: %s", rep["clean_refusal"])


if __name__ == "__main__":
    main()
