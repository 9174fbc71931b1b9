"""Measure each quality reason's precision and recall on labelled LFW variants, with limits chosen on held-out folds.

For LFW photos of the pairs' identities (10 identity-disjoint folds), the real pipeline runs on the clean photo and
on labelled degradations of it: genuinely small faces (the photo shrunk, not brought back), Gaussian blur, under-
and over-exposure, and a face mask and an eye band drawn from the clean photo's landmarks. Per face it keeps what
the reasons read (inter-ocular distance, yaw, pitch, crop sharpness, brightness and flat fraction, detector score,
quality score) and whether the face still matches another clean photo of the same person at the operating
threshold.

Labels: a variant of severity ≥ ``--positive-from`` (3) is a positive for its reason; the clean photos are the
negatives; lower severities are reported but not scored. For each held-out fold the limit is chosen on the other
nine folds: the most lenient one that still finds 80 % of the positives with precision ≥ 0.9 and fires on at
most 0.5 % of clean faces. The shipped limit is the same rule on all folds. The real-pose stratum is LFW's clean
photos binned by the yaw the landmarks give.

Features are cached under ``--cache`` (``out/``, ignored by git), so a second run only redoes the statistics.

    python benchmarks/quality_reasons.py --device cuda --out benchmarks/results/quality_reasons.json
    python benchmarks/quality_reasons.py --per-fold 12 --out benchmarks/results/quality_reasons_reduced.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from facegate.config import Settings
from facegate.eval.degrade import FACE_DEGRADATIONS, blur, downscale, overexpose, underexpose
from facegate.eval.features import path_rng
from facegate.eval.gates import gate_study, reliability_study, save_reliability
from facegate.eval.lfw import centre_most, read_pairs
from facegate.eval.p1 import per_face_oracle
from facegate.eval.p1 import study as p1_study
from facegate.eval.quality import PairSet, identity_folds
from facegate.models.registry import get_spec
from facegate.pipeline.pipeline import FacePipeline
from facegate.quality_reasons import STAT_BLUR, STAT_FLAT, STAT_LUMA, crop_stats, landmark_geometry

log = logging.getLogger("quality_reasons")

WHOLE = {"downscale": downscale, "blur": blur, "underexpose": underexpose, "overexpose": overexpose}
#: reason code → (its degradations, the measured column, direction: +1 fires when the value is *above* the limit)
REASONS = {
    "too_small": (("downscale",), "iod", -1),
    "blur": (("blur",), "sharpness", -1),
    "too_dark": (("underexpose",), "luma", -1),
    "too_bright": (("overexpose",), "luma", +1),
    "occluded": (("mask", "eyeband"), "flat", +1),
}
SEVERITIES = (1, 2, 3, 4, 5)
COLUMNS = ("iod", "yaw", "pitch", "sharpness", "luma", "flat", "det", "quality", "match")


def pick_images(root: Path, per_fold: int) -> tuple[list[str], dict[str, int], dict[str, list[str]]]:
    """Per fold up to ``per_fold`` identities with ≥ 2 photos (0: all): their first photo is degraded, their second
    is the clean reference. Returns (probe paths, identity → fold, identity → its photo paths)."""
    pairs = read_pairs(root)
    folds = identity_folds(pairs)
    base = root / "lfw-deepfunneled"
    photos = {name: sorted(f"{name}/{p.name}" for p in (base / name).glob("*.jpg")) for name in folds}
    by_fold: dict[int, list[str]] = defaultdict(list)
    for name in sorted(folds):
        if len(photos[name]) >= 2:
            by_fold[folds[name]].append(name)
    chosen = [n for f in sorted(by_fold) for n in (by_fold[f] if per_fold <= 0 else by_fold[f][:per_fold])]
    return chosen, folds, photos


def extract(pipe: FacePipeline, root: Path, names: list[str], photos: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """One row per (identity, variant): the measured columns (NaN where no face was found)."""
    from facegate.io.decode import decode_image

    base = root / "lfw-deepfunneled"
    rows: dict[str, list] = defaultdict(list)
    t0 = time.perf_counter()
    for k, name in enumerate(names):
        probe, ref = photos[name][0], photos[name][1]
        clean = decode_image((base / probe).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        ref_img = decode_image((base / ref).read_bytes(), max_bytes=1 << 26, max_pixels=1 << 26)
        dets = pipe.detect([clean, ref_img])
        if not dets[0] or not dets[1]:
            continue
        d0 = centre_most(dets[0], clean.shape[1], clean.shape[0])
        dr = centre_most(dets[1], ref_img.shape[1], ref_img.shape[0])
        variants: list[tuple[str, int, np.ndarray]] = [("clean", 0, clean)]
        for deg, fn in WHOLE.items():
            variants += [(deg, s, fn(clean, s, path_rng(probe, 10 * s))) for s in SEVERITIES]
        for deg, fn in FACE_DEGRADATIONS.items():
            variants += [(deg, s, fn(clean, s, path_rng(probe, 10 * s + 1), d0.landmarks)) for s in SEVERITIES]
        found = pipe.detect([v[2] for v in variants])
        chosen, owners = [dr], [len(variants)]
        images = [v[2] for v in variants] + [ref_img]
        for i, ds in enumerate(found):
            if ds:
                chosen.append(centre_most(ds, images[i].shape[1], images[i].shape[0]))
                owners.append(i)
        crops = pipe.align(images, chosen, owners)
        emb, q, _ = pipe.embed(crops)
        stats = crop_stats(crops)
        ref_emb = emb[0]
        got = {o: j for j, o in enumerate(owners)}
        blank = np.zeros((112, 112, 3), np.uint8)
        for i in range(len(variants)):
            j = got.get(i)
            rows["crop"].append(crops[j] if j is not None else blank)
            rows["emb"].append(
                emb[j].astype(np.float16) if j is not None else np.full(emb.shape[1], np.nan, np.float16)
            )
            rows["ref_emb"].append(ref_emb.astype(np.float16))
            rows["ref_quality"].append(float(q[0]))
        for i, (deg, s, _) in enumerate(variants):
            rows["identity"].append(name)
            rows["degradation"].append(deg)
            rows["severity"].append(s)
            j = got.get(i)
            if j is None:
                vals = [np.nan] * len(COLUMNS)
            else:
                iod, yaw, pitch = landmark_geometry(chosen[j].landmarks)
                sim = float(emb[j] @ ref_emb)
                vals = [iod, yaw, pitch, stats[j, STAT_BLUR], stats[j, STAT_LUMA], stats[j, STAT_FLAT]]
                vals += [chosen[j].score, q[j], float(sim >= pipe.operating.match_threshold)]
            for c, v in zip(COLUMNS, vals, strict=True):
                rows[c].append(float(v))
        if (k + 1) % 10 == 0:
            log.info("%d / %d identities, %.1f s", k + 1, len(names), time.perf_counter() - t0)
    return {k: np.asarray(v) for k, v in rows.items()}


def fires(values: np.ndarray, limit: float, direction: int) -> np.ndarray:
    return values > limit if direction > 0 else values < limit


def choose_limit(
    pos: np.ndarray, neg: np.ndarray, direction: int, *, min_precision: float, max_clean: float, min_recall: float
) -> float:
    """The most lenient limit that still finds ``min_recall`` of ``pos`` with precision ≥ ``min_precision`` against
    ``neg`` while firing on at most ``max_clean`` of ``neg`` (the largest-recall one when none reaches
    ``min_recall``). Lenient, because a refusal costs the person a retake: a limit only as strict as the labels
    need. Candidates are midpoints of the observed values."""
    vals = np.unique(np.concatenate([pos, neg]))
    cands = (vals[1:] + vals[:-1]) / 2 if vals.size > 1 else vals
    ok: list[tuple[float, float]] = []
    for t in cands:
        tp, fp = fires(pos, t, direction).sum(), fires(neg, t, direction).sum()
        precision = tp / max(1, tp + fp)
        if tp and precision >= min_precision and fp / max(1, neg.size) <= max_clean:
            ok.append((tp / max(1, pos.size), float(t)))
    if not ok:
        return float(np.min(neg)) - 1e-6 if direction < 0 else float(np.max(neg)) + 1e-6
    enough = [x for x in ok if x[0] >= min_recall]
    return min(enough)[1] if enough else max(ok)[1]


def score(pos: np.ndarray, neg: np.ndarray, limit: float, direction: int) -> dict[str, float]:
    tp, fp = int(fires(pos, limit, direction).sum()), int(fires(neg, limit, direction).sum())
    return {
        "precision": tp / max(1, tp + fp),
        "recall": tp / max(1, pos.size),
        "clean_fire_rate": fp / max(1, neg.size),
        "positives": int(pos.size),
        "negatives": int(neg.size),
    }


def analyse(t: dict[str, np.ndarray], folds: dict[str, int], args: argparse.Namespace) -> dict:
    fold = np.asarray([folds[n] for n in t["identity"]])
    found = ~np.isnan(t["iod"])
    clean = (t["degradation"] == "clean") & found
    out: dict = {
        "identities": len(set(t["identity"])),
        "faces": len(t["identity"]),
        "found": float(found.mean()),
    }
    per_reason: dict = {}
    limits = {"min_precision": args.min_precision, "max_clean": args.max_clean, "min_recall": args.min_recall}
    degradation = t["degradation"]
    luma_limits: dict[str, float] = {}
    for code, (degs, col, direction) in REASONS.items():
        v = t[col]
        if code == "occluded":  # as face_reasons: a badly exposed face is told about its exposure instead
            bad = (t["luma"] < luma_limits["too_dark"]) | (t["luma"] > luma_limits["too_bright"])
            v = np.where(bad, 0.0, v)
        is_deg = np.isin(degradation, degs) & found
        pos_m = is_deg & (t["severity"] >= args.positive_from)
        rows = []
        for f in sorted(set(fold.tolist())):
            train, test = fold != f, fold == f
            lim = choose_limit(v[pos_m & train], v[clean & train], direction, **limits)
            rows.append({"fold": f, "limit": lim, **score(v[pos_m & test], v[clean & test], lim, direction)})
        shipped = choose_limit(v[pos_m], v[clean], direction, **limits)
        luma_limits[code] = shipped
        by_sev: dict = {}
        for deg in degs:
            for s in SEVERITIES:
                at = (degradation == deg) & (t["severity"] == s)
                m = at & found
                by_sev[f"{deg}/{s}"] = {
                    "found": float(m.sum() / max(1, at.sum())),
                    "fires": float(fires(v[m], shipped, direction).mean()) if m.any() else None,
                    "match_rate": float(np.nanmean(t["match"][m])) if m.any() else None,
                }
        # how often it fires on the *other* degradations (severity ≥ positive_from): a cause named wrongly
        others = {}
        for other in sorted(set(degradation.tolist()) - set(degs) - {"clean"}):
            m = (degradation == other) & found & (t["severity"] >= args.positive_from)
            others[other] = float(fires(v[m], shipped, direction).mean()) if m.any() else None
        keys = ("precision", "recall", "clean_fire_rate")
        per_reason[code] = {
            "degradations": list(degs),
            "column": col,
            "fires_when": "above" if direction > 0 else "below",
            "shipped_limit": shipped,
            "held_out_mean": {k: float(np.mean([r[k] for r in rows])) for k in keys},
            "held_out_pooled": score(
                np.concatenate([v[pos_m & (fold == r["fold"])] for r in rows]),
                np.concatenate([v[clean & (fold == r["fold"])] for r in rows]),
                shipped,
                direction,
            ),
            "folds": rows,
            "by_severity": by_sev,
            "fires_on_other_degradations": others,
        }
    out["reasons"] = per_reason
    # real pose: LFW's own clean photos, binned by landmark yaw; how often they still match
    yaw = np.abs(t["yaw"][clean])
    pitch = np.abs(t["pitch"][clean])
    match = t["match"][clean]
    bins = [0, 15, 30, 45, 60, 90]
    out["real_pose"] = {
        "yaw_bins": [
            {
                "yaw": f"{a}-{b}",
                "faces": int(((yaw >= a) & (yaw < b)).sum()),
                "match_rate": float(match[(yaw >= a) & (yaw < b)].mean()) if ((yaw >= a) & (yaw < b)).any() else None,
            }
            for a, b in itertools.pairwise(bins)
        ],
        "yaw_p99": float(np.percentile(yaw, 99)),
        "pitch_p99": float(np.percentile(pitch, 99)),
        "clean_match_rate": float(match.mean()),
    }
    # the other causes on clean faces: how often each fires at the shipped defaults
    s = Settings().quality
    out["clean_fire_rates_at_defaults"] = {
        "low_confidence": float((t["det"][clean] < s.min_det_score).mean()),
        "pose_yaw": float((yaw > s.max_yaw_deg).mean()),
        "pose_pitch": float((pitch > s.max_pitch_deg).mean()),
        "out_of_distribution": float((t["quality"][clean] < 0.5).mean()),
    }
    return out


def comparisons(
    t: dict[str, np.ndarray], folds: dict[str, int], seed: int = 0
) -> tuple[dict[str, np.ndarray], PairSet]:
    """A face table (every variant, then each identity's clean reference photo) and its comparisons: per probe
    variant (clean, or degraded at severity ≤ 3), the same person's reference (genuine) and another person's of
    the same fold (impostor). Side ``a`` is the reference (the enrolled photo), side ``b`` the probe."""
    names = t["identity"]
    first = {n: i for i, n in reversed(list(enumerate(names)))}
    ref_rows = sorted(first.values())
    n = len(names)
    faces = {
        "emb": np.concatenate([t["emb"], t["ref_emb"][ref_rows]]).astype(np.float32),
        "quality": np.concatenate([np.nan_to_num(t["quality"], nan=0.0), t["ref_quality"][ref_rows]]),
        "identity": np.concatenate([names, names[ref_rows]]),
        "clean": np.concatenate([t["degradation"] == "clean", np.ones(len(ref_rows), bool)]),
        "found": np.concatenate([~np.isnan(t["iod"]), np.ones(len(ref_rows), bool)]),
    }
    faces["fold"] = np.asarray([folds[x] for x in faces["identity"]])
    ref_of = {names[r]: n + k for k, r in enumerate(ref_rows)}
    rng = np.random.default_rng(seed)
    by_fold: dict[int, list[str]] = defaultdict(list)
    for name in ref_of:
        by_fold[folds[name]].append(name)
    a, b, same, fold, degraded = [], [], [], [], []
    for i in range(n):
        if t["severity"][i] > 3:
            continue
        name = names[i]
        others = [x for x in by_fold[folds[name]] if x != name]
        pairs = [(ref_of[name], True)] + ([(ref_of[others[int(rng.integers(len(others)))]], False)] if others else [])
        for ref, is_same in pairs:
            a.append(ref)
            b.append(i)
            same.append(is_same)
            fold.append(folds[name])
            degraded.append(t["degradation"][i] != "clean")
    ps = PairSet(np.asarray(a), np.asarray(b), np.asarray(same), np.asarray(fold), np.asarray(degraded))
    return faces, ps


def analyse_comparisons(t: dict[str, np.ndarray], folds: dict[str, int], args: argparse.Namespace) -> dict:
    """The verify and enrolment gates and the per-comparison reliability on held-out folds."""
    faces, ps = comparisons(t, folds)
    emb = faces["emb"]
    ok = faces["found"][ps.a] & faces["found"][ps.b]
    sim = np.where(ok, np.einsum("ij,ij->i", np.nan_to_num(emb[ps.a]), np.nan_to_num(emb[ps.b])), -1.0)
    threshold = Settings().match_threshold or get_spec("sface").thresholds.match
    gates = gate_study(
        faces["quality"], faces["clean"], faces["identity"], faces["fold"], ps, sim, threshold, draws=args.draws
    )
    found = ok  # the reliability of a verdict needs both faces found; a miss is a failure to acquire
    rel, weights = reliability_study(faces["quality"], ps, sim, threshold)
    # P1's EDC metrics on these genuine comparisons (both faces found; misses are the failure to acquire above).
    # Only the scores this table holds: the quality (a monotone map of the feature norm), the probe's detector
    # score, and the oracles; the full P1 baselines need `facegate eval quality`'s feature files.
    g = ps.same & ok
    det = np.concatenate([np.nan_to_num(t["det"], nan=0.0), np.ones(len(faces["quality"]) - len(t["det"]))])
    pair_q = {
        "norm": np.minimum(faces["quality"][ps.a], faces["quality"][ps.b])[g],
        "detector": det[ps.b][g],
        "pair_oracle": sim[g],
        "per_face_oracle": per_face_oracle(ps.a[g], ps.b[g], sim[g]),
    }
    fail = sim[g] < threshold
    ident = faces["identity"][ps.a][g]
    clean_g = ~ps.degraded[g]
    p1 = {
        "all": p1_study(fail, pair_q, ident, draws=args.draws),
        "clean_only": p1_study(fail[clean_g], {k: v[clean_g] for k, v in pair_q.items()}, ident[clean_g], draws=200),
        "fnmr_at_0": float(fail.mean()),
        "genuine_comparisons": int(g.sum()),
    }
    return {
        "p1_metrics": p1,
        "comparisons": {"genuine": int(ps.same.sum()), "impostor": int((~ps.same).sum())},
        "failure_to_acquire": float(1.0 - found.mean()),
        "gates": gates,
        "reliability": rel,
        "_weights": weights,
        "_threshold": threshold,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path("/work/shared/data/lfw"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-fold", type=int, default=0, help="identities per fold (0: every one with 2+ photos)")
    ap.add_argument("--positive-from", type=int, default=3, help="least severity labelled positive")
    ap.add_argument("--min-precision", type=float, default=0.9)
    ap.add_argument("--min-recall", type=float, default=0.8, help="recall the most lenient limit must still reach")
    ap.add_argument("--max-clean", type=float, default=0.005, help="largest share of clean faces a limit may refuse")
    ap.add_argument("--cache", type=Path, default=Path("out/quality_reasons"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draws", type=int, default=1000, help="bootstrap draws (over identities) for the CIs")
    ap.add_argument("--reliability-out", type=Path, default=None, help="write the fitted reliability weights here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names, folds, photos = pick_images(args.lfw, args.per_fold)
    args.cache.mkdir(parents=True, exist_ok=True)
    cache = args.cache / f"features_{args.per_fold}_{len(names)}.npz"
    if cache.is_file():
        table = dict(np.load(cache, allow_pickle=False))
        # the crops are kept, so a change to the statistics needs no new pass through the models
        stats = crop_stats(table["crop"])
        table["sharpness"], table["luma"], table["flat"] = (
            np.where(np.isnan(table["iod"]), np.nan, stats[:, c]) for c in (STAT_BLUR, STAT_LUMA, STAT_FLAT)
        )
    else:
        pipe = FacePipeline.from_settings(Settings(device=args.device, precision="fp32"))
        table = extract(pipe, args.lfw, names, photos)
        np.savez(cache, **table)
    result = {
        "command": "python benchmarks/quality_reasons.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "reduced": args.per_fold > 0,
        "per_fold": args.per_fold,
        "positive_from_severity": args.positive_from,
        "min_precision": args.min_precision,
        "min_recall": args.min_recall,
        "max_clean": args.max_clean,
        **analyse(table, folds, args),
    }
    comp = analyse_comparisons(table, folds, args)
    weights, threshold = comp.pop("_weights"), comp.pop("_threshold")
    result.update(comp)
    if args.reliability_out is not None:
        save_reliability(
            args.reliability_out,
            weights,
            model="sface",
            threshold=threshold,
            meta={"command": result["command"], "reduced": result["reduced"], "comparisons": comp["comparisons"]},
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
