"""benchmarks/quality_eval.py (protocol P1, reasons, gates, reliability) on a synthetic feature table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import quality_eval as fq
from facegate.errors import InvalidParameterError
from facegate.eval.lfw import Pair
from quality_p1_features import plan

N_FOLDS, IDS_PER_FOLD, PHOTOS = 10, 4, 3
#: how a degradation moves the measured columns (severity s): column → value
EFFECT = {
    "downscale": lambda s: {"iod": 40.0 * 0.45**s},
    "blur": lambda s: {"sharpness": 6.0 * 0.3**s},
    "underexpose": lambda s: {"luma": 120.0 * 0.35**s},
    "overexpose": lambda s: {"luma": min(255.0, 120.0 + 45.0 * s)},
    "mask": lambda s: {"flat": 0.08 + 0.08 * s},
    "eyeband": lambda s: {"flat": 0.08 + 0.07 * s},
    "yaw": lambda s: {"yaw": 8.0 * s},
}


def make_lfw(tmp: Path, seed: int = 0) -> tuple[Path, Path]:
    """A pairs.txt and a feature file in the layout of ``benchmarks/quality_p1_features.py``."""
    rng = np.random.default_rng(seed)
    names = [f"P{f}_{k}" for f in range(N_FOLDS) for k in range(IDS_PER_FOLD)]
    centre = {n: rng.normal(size=16) for n in names}
    lines = [f"{N_FOLDS}\t{IDS_PER_FOLD}"]
    for f in range(N_FOLDS):
        fold = names[f * IDS_PER_FOLD : (f + 1) * IDS_PER_FOLD]
        lines += [f"{n}\t1\t2" for n in fold]
        lines += [f"{n}\t3\t{fold[(k + 1) % IDS_PER_FOLD]}\t1" for k, n in enumerate(fold)]
    (tmp / "pairs.txt").write_text("\n".join(lines) + "\n")
    rows: dict[str, list] = {}
    for n in names:
        for p in range(1, PHOTOS + 1):
            path = f"{n}/{n}_{p:04d}.jpg"
            for deg, sev in plan(path):
                bad = 0.0 if deg == "clean" else sev * rng.uniform(0.2, 0.6)
                e = centre[n] + (0.5 + 2.0 * bad) * rng.normal(size=16)
                e /= np.linalg.norm(e)
                norm = 10.0 / (1.0 + bad) + 0.2 * rng.normal()
                col = {
                    "iod": 40.0 + rng.normal(),
                    "yaw": 30 * rng.normal(),
                    "pitch": 3 * rng.normal(),
                    "sharpness": 6.0 + rng.random(),
                    "luma": 120.0 + 10 * rng.normal(),
                    "flat": 0.05 * rng.random(),
                }
                col.update(EFFECT.get(deg, lambda s: {})(sev))
                col |= {"path": path, "degradation": deg, "severity": sev, "found": True, "det": 0.9, "img_w": 250}
                col |= {"heuristic": rng.random(), "emb": e, "flip": e, "norm": norm, "serfiq": -bad}
                col |= {"quality": 1 / (1 + np.exp(-(norm - 8))), "rts": -bad + 0.3 * rng.normal()}
                col["landmarks"] = np.zeros((5, 2))
                for k, v in col.items():
                    rows.setdefault(k, []).append(v)
    feat = tmp / "features.npz"
    np.savez(feat, seconds=1.0, **{k: np.asarray(v) for k, v in rows.items()})
    return tmp, feat


def test_identity_folds_refuses_an_identity_in_two_folds() -> None:
    pairs = [Pair("A/A_0001.jpg", "A/A_0002.jpg", 0, True), Pair("A/A_0001.jpg", "B/B_0001.jpg", 1, False)]
    with pytest.raises(InvalidParameterError, match="appears in folds"):
        fq.identity_folds(pairs)


def test_choose_limit_is_the_most_lenient_that_finds_enough() -> None:
    neg = np.linspace(10, 20, 1000)  # clean faces: 10-20 px
    pos = np.linspace(2, 12, 100)  # small faces: 2-12 px
    lim = fq.choose_limit(pos, neg, -1, max_clean=0.01, min_recall=0.8)
    assert (pos < lim).mean() >= 0.8 and (neg < lim).mean() <= 0.01
    assert lim < 10.2  # no more lenient than the clean faces allow
    assert fq.choose_limit(pos, neg, -1, max_clean=0.0, min_recall=0.8) <= 10.0


def test_eval_quality_end_to_end(tmp_path: Path) -> None:
    root, feat = make_lfw(tmp_path)
    rep = fq.eval_quality(
        [feat],
        root,
        out=tmp_path / "q.json",
        plot=tmp_path / "edc.png",
        match_threshold=0.5,
        draws=20,
        reliability_out=tmp_path / "rel.json",
    )
    saved = json.loads((tmp_path / "q.json").read_text())
    assert saved["comparisons"]["genuine"] == 3 * N_FOLDS * IDS_PER_FOLD  # clean + both one-side-degraded
    p1 = saved["p1"]
    for m in (*fq.BASELINES, "fusion", "pair_oracle", "per_face_oracle", "random", "best"):
        assert m in p1["all"], m
    assert p1["all"]["pair_oracle"]["minus_best"]["pauc20"] == pytest.approx(0.0, abs=1e-12)
    assert p1["all"]["random"]["E"]["pauc20"] == pytest.approx(1.0)
    assert p1["real_pose"] is not None and "feature_norm" in p1["real_pose"]
    lo, hi = p1["all"]["fusion"]["pauc20_minus_feature_norm"]["ci95"]
    assert lo <= hi and set(p1["fold_means"]) >= set(fq.BASELINES) and "check" in p1
    # the reasons find their labelled degradations on held-out folds
    for code in ("too_small", "blur", "too_dark"):
        assert rep["reasons"][code]["held_out"]["recall"] >= 0.5, code
    assert rep["reasons"]["pose"]["shipped_limit"] == 50.0  # kept at the setting
    g = rep["gates"]
    assert g["shipped"]["enrol_gate"] >= g["shipped"]["verify_gate"]
    assert 0 <= g["clean_faces_refused_with_reasons"]["held_out_verify_gate"] <= 1
    assert 0 <= rep["reliability"]["held_out_ece_pooled"] <= 1
    assert json.loads((tmp_path / "rel.json").read_text())["isotonic"]["x"]
    assert (tmp_path / "edc.png").stat().st_size > 1000


def test_the_fusion_never_scores_a_fold_with_a_fit_that_saw_it(tmp_path: Path) -> None:
    """Cross-fitting: changing fold 0's outcomes changes no fold-0 fusion score (and does change other folds')."""
    root, feat = make_lfw(tmp_path)
    pairs = fq.read_pairs(root)
    t = fq.load_table([feat])
    ps = fq.comparisons(t, pairs)
    sim = fq.similarity(t, ps)
    base = fq.fusion_scores(t, pairs, ps, sim, 0.5)["score"]
    fold0 = np.char.startswith(t["identity"].astype(str), "P0_")
    t2 = dict(t, emb=np.where(fold0[:, None], np.roll(t["emb"], 1, axis=0), t["emb"]))
    moved = fq.fusion_scores(t2, pairs, ps, fq.similarity(t2, ps), 0.5)["score"]
    np.testing.assert_allclose(moved[fold0], base[fold0])
    assert not np.allclose(moved[~fold0], base[~fold0])
