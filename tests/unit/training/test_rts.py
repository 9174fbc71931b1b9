"""RTS quality-head training: the loss, a tiny head on synthetic identities, calibration, the head file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from facegate.cli import app
from facegate.eval.features import read_parts
from facegate.models.quality import RTSQualityHead, load_head
from facegate.models.recognizer import build_recognizer
from facegate.models.registry import SFACE, WeightsSource
from facegate.training.rts import (
    FEATURE_COLUMNS,
    RTSConfig,
    _fold_standardisation,
    genuine_outcomes,
    head_sigma2,
    rts_loss,
    train_and_calibrate,
    train_quality,
    train_rts_head,
)

TINY_SFACE = dataclasses.replace(SFACE, weights=WeightsSource("random"))
TINY_HEAD_DIM = 32 + 128  # tiny SFace: 32 trunk channels + 128-d embedding


def synthetic_table(
    n_ids: int = 8, photos: int = 4, variants: int = 3, dim: int = 16, feat_dim: int = 24, seed: int = 0
) -> dict[str, np.ndarray]:
    """Identity clusters plus noise-degraded copies.

    Variant 0 is clean (embedding = centre + small photo noise); variants ≥ 1 add noise of a random
    level ``t ∈ (0, 1.5]``; the head input carries ``t`` weakly (one noisy coordinate plus the raw
    embedding's shrinking norm) among distractors. Paths are ``id<k>/id<k>_<p>.jpg``.
    """
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_ids, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rows: dict[str, list] = {c: [] for c in FEATURE_COLUMNS}
    level = []
    for i in range(n_ids):
        for p in range(photos):
            photo = centres[i] + 0.15 * rng.normal(size=dim)
            for v in range(variants):
                t = 0.0 if v == 0 else float(rng.uniform(0.05, 1.5))
                e = photo + t * rng.normal(size=dim)
                raw_norm = 10.0 / (1.0 + t) + 0.3 * rng.normal()
                feats = np.concatenate([[t + 0.2 * rng.normal(), raw_norm], rng.normal(size=feat_dim - 2)])
                rows["path"].append(f"id{i}/id{i}_{p:04d}.jpg")
                rows["variant"].append(v)
                rows["degradation"].append("clean" if v == 0 else "noise")
                rows["severity"].append(0 if v == 0 else 3)
                rows["found"].append(True)
                rows["det"].append(0.9 - 0.2 * t)
                rows["norm"].append(raw_norm)
                rows["heuristic"].append(0.9)
                rows["emb"].append(e / np.linalg.norm(e))
                rows["head_in"].append(feats)
                level.append(t)
    table = {c: np.asarray(v) for c, v in rows.items()}
    table["emb"] = table["emb"].astype(np.float16)
    table["head_in"] = table["head_in"].astype(np.float16)
    table["variant"] = table["variant"].astype(np.int16)
    table["identity"] = np.array([p.split("/")[0] for p in table["path"]])
    table["n_random"] = np.array([variants - 1])
    table["level"] = np.asarray(level)
    return table


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_dof_below_3_is_refused(tmp_path: Path) -> None:
    """τ divides by dof − 2: ``facegate train-quality --dof 2`` is bad input (exit 2) and trains nothing."""
    t = synthetic_table()
    part, out = tmp_path / "qf_0.npz", tmp_path / "head.pt"
    np.savez_compressed(part, **{c: t[c] for c in FEATURE_COLUMNS})
    res = CliRunner().invoke(app, ["train-quality", str(part), "--out", str(out), "--dof", "2"])
    assert res.exit_code == 2 and "--dof" in res.output and not out.exists(), res.output


def test_rts_loss_temperature_direction() -> None:
    """A large σ² flattens the logits: it lowers the CE of a misclassified face and raises a correct one's."""
    cos_right = torch.tensor([[0.9, 0.1, 0.0]])
    cos_wrong = torch.tensor([[0.1, 0.9, 0.0]])
    y = torch.tensor([0])
    out = {}
    for name, cos in (("right", cos_right), ("wrong", cos_wrong)):
        for lv in (-1.0, 2.0):
            g = torch.Generator().manual_seed(0)
            _, ce, kl = rts_loss(torch.tensor([[lv]]), cos, y, scale=32, dof=32, kl_scale=0.1, generator=g)
            out[(name, lv)] = float(ce)
            assert float(kl) >= 0
    assert out[("right", -1.0)] < out[("right", 2.0)]
    assert out[("wrong", 2.0)] < out[("wrong", -1.0)]
    # the KL term is zero at σ² = 1 (logvar 0)
    g = torch.Generator().manual_seed(0)
    _, _, kl0 = rts_loss(torch.zeros(4, 1), torch.rand(4, 3), torch.zeros(4, dtype=torch.long), scale=32, dof=32,
                         kl_scale=0.1, generator=g)  # fmt: skip
    assert float(kl0) == pytest.approx(0.0, abs=1e-7)


def test_standardisation_folds_into_the_linear_layer() -> None:
    torch.manual_seed(0)
    head = RTSQualityHead(6).eval()
    x = torch.randn(10, 6) * torch.tensor([0.01, 1, 5, 0.1, 2, 3]) + torch.tensor([0.5, -1, 2, 0, 0, 10])
    mu, sd = x.mean(0), x.std(0)
    want = head((x - mu) / sd)
    _fold_standardisation(head, mu, sd)
    torch.testing.assert_close(head(x), want, atol=1e-5, rtol=1e-5)


def test_tiny_head_trains_loss_falls_and_outputs_stay_in_range() -> None:
    t = synthetic_table()
    ids = np.unique(t["identity"])
    labels = np.searchsorted(ids, t["identity"])
    clean = t["variant"] == 0
    init = np.stack([t["emb"][clean & (labels == k)].astype(np.float32).mean(0) for k in range(ids.size)])
    cfg = RTSConfig(epochs=12, batch_size=16, lr=1e-2, seed=0)
    head, hist = train_rts_head(t["head_in"], t["emb"], labels, init, init[labels], cfg)
    assert len(hist) == 12
    assert np.mean([h["loss"] for h in hist[-3:]]) < 0.9 * hist[0]["loss"]
    s2 = head_sigma2(head, t["head_in"])
    assert np.isfinite(s2).all() and (s2 > 0).all()
    # the head learned the degradation: σ² rises with the noise level
    assert _spearman(s2, t["level"]) > 0.5
    # deterministic under the seed
    head2, _ = train_rts_head(t["head_in"], t["emb"], labels, init, init[labels], cfg)
    np.testing.assert_allclose(head_sigma2(head2, t["head_in"]), s2, rtol=1e-5)


def test_calibration_direction_range_and_outcomes() -> None:
    t = synthetic_table(n_ids=10)
    cfg = RTSConfig(epochs=10, batch_size=16, lr=1e-2)
    head, cal, _ = train_and_calibrate(t, cfg, match_threshold=0.5)
    assert cal.fitted and cal.direction == -1
    s2 = head_sigma2(head, t["head_in"])
    q = cal(torch.from_numpy(s2).float()).numpy()
    assert ((q >= 0) & (q <= 1)).all()
    assert q[t["variant"] == 0].mean() > q[t["level"] > 1.0].mean()
    # outcomes compare with a *different* clean photo of the same identity
    fi, y = genuine_outcomes(t, np.arange(t["path"].size), 0.5, max_refs=50)
    assert set(np.unique(y)) <= {0.0, 1.0}
    per_face = np.bincount(fi, minlength=t["path"].size)
    assert per_face.max() == 3  # 4 photos per identity: 3 others


def test_train_quality_from_feature_files_writes_a_loadable_head(tmp_path: Path) -> None:
    t = synthetic_table(feat_dim=TINY_HEAD_DIM)
    part = tmp_path / "qf_0.npz"
    np.savez_compressed(part, **{c: t[c] for c in FEATURE_COLUMNS})
    assert read_parts([tmp_path], FEATURE_COLUMNS)["identity"].tolist() == t["identity"].tolist()
    out = tmp_path / "head.pt"
    summary = train_quality(
        [part],
        out,
        match_threshold=0.5,
        config=RTSConfig(epochs=8, batch_size=16, lr=1e-2),
        command="test",
    )
    assert summary["identities"] == 8 and out.is_file()
    _head, cal, meta = load_head(out, backbone="sface", feature_dim=TINY_HEAD_DIM)
    for k in ("trained_on", "identities", "command", "date", "config", "match_threshold"):
        assert k in meta
    assert cal.fitted and cal.direction == -1
    # the recognizer reads it: rts_head source, fitted calibration, embedding untouched
    rec = build_recognizer(TINY_SFACE, quality_head=out)
    base = build_recognizer(TINY_SFACE)
    crops = torch.randint(0, 256, (3, 112, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    emb, q, raw = rec(crops)
    assert rec.quality_source == "rts_head" and bool((raw > 0).all()) and bool(((q >= 0) & (q <= 1)).all())
    assert torch.equal(emb, base(crops)[0])


@pytest.mark.lfw
@pytest.mark.slow
def test_train_quality_from_a_photo_folder(lfw_root: Path, tmp_path: Path) -> None:
    """`facegate train-quality DIR`: real extraction (CPU) on a few LFW identities, then training."""
    src = lfw_root / "lfw-deepfunneled"
    names = ["Tony_Blair", "Colin_Powell", "Jean_Chretien", "Ariel_Sharon"]
    root = tmp_path / "faces"
    for n in names:
        (root / n).mkdir(parents=True)
        for f in sorted((src / n).glob("*.jpg"))[:3]:
            (root / n / f.name).symlink_to(f.resolve())  # absolute: the LFW root may be given relative
    out = tmp_path / "head.pt"
    summary = train_quality(
        root, out, match_threshold=0.3582, config=RTSConfig(epochs=2, batch_size=8), n_random=1,
        save_features=tmp_path / "f.npz",
    )  # fmt: skip
    assert summary["identities"] == 4 and summary["faces_found"] > 0.7
    _head, cal, _ = load_head(out, backbone="sface", feature_dim=1152)
    assert cal.direction == -1 and (tmp_path / "f.npz").is_file()
    assert set(np.load(tmp_path / "f.npz")["path"].tolist()) >= {f"{n}/{n}_0001.jpg" for n in names}


@pytest.mark.lfw
def test_shipped_head_keeps_the_real_embedding(lfw_root: Path) -> None:
    """The shipped head changes only the quality: real SFace embeddings are bit-identical with and without it."""
    import facegate

    path = Path(facegate.__file__).parent / "models" / "heads" / "sface_rts_v1.pt"
    if not path.is_file():
        pytest.skip("no shipped head yet")
    import cv2

    base = build_recognizer(SFACE)
    rec = build_recognizer(SFACE, quality_head=path)
    files = sorted((lfw_root / "lfw-deepfunneled" / "Tony_Blair").glob("*.jpg"))[:4]
    crops = np.stack([cv2.resize(cv2.imread(str(f))[69:181, 69:181, ::-1], (112, 112)) for f in files])
    x = torch.from_numpy(np.ascontiguousarray(crops))
    e0, _, _ = base(x)
    e1, q, raw = rec(x)
    assert torch.equal(e0, e1)
    assert rec.calibration.fitted and rec.calibration.direction == -1
    assert bool((raw > 0).all()) and bool(((q >= 0) & (q <= 1)).all())
