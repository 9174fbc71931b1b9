"""Quality evaluation: EDC/pAUC math, pairs, cross-fitting discipline, gating, monotonicity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import facegate.eval.quality as fq
from facegate.errors import InvalidParameterError
from facegate.eval.lfw import Pair
from facegate.training.rts import FEATURE_COLUMNS, RTSConfig

# --------------------------------------------------------------------------- EDC / pAUC on hand-made data


def test_edc_hand_computed() -> None:
    sim = np.array([0.1, 0.9, 0.2, 0.8, 0.7])  # threshold 0.5: pairs 0 and 2 fail
    q = np.array([0.0, 5.0, 1.0, 4.0, 3.0])  # the failures have the lowest quality
    x, fn = fq.edc(sim, q, 0.5)
    np.testing.assert_allclose(x, [0, 0.2, 0.4, 0.6, 0.8])
    np.testing.assert_allclose(fn, [2 / 5, 1 / 4, 0, 0, 0])
    # pAUC@20% of that step curve is FNMR on [0, 0.2) = 0.4; @40%: (0.4 + 0.25) / 2
    assert fq.pauc(x, fn, 0.2) == pytest.approx(0.4)
    assert fq.pauc(x, fn, 0.4) == pytest.approx(0.325)
    # reversed quality: the passes go first
    _, fn_bad = fq.edc(sim, -q, 0.5)
    np.testing.assert_allclose(fn_bad, [2 / 5, 2 / 4, 2 / 3, 2 / 2, 1])


def test_pauc_of_a_flat_curve_is_its_level() -> None:
    x = np.arange(1000) / 1000
    assert fq.pauc(x, np.full(1000, 0.07), 0.2) == pytest.approx(0.07)


def test_perfect_quality_beats_random_and_random_is_flat() -> None:
    rng = np.random.default_rng(0)
    n = 20_000
    sim = rng.normal(0.6, 0.2, n)
    thr = 0.3
    x, fn_perfect = fq.edc(sim, sim, thr)
    fnmr0 = float((sim < thr).mean())
    rand = [fq.pauc(*fq.edc(sim, rng.random(n), thr, seed=s), 0.2) for s in range(5)]
    p_perfect = fq.pauc(x, fn_perfect, 0.2)
    assert p_perfect < 0.5 * np.mean(rand)
    assert np.mean(rand) == pytest.approx(fnmr0, rel=0.03)  # random discarding keeps FNMR flat
    _xr, fr = fq.edc(sim, rng.random(n), thr)
    k = int(0.2 * n)
    assert fr[k] == pytest.approx(fnmr0, rel=0.06)
    # the oracle reaches 0 once every failure is discarded
    assert fn_perfect[int(np.ceil(fnmr0 * n)) + 1] == 0.0


def test_ties_are_broken_at_random_not_by_order() -> None:
    sim = np.array([0.0] * 50 + [1.0] * 50)  # 50 failures first, then passes
    q = np.zeros(100)  # all tied
    _, fn = fq.edc(sim, q, 0.5)
    # discarding 20 tied pairs in index order would remove only failures (FNMR 30/80 = 0.375); random
    # tie-breaking removes about half failures, half passes (FNMR ≈ 40/80 = 0.5)
    assert 0.42 < fn[20] < 0.58
    with pytest.raises(InvalidParameterError):
        fq.edc(np.zeros(3), np.zeros(2), 0.5)


# --------------------------------------------------------------------------- a synthetic LFW-like table
def make_table(n_folds: int = 10, ids_per_fold: int = 3, photos: int = 3, n_random: int = 2, seed: int = 0):
    """Identities in folds; degraded variants add noise; two progressive images with the full sweep."""
    from facegate.eval.degrade import DEGRADATIONS, SEVERITIES

    rng = np.random.default_rng(seed)
    dim, feat = 16, 20
    rows: dict[str, list] = {c: [] for c in FEATURE_COLUMNS}
    pairs: list[Pair] = []
    names_by_fold = {f: [f"p{f}_{k}" for k in range(ids_per_fold)] for f in range(n_folds)}
    prog_count = 0
    for f, names in names_by_fold.items():
        for name in names:
            c = rng.normal(size=dim)
            c /= np.linalg.norm(c)
            for p in range(photos):
                path = f"{name}/{name}_{p + 1:04d}.jpg"
                photo = c + 0.2 * rng.normal(size=dim)
                variants = [("clean", 0)] + [("noise", int(rng.integers(1, 6))) for _ in range(n_random)]
                if prog_count < 2 and p == 0:
                    variants += [(d, s) for d in DEGRADATIONS for s in SEVERITIES]
                    prog_count += 1
                for v, (d, s) in enumerate(variants):
                    t = 0.25 * s
                    e = photo + t * rng.normal(size=dim)
                    found = not (d == "underexpose" and s == 5)
                    rows["path"].append(path)
                    rows["variant"].append(v)
                    rows["degradation"].append(d)
                    rows["severity"].append(s)
                    rows["found"].append(found)
                    rows["det"].append(0.95 - 0.1 * s if found else 0.0)
                    rows["norm"].append(10 - s + 0.5 * rng.normal() if found else np.nan)
                    rows["heuristic"].append(0.9 if found else np.nan)
                    rows["emb"].append(e / np.linalg.norm(e) if found else np.full(dim, np.nan))
                    rows["head_in"].append(
                        np.r_[t + 0.1 * rng.normal(), rng.normal(size=feat - 1)] if found else np.full(feat, np.nan)
                    )
        for k, name in enumerate(names):
            pairs.append(Pair(f"{name}/{name}_0001.jpg", f"{name}/{name}_0002.jpg", f, True))
            other = names[(k + 1) % len(names)]
            pairs.append(Pair(f"{name}/{name}_0003.jpg", f"{other}/{other}_0001.jpg", f, False))
    t = {c: np.asarray(v) for c, v in rows.items()}
    t["emb"] = t["emb"].astype(np.float16)
    t["head_in"] = t["head_in"].astype(np.float16)
    t["variant"] = t["variant"].astype(np.int16)
    t["identity"] = np.array([p.split("/")[0] for p in t["path"]])
    t["n_random"] = np.array([n_random])
    return t, pairs


def test_build_pairs_counts_and_failed_faces() -> None:
    t, pairs = make_table()
    ps = fq.build_pairs(t, pairs)
    assert ps.a.size == len(pairs) * (1 + 2 * 2)  # clean + (a, b') and (a', b) for 2 variants
    assert (~ps.degraded).sum() == len(pairs)
    # degraded pairs have exactly one degraded side
    va, vb = t["variant"][ps.a], t["variant"][ps.b]
    assert (((va == 0) & (vb > 0)) | ((va > 0) & (vb == 0)))[ps.degraded].all()
    assert (t["variant"][ps.a] <= 2).all() and (t["variant"][ps.b] <= 2).all()  # never the progressive sweep
    t2 = {k: v.copy() for k, v in t.items()}
    t2["found"][ps.b[0]] = False
    assert fq.pair_similarity(t2, ps)[0] == -1.0
    assert fq.face_scores(t2, "feature_norm")[ps.b[0]] == -np.inf
    # missing images: their pairs are skipped
    keep = t["identity"] != "p0_0"
    sub = {k: (v[keep] if v.shape[:1] == keep.shape else v) for k, v in t.items()}
    assert fq.build_pairs(sub, pairs).a.size < ps.a.size


def test_identity_folds_refuses_an_identity_in_two_folds() -> None:
    ok = [Pair("A/A_0001.jpg", "A/A_0002.jpg", 0, True), Pair("B/B_0001.jpg", "C/C_0001.jpg", 1, False)]
    assert fq.identity_folds(ok) == {"A": 0, "B": 1, "C": 1}
    with pytest.raises(InvalidParameterError):
        fq.identity_folds([*ok, Pair("A/A_0003.jpg", "D/D_0001.jpg", 2, False)])


def test_crossfit_never_trains_on_an_evaluated_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    t, pairs = make_table()
    ps = fq.build_pairs(t, pairs)
    sim = fq.pair_similarity(t, ps)
    seen: list[set[str]] = []
    real = fq.train_on_identities

    def spy(table, identities, config, **kw):
        seen.append(set(identities))
        res = real(table, identities, config, **kw)
        seen[-1] |= set(res.identities)
        return res

    monkeypatch.setattr(fq, "train_on_identities", spy)
    cfg = RTSConfig(epochs=2, batch_size=16, lr=1e-2)
    xf = fq.crossfit(t, pairs, ps, sim, cfg, progress=False)
    id_fold = fq.identity_folds(pairs)
    assert len(seen) == 10 and len(xf.folds) == 10
    for info, trained in zip(xf.folds, seen, strict=True):
        f = info["fold"]
        evaluated = {i for i, ff in id_fold.items() if ff == f}
        assert trained and not (trained & evaluated)
        assert trained == {i for i, ff in id_fold.items() if ff != f}
    # every found face of a paired identity got a held-out σ² > 0; q in [0, 1]; no-face rows q = 0
    assert (xf.sigma2[t["found"]] > 0).all() and np.isnan(xf.sigma2[~t["found"]]).all()
    assert ((xf.quality >= 0) & (xf.quality <= 1)).all() and (xf.quality[~t["found"]] == 0).all()


def test_gating_table_basics() -> None:
    t, pairs = make_table()
    ps = fq.build_pairs(t, pairs)
    sim = fq.pair_similarity(t, ps)
    q = np.where(t["found"], 1.0 - 0.15 * t["severity"], 0.0)
    rows = fq.gating_table(t, ps, sim, q, 0.5, [0.0, 0.5])
    r0, r5 = rows
    assert r0["all"]["discarded_genuine"] == 0.0
    assert r0["all"]["fnmr_after"] == r0["all"]["fnmr_before"]
    assert r5["refused_clean_faces"] == 0.0 and r5["refused_degraded_faces"] > 0
    assert r5["all"]["fnmr_after"] <= r5["all"]["fnmr_before"]


def test_monotonicity_shares() -> None:
    t, _pairs = make_table()
    rows = np.arange(t["path"].size)
    falling = np.where(t["found"], -t["severity"].astype(float), -np.inf)
    flat = np.where(t["found"], 1.0, -np.inf)
    m = fq.monotonicity(t, {"falling": falling, "flat": flat}, rows)
    assert m["falling"]["blur"]["drop_share_per_step"] == [1.0] * 5 and m["falling"]["blur"]["faces"] == 2
    assert m["flat"]["blur"]["drop_share_per_step"] == [0.0] * 5
    # a face lost at severity 5 counts as a drop (-inf < a finite score)
    assert m["flat"]["underexpose"]["drop_share_per_step"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    # held-out restriction: no rows → nothing to report
    assert fq.monotonicity(t, {"flat": flat}, np.array([], int))["flat"] == {}


def test_eval_quality_end_to_end(tmp_path: Path) -> None:
    t, pairs = make_table()
    part = tmp_path / "qf_0.npz"
    np.savez_compressed(part, env=np.array('{"config": {"random": "2"}}'), **{c: t[c] for c in FEATURE_COLUMNS})
    (tmp_path / "lfw").mkdir()
    lines = ["10\t3"]
    for f in range(10):
        for p in [q for q in pairs if q.fold == f and q.same]:
            n = p.a.split("/")[0]
            lines.append(f"{n}\t1\t2")
        for p in [q for q in pairs if q.fold == f and not q.same]:
            lines.append(f"{p.a.split('/')[0]}\t3\t{p.b.split('/')[0]}\t1")
    (tmp_path / "lfw" / "pairs.txt").write_text("\n".join(lines) + "\n")
    rep = fq.eval_quality(
        [part], tmp_path / "lfw", out=tmp_path / "q.json", plot=tmp_path / "edc.png",
        config=RTSConfig(epochs=2, batch_size=16), random_seeds=2, ship_head=tmp_path / "head.pt", progress=False,
        match_threshold=0.5,
    )  # fmt: skip
    assert rep["threshold"] == 0.5 and rep["shipped"]["match_threshold"] == 0.5
    assert all(f["match_threshold_train_folds"] == 0.5 for f in rep["folds"])
    assert (tmp_path / "edc.png").stat().st_size > 1000 and (tmp_path / "head.pt").is_file()
    saved = json.loads((tmp_path / "q.json").read_text())
    assert len(saved["per_fold"]) == 10 and set(fq.METHODS) <= set(saved["mean"])
    assert saved["lfw_verification_clean"]["n_pairs"] == len(pairs)
    assert saved["shipped"]["feature_norm_calibration"]["direction"] == 1
    assert "| **mean ± std** |" in fq.markdown_tables(rep)
    for m in (*fq.METHODS, "oracle"):
        assert 0 <= rep["mean"][m] <= 1
    assert rep["mean"]["oracle"] <= min(rep["mean"][m] for m in fq.METHODS) + 1e-12
    # protocol P1: found-only comparisons at severity <= 3, every method against the norm, E between 0 and 1
    p1 = saved["p1"]
    assert p1["genuine_comparisons"] > 0 and 0.0 <= p1["failure_to_acquire"] <= 1.0 and p1["max_severity"] == 3
    for m in ("rts_head", "detector", "heuristic", "pair_oracle", "per_face_oracle", "random"):
        assert m in p1["all"], m
    assert p1["all"]["pair_oracle"]["minus_best"]["pauc20"] == pytest.approx(0.0, abs=1e-12)
    assert "pauc20_minus_feature_norm" in p1["all"]["rts_head"] and "check" in p1
