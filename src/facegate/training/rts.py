"""RTS quality-head training on frozen-backbone features (Shang et al., AAAI 2023), and its calibration.

The backbone (SFace) is frozen: training reads cached per-face features
(:func:`facegate.eval.features.extract`): ``head_in (N, 1152)`` (pooled trunk + raw embedding) and the
L2-normalised embedding ``emb (N, 128)``. The head is :class:`~facegate.models.quality.RTSQualityHead`
(``Linear(1152 → 1) + BatchNorm1d(1) → logvar``, ``σ² = exp(logvar)``).

**Loss** (per batch of B faces with identity labels ``y``)::

    cos    = normalize(emb) @ normalize(W)ᵀ                  (B, C)   cosine classifier over training identities
    τ_b    = σ²_b · Σ_{i=1..dof} ε_{b,i}² / (dof − 2),      ε ~ N(0, 1), fresh every step
    loss   = CE(s · cos / τ, y) + kl_scale · mean(½ (σ² − log σ² − 1))

``W (C, 128)`` starts at the class means of the clean embeddings; it is learnable (``classifier_lr``)
but frozen by default. With the default ``target="leave_one_out"`` the target-class cosine of a face is
taken against the mean of the *other* clean photos of its identity (its own clean photo left out), which
is what a genuine comparison sees. Dividing the logits by a large τ flattens the softmax, which lowers
the loss of a face the classifier gets wrong and raises it for one it gets right: the head learns a large
σ² for faces whose embedding does not sit near its identity (degraded, occluded, badly aligned), a small
one otherwise; the KL term keeps σ² near 1. Why the defaults deviate from "learnable, s≈32": see
:class:`RTSConfig` and docs/quality.md.

The head's input is standardised on the training rows during training (per-feature mean/std) and the
standardisation is folded into ``fc`` afterwards, so the saved head reads raw ``head_in`` like the
recognizer feeds it.

**Calibration** (:func:`genuine_outcomes`, :func:`fit_quality_calibration`): quality = the estimated
probability that a genuine comparison of this face against a clean photo of the same identity (a
*different* photo) reaches the match threshold set at FMR 1e-3; fitted on training identities only.
"""

from __future__ import annotations

import glob
import json
import logging
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import InvalidParameterError
from facegate.models.quality import (
    QualityCalibration,
    RTSQualityHead,
    bn_logvar_calibration,
    fit_isotonic,
    fit_logistic,
    save_head,
)

log = logging.getLogger(__name__)

CalibKind = Literal["logistic", "isotonic"]
TargetKind = Literal["class_mean", "leave_one_out"]
#: Columns of a feature table (see :func:`facegate.eval.features.extract`).
FEATURE_COLUMNS = ("path", "variant", "degradation", "severity", "found", "det", "norm", "heuristic", "emb", "head_in")


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class RTSConfig:
    """Hyper-parameters of RTS head training.

    Attributes:
        scale: cosine-classifier scale ``s``. 256, chosen on data (see docs/quality.md). Per face, the
            loss-optimal temperature is ``σ²* ≈ min(1, s·m / (log C + c))`` for a positive target margin
            ``m`` (cosine to the own class minus the best other) and ``σ²* > 1`` only for ``m < 0``: faces
            with a small positive margin, which degraded faces usually are, are pushed *below* clean
            ones unless ``s·m`` exceeds ``log C`` (≈ 8 for ~3,000 classes) for typical margins. SFace's
            leave-one-out margins on LFW are ≈ 0.05–0.3, so ``s`` must be ≳ 100. Measured (cross-fitted,
            LFW half A): s = 32 / 64 / 128 / 256 → pAUC@20% 0.142 / 0.138 / 0.1375 / 0.137 and
            monotone-drop share 0.46 / 0.81 / 0.90 / 0.90; with a learnable classifier and s = 32 the
            head came out inverted (calibration direction +1).
        dof: degrees of freedom of the random temperature (≥ 3).
        kl_scale: weight of ``½(σ² − log σ² − 1)``.
        epochs: passes over the training rows.
        batch_size: rows per step (the head's BatchNorm needs > 1).
        lr: Adam learning rate of the head.
        classifier_lr: Adam learning rate of the classifier weights ``W``; 0 (default) freezes them at the
            class means. Learnable weights fit the few photos per LFW identity (the class means move onto
            their own degraded copies) and the head learned the wrong direction (measured, docs/quality.md).
        weight_decay: Adam weight decay of the head's Linear weights.
        seed: seeds the head init, the batch order and ε.
        max_refs: reference photos per face when building calibration outcomes.
        calibration: ``"logistic"`` (on log σ²) or ``"isotonic"``.
        fmr: false-match rate of the match threshold the calibration target uses.
        target: the target-class logit. ``"class_mean"``: the face's cosine to its class weight (the
            class mean includes the face's own clean photo). ``"leave_one_out"``: the cosine to the
            mean of the *other* clean photos of its identity (what a genuine comparison sees; faces of
            identities with one photo are then only competitors); needs ``classifier_lr=0``.
    """

    scale: float = 256.0
    dof: int = 32
    kl_scale: float = 0.1
    epochs: int = 8
    batch_size: int = 256
    lr: float = 2e-3
    classifier_lr: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    max_refs: int = 8
    calibration: CalibKind = "logistic"
    fmr: float = 1e-3
    target: TargetKind = "leave_one_out"

    def __post_init__(self) -> None:
        if self.dof < 3:
            raise InvalidParameterError(f"dof must be >= 3 (τ divides by dof - 2), got {self.dof}")
        if self.batch_size < 2:
            raise InvalidParameterError("batch_size must be >= 2 (the head ends in BatchNorm1d)")
        if self.scale <= 0 or self.kl_scale < 0 or self.epochs < 1 or self.lr <= 0 or self.classifier_lr < 0:
            raise InvalidParameterError(f"invalid RTS config {self}")
        if self.target not in ("class_mean", "leave_one_out"):
            raise InvalidParameterError(f"target must be 'class_mean' or 'leave_one_out', got {self.target!r}")
        if self.target == "leave_one_out" and self.classifier_lr > 0:
            raise InvalidParameterError("target 'leave_one_out' needs a frozen classifier (classifier_lr=0)")
        if self.calibration not in ("logistic", "isotonic"):
            raise InvalidParameterError(f"calibration must be 'logistic' or 'isotonic', got {self.calibration!r}")


# --------------------------------------------------------------------------- feature tables
def identity_of(paths: np.ndarray | Sequence[str]) -> np.ndarray:
    """``Name/Name_0001.jpg`` → ``Name`` (the folder is the identity), as a ``<U`` array."""
    return np.array([str(p).replace("\\", "/").split("/")[0] for p in paths])


def expand_feature_paths(specs: Sequence[str | Path]) -> list[Path]:
    """Globs / files / folders (every ``*.npz`` inside) → sorted unique ``.npz`` paths."""
    out: set[Path] = set()
    for s in specs:
        p = Path(s)
        if p.is_dir():
            out.update(p.glob("*.npz"))
        elif p.is_file():
            out.add(p)
        else:
            out.update(Path(g) for g in glob.glob(str(s)))
    if not out:
        raise InvalidParameterError(f"no feature files match {[str(s) for s in specs]}")
    return sorted(out)


def load_features(specs: Sequence[str | Path]) -> dict[str, np.ndarray]:
    """Concatenate ``.npz`` feature parts (:mod:`benchmarks.quality_features`) into one table.

    Returns the columns of :data:`FEATURE_COLUMNS` (``emb``/``head_in`` stay float16) plus
    ``identity (N,) <U`` and ``n_random (1,) int`` (random degraded variants per image, read from the
    parts' ``env`` record; variants ``1..n_random`` are random, higher ones are the progressive sweep).
    Duplicate ``(path, variant)`` rows (overlapping parts) are dropped.
    """
    files = expand_feature_paths(specs)
    parts: list[dict[str, np.ndarray]] = []
    n_random: set[int] = set()
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                missing = [c for c in FEATURE_COLUMNS if c not in z.files]
                if missing:
                    raise InvalidParameterError(f"{f} lacks columns {missing}")
                parts.append({c: z[c] for c in FEATURE_COLUMNS})
                if "env" in z.files:
                    cfg = json.loads(str(z["env"])).get("config", {})
                    if "random" in cfg:
                        n_random.add(int(cfg["random"]))
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(f"cannot read feature file {f}: {exc}", detail={"path": str(f)}) from exc
    if len(n_random) > 1:
        raise InvalidParameterError(f"feature parts disagree on the number of random variants: {sorted(n_random)}")
    table = {c: np.concatenate([p[c] for p in parts]) for c in FEATURE_COLUMNS}
    key = np.char.add(np.char.add(table["path"].astype(str), "#"), table["variant"].astype(str))
    _, first = np.unique(key, return_index=True)
    if first.size != key.size:
        log.warning("dropping %d duplicate (path, variant) rows", key.size - first.size)
        first.sort()
        table = {c: v[first] for c, v in table.items()}
    table["identity"] = identity_of(table["path"])
    table["n_random"] = np.array([n_random.pop() if n_random else 2])
    log.info(
        "features: %d rows, %d images, %d identities from %d files",
        len(table["path"]),
        len(np.unique(table["path"])),
        len(np.unique(table["identity"])),
        len(files),
    )
    return table


# --------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """A trained head with its calibration and training record."""

    head: RTSQualityHead
    calibration: QualityCalibration
    history: list[dict[str, float]]
    identities: list[str]
    match_threshold: float
    calibration_report: dict[str, Any] = field(default_factory=dict)
    n_train: int = 0  #: faces the loss saw (with a leave-one-out target: faces with another clean photo)
    n_faces: int = 0  #: found faces of the identities (all used for the classes and the calibration)


class CosineClassifier(nn.Module):
    """``emb (B, D) → cos (B, C)`` against learnable class weights ``W (C, D)`` (compared normalised)."""

    def __init__(self, init: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(F.normalize(init.float(), dim=1).clone())

    def forward(self, emb: Tensor) -> Tensor:
        return F.normalize(emb, dim=1) @ F.normalize(self.weight, dim=1).T


def rts_loss(
    logvar: Tensor, cos: Tensor, labels: Tensor, *, scale: float, dof: int, kl_scale: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """RTS loss of one batch.

    Args:
        logvar: ``(B, 1)`` float32 head output.
        cos: ``(B, C)`` float32 cosines to the class weights.
        labels: ``(B,)`` int64 class indices.
        scale, dof, kl_scale: see :class:`RTSConfig`.
        generator: draws ``ε (B, dof) ~ N(0, 1)`` on ``logvar``'s device.

    Returns:
        ``(loss, ce, kl)`` scalars.
    """
    sigma2 = torch.exp(logvar.float()).reshape(-1)
    eps = torch.randn(sigma2.shape[0], dof, device=sigma2.device, generator=generator)
    tau = sigma2 * eps.square().sum(dim=1) / (dof - 2)
    ce = F.cross_entropy(scale * cos / tau[:, None], labels)
    kl = (0.5 * (sigma2 - logvar.float().reshape(-1) - 1.0)).mean()
    return ce + kl_scale * kl, ce.detach(), kl.detach()


def _fold_standardisation(head: RTSQualityHead, mu: Tensor, sd: Tensor) -> None:
    """Make ``head(x)`` equal the head trained on ``(x − mu) / sd``."""
    with torch.no_grad():
        w = head.fc.weight / sd[None, :]
        head.fc.bias.sub_((w * mu[None, :]).sum(dim=1))
        head.fc.weight.copy_(w)


def train_rts_head(
    head_in: np.ndarray,
    emb: np.ndarray,
    labels: np.ndarray,
    class_init: np.ndarray,
    config: RTSConfig,
    *,
    device: str | torch.device = "cpu",
    backbone: str = "sface",
    target_proto: np.ndarray | None = None,
    progress: bool = True,
) -> tuple[RTSQualityHead, list[dict[str, float]]]:
    """Train an :class:`RTSQualityHead` with the RTS loss on frozen features.

    Args:
        head_in: ``(N, F)`` head inputs (any float dtype; used as float32).
        emb: ``(N, D)`` embeddings (normalised or not).
        labels: ``(N,)`` class index in ``[0, C)``.
        class_init: ``(C, D)`` initial classifier weights (class means of clean embeddings).
        config: hyper-parameters.
        device: ``"cpu"``, ``"cuda"``, ...
        backbone: arch id recorded in the head.
        target_proto: ``(N, D)`` optional per-row target-class vector replacing the target column of the
            cosine matrix (the leave-one-out class mean); rows without one must not be passed.
        progress: show a tqdm bar (stderr).

    Returns:
        ``(head in eval mode on CPU, fp32, reading raw head_in; per-epoch history)``.
    """
    from tqdm import tqdm

    n = head_in.shape[0]
    if not (emb.shape[0] == labels.shape[0] == n) or n < 2:
        raise InvalidParameterError(f"need >= 2 aligned rows, got head_in {head_in.shape}, emb {emb.shape}")
    if labels.min() < 0 or labels.max() >= class_init.shape[0]:
        raise InvalidParameterError("labels out of range of class_init")
    dev = torch.device(device)
    x = torch.as_tensor(np.asarray(head_in, np.float32))
    mu = x.double().mean(0).float()
    sd = x.double().std(0).float().clamp_min(1e-6)
    x = ((x - mu) / sd).to(dev)
    e = F.normalize(torch.as_tensor(np.asarray(emb, np.float32)), dim=1).to(dev)
    y = torch.as_tensor(np.asarray(labels, np.int64)).to(dev)
    tp = None if target_proto is None else F.normalize(torch.as_tensor(np.asarray(target_proto, np.float32)), dim=1)
    tcos = None if tp is None else (e.cpu() * tp).sum(1).to(dev)  # (N,) fixed target cosines

    torch.manual_seed(config.seed)
    head = RTSQualityHead(x.shape[1], backbone=backbone).to(dev).train()
    clf = CosineClassifier(torch.as_tensor(np.asarray(class_init, np.float32))).to(dev)
    groups: list[dict[str, Any]] = [{"params": list(head.parameters()), "lr": config.lr}]
    if config.classifier_lr > 0:
        groups.append({"params": list(clf.parameters()), "lr": config.classifier_lr})
    else:
        clf.weight.requires_grad_(False)
    opt = torch.optim.Adam(groups, weight_decay=config.weight_decay)
    g_order = torch.Generator().manual_seed(config.seed)
    g_eps = torch.Generator(device=dev).manual_seed(config.seed + 1)
    bs = min(config.batch_size, n)
    steps = n // bs  # drop the ragged last batch (BatchNorm with 1 row is undefined)
    history: list[dict[str, float]] = []
    with tqdm(total=steps * config.epochs, desc="rts", unit="step", file=sys.stderr, disable=not progress) as bar:
        for ep in range(config.epochs):
            perm = torch.randperm(n, generator=g_order).to(dev)
            tot = torch.zeros(3, device=dev)
            for k in range(steps):
                idx = perm[k * bs : (k + 1) * bs]
                logvar = head(x[idx])
                cos = clf(e[idx])
                if tcos is not None:
                    cos = cos.scatter(1, y[idx][:, None], tcos[idx][:, None])
                loss, ce, kl = rts_loss(
                    logvar,
                    cos,
                    y[idx],
                    scale=config.scale,
                    dof=config.dof,
                    kl_scale=config.kl_scale,
                    generator=g_eps,
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += torch.stack([loss.detach(), ce, kl])
                bar.update(1)
            m = (tot / max(steps, 1)).cpu().tolist()
            history.append({"epoch": ep + 1, "loss": m[0], "ce": m[1], "kl": m[2]})
            bar.set_postfix(loss=f"{m[0]:.4f}", ce=f"{m[1]:.4f}", kl=f"{m[2]:.4f}")
            log.debug("epoch %d: loss %.4f ce %.4f kl %.4f", ep + 1, *m)
    head = head.cpu().eval()
    _fold_standardisation(head, mu, sd)
    return head, history


@torch.inference_mode()
def head_sigma2(head: RTSQualityHead, head_in: np.ndarray, *, batch: int = 65536) -> np.ndarray:
    """``σ² (N,) float64`` of ``head_in (N, F)``; rows with NaN input (no face) give NaN."""
    head = head.float().eval()
    x = np.asarray(head_in, np.float32)
    out = np.full(x.shape[0], np.nan)
    ok = np.isfinite(x).all(axis=1)
    idx = np.flatnonzero(ok)
    for s in range(0, idx.size, batch):
        j = idx[s : s + batch]
        out[j] = head.sigma2(torch.from_numpy(x[j])).double().numpy()
    return out


# --------------------------------------------------------------------------- calibration
def impostor_threshold_sampled(
    table: dict[str, np.ndarray], rows: np.ndarray, *, fmr: float = 1e-3, n_pairs: int = 200_000, seed: int = 0
) -> float:
    """Match threshold at ``fmr`` from sampled cross-identity comparisons among ``rows``.

    Each sample compares a clean found face with a found face (any variant) of another identity, the
    composition of LFW's impostor pairs plus their degraded variants. Used when no pair list exists.
    """
    from facegate.eval.lfw import threshold_at_fmr

    rows = rows[table["found"][rows]]
    clean = rows[table["variant"][rows] == 0]
    if clean.size < 2:
        raise InvalidParameterError("need at least 2 clean found faces to set a match threshold")
    rng = np.random.default_rng(seed)
    a = clean[rng.integers(clean.size, size=n_pairs)]
    b = rows[rng.integers(rows.size, size=n_pairs)]
    keep = table["identity"][a] != table["identity"][b]
    a, b = a[keep], b[keep]
    emb = table["emb"]
    sims = np.einsum("ij,ij->i", emb[a].astype(np.float32), emb[b].astype(np.float32))
    return threshold_at_fmr(sims, fmr)


def genuine_outcomes(
    table: dict[str, np.ndarray],
    rows: np.ndarray,
    threshold: float,
    *,
    max_refs: int = 8,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Binary outcomes of genuine comparisons, the calibration target.

    For each found face in ``rows`` (any variant), up to ``max_refs`` references are drawn (seeded)
    among the *clean* found faces of the same identity in ``rows`` from a *different* photo; each
    comparison gives ``1`` when ``cos ≥ threshold``. Faces without such a reference are skipped.

    Returns:
        ``(face_row (M,) int64, success (M,) float64)``: one entry per comparison.
    """
    rng = np.random.default_rng(seed)
    rows = np.asarray(rows)
    rows = rows[table["found"][rows]]
    ident, path, var = table["identity"], table["path"], table["variant"]
    emb = table["emb"]
    clean = rows[var[rows] == 0]
    by_id: dict[str, list[int]] = {}
    for r in clean.tolist():
        by_id.setdefault(str(ident[r]), []).append(r)
    face_idx: list[np.ndarray] = []
    ref_idx: list[np.ndarray] = []
    for r in rows.tolist():
        refs = [c for c in by_id.get(str(ident[r]), ()) if path[c] != path[r]]
        if not refs:
            continue
        if len(refs) > max_refs:
            refs = rng.choice(refs, size=max_refs, replace=False).tolist()
        face_idx.append(np.full(len(refs), r))
        ref_idx.append(np.asarray(refs))
    if not face_idx:
        raise InvalidParameterError("no genuine comparisons: every identity has a single photo")
    fi, ri = np.concatenate(face_idx), np.concatenate(ref_idx)
    sims = np.einsum("ij,ij->i", emb[fi].astype(np.float32), emb[ri].astype(np.float32))
    return fi.astype(np.int64), (sims >= threshold).astype(np.float64)


def fit_quality_calibration(
    raw: np.ndarray, success: np.ndarray, kind: CalibKind, *, direction: int, note: str = ""
) -> QualityCalibration:
    """Fit ``raw → P(success)`` (log transform), checking the fitted direction.

    Args:
        raw: ``(M,)`` raw quality per comparison (σ² for a head, direction −1; feature norm, +1).
        success: ``(M,)`` binary outcomes.
        kind: ``"logistic"`` or ``"isotonic"``.
        direction: the expected direction; a fit that comes out the other way is logged as a warning
            and kept (it is reported, never silently flipped).
    """
    ok = np.isfinite(raw)
    if kind == "logistic":
        cal = fit_logistic(raw[ok], success[ok], transform="log")
    else:
        cal = fit_isotonic(raw[ok], success[ok], transform="log")
    if cal.direction != direction:
        log.warning("calibration direction came out %+d, expected %+d", cal.direction, direction)
    cal.note = f"{cal.note}; {note}".strip("; ")
    return cal


def provisional_calibration(head: RTSQualityHead) -> QualityCalibration:
    """Unfitted fallback when the outcomes have one class: ``sigmoid(−(logvar − β)/|γ|)`` from the head's BN."""
    return bn_logvar_calibration(
        head.bn, "provisional: genuine outcomes had a single class; from the head's BatchNorm1d(1)"
    )


def calibration_report(q: np.ndarray, success: np.ndarray, bins: int = 10) -> dict[str, Any]:
    """Brier score, expected calibration error and a reliability table of predictions ``q`` vs outcomes."""
    q = np.asarray(q, np.float64)
    y = np.asarray(success, np.float64)
    edges = np.linspace(0, 1, bins + 1)
    b = np.clip(np.digitize(q, edges) - 1, 0, bins - 1)
    table, ece = [], 0.0
    for k in range(bins):
        m = b == k
        if m.any():
            table.append({"bin": [float(edges[k]), float(edges[k + 1])], "n": int(m.sum()),
                          "mean_q": float(q[m].mean()), "success_rate": float(y[m].mean())})  # fmt: skip
            ece += m.mean() * abs(q[m].mean() - y[m].mean())
    return {"brier": float(np.mean((q - y) ** 2)), "ece": float(ece), "n": int(q.size), "reliability": table}


# --------------------------------------------------------------------------- one head from a table
def leave_one_out_prototypes(
    table: dict[str, np.ndarray], rows: np.ndarray, labels: np.ndarray, class_sum: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the sum of the clean embeddings of the *other* photos of its identity.

    Args:
        table: the feature table.
        rows: ``(n,)`` table rows (found faces).
        labels: ``(n,)`` class index of each row.
        class_sum: ``(C, D)`` sum of the clean embeddings of each class over ``rows``.

    Returns:
        ``(proto (n, D) float32, has (n,) bool)``; ``has`` is False when no other clean photo exists.
    """
    emb = table["emb"][rows].astype(np.float64)
    clean = table["variant"][rows] == 0
    own = {p: emb[k] for k, p in enumerate(table["path"][rows].tolist()) if clean[k]}
    n_clean = np.bincount(labels[clean], minlength=class_sum.shape[0])
    zero = np.zeros(emb.shape[1])
    own_clean = np.stack([own.get(p, zero) for p in table["path"][rows].tolist()]) if rows.size else emb
    has_own = np.array([p in own for p in table["path"][rows].tolist()], bool)
    proto = class_sum[labels] - own_clean
    has = (n_clean[labels] - has_own.astype(int)) > 0
    return proto.astype(np.float32), has


def train_on_identities(
    table: dict[str, np.ndarray],
    identities: Collection[str],
    config: RTSConfig,
    *,
    device: str | torch.device = "cpu",
    match_threshold: float | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train + calibrate a head on the found rows (clean and degraded) of ``identities``.

    ``match_threshold`` (the FMR-1e-3 threshold of the calibration target) defaults to
    :func:`impostor_threshold_sampled` on the same rows. Nothing outside ``identities`` is read.
    """
    ids = np.asarray(sorted(set(identities)))
    rows = np.flatnonzero(np.isin(table["identity"], ids) & table["found"])
    if rows.size < config.batch_size:
        raise InvalidParameterError(f"only {rows.size} training faces; need at least batch_size={config.batch_size}")
    present, labels = np.unique(table["identity"][rows], return_inverse=True)
    emb = table["emb"][rows].astype(np.float32)
    clean = table["variant"][rows] == 0
    init = np.zeros((present.size, emb.shape[1]), np.float64)
    np.add.at(init, labels[clean], emb[clean])
    no_clean = np.linalg.norm(init, axis=1) == 0
    if no_clean.any():  # identities whose clean photos had no face: fall back to all their rows
        alt = np.zeros_like(init)
        np.add.at(alt, labels, emb)
        init[no_clean] = alt[no_clean]
    train = np.arange(rows.size)
    proto = None
    if config.target == "leave_one_out":
        proto, has = leave_one_out_prototypes(table, rows, labels, init)
        train = np.flatnonzero(has)
        proto = proto[train]
    log.info(
        "training on %d faces of %d identities (%d classes, target %s)",
        train.size,
        ids.size,
        present.size,
        config.target,
    )
    head, history = train_rts_head(
        table["head_in"][rows[train]],
        emb[train],
        labels[train],
        init,
        config,
        device=device,
        target_proto=proto,
        progress=progress,
    )
    thr = (
        impostor_threshold_sampled(table, rows, fmr=config.fmr, seed=config.seed)
        if match_threshold is None
        else float(match_threshold)
    )
    fi, succ = genuine_outcomes(table, rows, thr, max_refs=config.max_refs, seed=config.seed)
    s2 = head_sigma2(head, table["head_in"][fi])
    if 0 < succ.mean() < 1:
        cal = fit_quality_calibration(
            s2, succ, config.calibration, direction=-1, note=f"P(genuine match >= {thr:.4f}) on training identities"
        )
    else:
        log.warning(
            "every genuine comparison %s: calibration left provisional", "failed" if succ.mean() == 0 else "passed"
        )
        cal = provisional_calibration(head)
    with torch.no_grad():
        q = cal(torch.from_numpy(s2).float()).double().numpy()
    rep = calibration_report(q, succ)
    rep["direction"] = cal.direction
    return TrainResult(head, cal, history, [str(i) for i in present], thr, rep, int(train.size), int(rows.size))


# --------------------------------------------------------------------------- provenance + entry points
def add_config_args(ap: Any) -> None:
    """Add :class:`RTSConfig`'s options to an ``argparse`` parser (``--scale``, ``--dof``, ...)."""
    d = RTSConfig()
    for f in ("scale", "dof", "kl_scale", "epochs", "batch_size", "lr", "classifier_lr", "seed", "max_refs"):
        ap.add_argument("--" + f.replace("_", "-"), type=type(getattr(d, f)), default=getattr(d, f))
    ap.add_argument("--calibration", choices=["logistic", "isotonic"], default=d.calibration)
    ap.add_argument("--target", choices=["class_mean", "leave_one_out"], default=d.target)


def config_from_args(ns: Any) -> RTSConfig:
    """The :class:`RTSConfig` of parsed :func:`add_config_args` options."""
    return RTSConfig(**{f: getattr(ns, f) for f in RTSConfig.__dataclass_fields__ if hasattr(ns, f)})


def git_commit() -> str:
    """The repository's HEAD commit, or ``""``."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        return ""


def head_meta(
    res: TrainResult, config: RTSConfig, *, trained_on: str, folds: list[int], command: str
) -> dict[str, Any]:
    """Plain-Python meta for :func:`save_head`."""
    return {
        "trained_on": trained_on,
        "identities": len(res.identities),
        "training_faces": res.n_train,
        "faces": res.n_faces,
        "folds": [int(f) for f in folds],
        "command": command,
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kl_scale": config.kl_scale,
        "dof": config.dof,
        "epochs": config.epochs,
        "config": asdict(config),
        "match_threshold": res.match_threshold,
        "calibration_fit": {k: v for k, v in res.calibration_report.items() if k != "reliability"},
        "final_loss": res.history[-1] if res.history else {},
    }


def extract_folder(
    root: Path, *, device: str = "cpu", n_random: int = 2, batch_size: int = 64, seed: int = 0
) -> dict[str, np.ndarray]:
    """Features of every ``<root>/<identity>/*.jpg`` (clean + ``n_random`` random degradations each)."""
    from tqdm import tqdm

    from facegate.config import Settings
    from facegate.eval.features import extract, plan_variants
    from facegate.pipeline.pipeline import FacePipeline

    root = Path(root)
    exts = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
    paths = sorted(
        str(p.relative_to(root)).replace("\\", "/")
        for p in root.glob("*/*")
        if p.is_file() and p.suffix.lower() in exts
    )
    if not paths:
        raise InvalidParameterError(f"no <identity>/<image> files under {root}", detail={"root": str(root)})
    plan = plan_variants(paths, n_random, 0, seed)
    pipe = FacePipeline.from_settings(Settings(device=device, precision="fp32", compile="off"))
    n = sum(len(v) for v in plan)
    with tqdm(total=n, desc="features", unit="face", file=sys.stderr) as bar:
        cols = extract(pipe, root, sorted(paths), plan, batch_size=batch_size, seed=seed, progress=bar.update)
    cols["identity"] = identity_of(cols["path"])
    cols["n_random"] = np.array([n_random])
    return cols


def train_quality(
    source: Path | Sequence[str | Path],
    out: Path,
    *,
    config: RTSConfig | None = None,
    device: str = "cpu",
    n_random: int = 2,
    exclude_identities: Collection[str] = (),
    match_threshold: float | None = None,
    save_features: Path | None = None,
    trained_on: str | None = None,
    command: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Train an RTS quality head and write it (what ``facegate train-quality`` does).

    Args:
        source: a folder of identity-labelled photos (``<root>/<identity>/*.jpg``; features are
            extracted with the real pipeline, clean + ``n_random`` degradations per photo), or ``.npz``
            feature parts / globs / folders of parts (cached features; fast).
        out: the head file to write (:func:`~facegate.models.quality.save_head`).
        config: hyper-parameters (default :class:`RTSConfig`).
        device: ``"cpu"`` / ``"cuda"`` for extraction and training.
        n_random: degraded variants per photo when extracting from a folder.
        exclude_identities: identities never read (e.g. an evaluation set's).
        match_threshold: cosine threshold of the calibration target; default: FMR ``config.fmr`` on
            sampled impostor comparisons of the training faces.
        save_features: also write the extracted features (folder source only) as one ``.npz``.
        trained_on: description for the head's meta (default: the source).
        command: the reproducing command for the meta.
        progress: tqdm bars.

    Returns:
        A JSON-able summary (paths, counts, history, calibration, fit report).
    """
    config = config or RTSConfig()
    t0 = time.perf_counter()
    src_is_dir = isinstance(source, (str, Path)) and Path(source).is_dir() and not any(Path(source).glob("*.npz"))
    if src_is_dir:
        table = extract_folder(Path(source), device=device, n_random=n_random, seed=config.seed)
        if save_features is not None:
            save_features.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(save_features, **{c: table[c] for c in FEATURE_COLUMNS})
    else:
        table = load_features([source] if isinstance(source, (str, Path)) else list(source))
    ids = sorted(set(np.unique(table["identity"]).tolist()) - {str(i) for i in exclude_identities})
    res = train_on_identities(table, ids, config, device=device, match_threshold=match_threshold, progress=progress)
    meta = head_meta(res, config, trained_on=trained_on or str(source), folds=[], command=command)
    save_head(Path(out), res.head, res.calibration, meta, backbone="sface")
    summary = {
        "out": str(out),
        "identities": len(res.identities),
        "training_faces": res.n_train,
        "faces": res.n_faces,
        "faces_found": float(table["found"].mean()),
        "match_threshold": res.match_threshold,
        "calibration": res.calibration.to_dict(),
        "calibration_fit": res.calibration_report,
        "history": res.history,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log.info("wrote %s (%d identities, %d faces, %.1f s)", out, len(res.identities), res.n_train, summary["seconds"])
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m facegate.training.rts SOURCE --out HEAD``: the options ``facegate train-quality`` should take."""
    import argparse
    import shlex

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m facegate.training.rts", description="Train an RTS quality head.")
    ap.add_argument("source", nargs="+", help="<root>/<identity>/*.jpg folder, or .npz feature parts/globs")
    ap.add_argument("--out", type=Path, required=True, help="head file to write")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random", type=int, default=2, help="degraded variants per photo (folder source)")
    ap.add_argument("--match-threshold", type=float, default=None)
    ap.add_argument("--save-features", type=Path, default=None)
    add_config_args(ap)
    a = ap.parse_args(argv)
    src = Path(a.source[0]) if len(a.source) == 1 and Path(a.source[0]).is_dir() else a.source
    cmd = "python -m facegate.training.rts " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    summary = train_quality(
        src, a.out, config=config_from_args(a), device=a.device, n_random=a.random,
        match_threshold=a.match_threshold, save_features=a.save_features, command=cmd,
    )  # fmt: skip
    sys.stdout.write(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2) + "\n")


__all__ = [
    "CosineClassifier",
    "RTSConfig",
    "TrainResult",
    "calibration_report",
    "expand_feature_paths",
    "fit_quality_calibration",
    "genuine_outcomes",
    "head_meta",
    "head_sigma2",
    "identity_of",
    "impostor_threshold_sampled",
    "leave_one_out_prototypes",
    "load_features",
    "rts_loss",
    "train_on_identities",
    "train_quality",
    "train_rts_head",
]

if __name__ == "__main__":
    main()
