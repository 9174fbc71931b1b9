"""RTS quality-head training on frozen-backbone features (Shang et al., AAAI 2023; the loss is in docs/quality.md), and
its calibration, on cached features (:func:`facegate.eval.features.extract`) ``head_in (N, 1152)``, ``emb (N, 128)``.

The target-class cosine is against the *other* clean photos of the identity (as a genuine comparison sees). The
calibration maps σ² to P(a genuine comparison reaches the match threshold), on the training identities.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from facegate.errors import InvalidParameterError
from facegate.eval.features import extract, plan_variants, read_parts
from facegate.models.quality import QualityCalibration, RTSQualityHead, fit_logistic, save_head

log = logging.getLogger(__name__)

#: Columns of a feature table (see :func:`facegate.eval.features.extract`).
FEATURE_COLUMNS = ("path", "variant", "degradation", "severity", "found", "det", "norm", "heuristic", "emb", "head_in")


@dataclass(frozen=True)
class RTSConfig:
    """Hyper-parameters. ``scale``: SFace's genuine margins (0.05-0.3) need ``s·m`` > ``log C`` (docs/quality.md)."""

    scale: float = 256.0
    dof: int = 32  #: >= 3 (τ divides by dof − 2): the CLI's --dof checks it
    kl_scale: float = 0.1
    epochs: int = 8
    batch_size: int = 256  #: >= 2 (the head ends in BatchNorm1d)
    lr: float = 2e-3
    seed: int = 0
    max_refs: int = 8  #: reference photos per face for the calibration outcomes


def rts_loss(
    logvar: Tensor, cos: Tensor, labels: Tensor, *, scale: float, dof: int, kl_scale: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, ce, kl)`` of one batch: ``logvar (B, 1)``, ``cos (B, C)``, ``labels (B,)`` int64."""
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
    target_proto: np.ndarray,
    config: RTSConfig,
    *,
    device: str = "cpu",
) -> tuple[RTSQualityHead, list[dict[str, float]]]:
    """A head (eval, CPU, fp32, on raw ``head_in``; trained standardised) and its per-epoch losses, from ``head_in
    (N, F)``, ``emb (N, D)``, ``labels (N,)`` against frozen ``class_init (C, D)``; ``target_proto (N, D)``: each
    row's target-class weight (the other clean photos of its identity)."""
    n = head_in.shape[0]
    if not (emb.shape[0] == labels.shape[0] == n) or n < 2:
        raise InvalidParameterError(f"need >= 2 aligned rows, got head_in {head_in.shape}, emb {emb.shape}")
    dev = torch.device(device)
    x = torch.as_tensor(np.asarray(head_in, np.float32))
    mu, sd = x.double().mean(0).float(), x.double().std(0).float().clamp_min(1e-6)
    x = ((x - mu) / sd).to(dev)
    e = F.normalize(torch.as_tensor(np.asarray(emb, np.float32)), dim=1).to(dev)
    y = torch.as_tensor(np.asarray(labels, np.int64)).to(dev)
    w = F.normalize(torch.as_tensor(np.asarray(class_init, np.float32)), dim=1).to(dev)
    tcos = (e * F.normalize(torch.as_tensor(np.asarray(target_proto, np.float32)), dim=1).to(dev)).sum(1)
    torch.manual_seed(config.seed)
    head = RTSQualityHead(x.shape[1], backbone="sface").to(dev).train()
    opt = torch.optim.Adam(head.parameters(), lr=config.lr)
    g_order = torch.Generator().manual_seed(config.seed)
    g_eps = torch.Generator(device=dev).manual_seed(config.seed + 1)
    bs = min(config.batch_size, n)
    steps = n // bs  # the ragged last batch is dropped (BatchNorm with 1 row is undefined)
    history: list[dict[str, float]] = []
    kw = {"scale": config.scale, "dof": config.dof, "kl_scale": config.kl_scale, "generator": g_eps}
    with tqdm(total=steps * config.epochs, desc="rts", unit="step", file=sys.stderr) as bar:
        for ep in range(config.epochs):
            perm = torch.randperm(n, generator=g_order).to(dev)
            tot = torch.zeros(3, device=dev)
            for k in range(steps):
                idx = perm[k * bs : (k + 1) * bs]
                cos = (e[idx] @ w.T).scatter(1, y[idx][:, None], tcos[idx][:, None])
                loss, ce, kl = rts_loss(head(x[idx]), cos, y[idx], **kw)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += torch.stack([loss.detach(), ce, kl])
                bar.update(1)
            m = (tot / steps).cpu().tolist()
            history.append({"epoch": ep + 1, "loss": m[0], "ce": m[1], "kl": m[2]})
    head = head.cpu().eval()
    _fold_standardisation(head, mu, sd)
    return head, history


@torch.inference_mode()
def head_sigma2(head: RTSQualityHead, head_in: np.ndarray) -> np.ndarray:
    """``σ² (N,) float64`` of ``head_in (N, F)``; rows with NaN input (no face) give NaN."""
    x = np.asarray(head_in, np.float32)
    out = np.full(x.shape[0], np.nan)
    ok = np.isfinite(x).all(axis=1)
    out[ok] = torch.exp(head.float().eval()(torch.from_numpy(x[ok]))).reshape(-1).double().numpy()
    return out


def genuine_outcomes(
    table: dict[str, np.ndarray], rows: np.ndarray, threshold: float, *, max_refs: int = 8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Each found face of ``rows`` against up to ``max_refs`` clean faces of its identity from other photos:
    ``(face_row (M,) int64, success (M,) float64)``."""
    rng = np.random.default_rng(seed)
    rows = np.asarray(rows)[table["found"][rows]]
    ident, path = table["identity"], table["path"]
    by_id: dict[str, list[int]] = {}
    for r in rows[table["variant"][rows] == 0].tolist():
        by_id.setdefault(str(ident[r]), []).append(r)
    fi, ri = [], []
    for r in rows.tolist():
        refs = [c for c in by_id.get(str(ident[r]), ()) if path[c] != path[r]]
        if len(refs) > max_refs:
            refs = rng.choice(refs, size=max_refs, replace=False).tolist()
        fi += [r] * len(refs)
        ri += refs
    emb = table["emb"]
    sims = np.einsum("ij,ij->i", emb[fi].astype(np.float32), emb[ri].astype(np.float32))
    return np.asarray(fi, np.int64), (sims >= threshold).astype(np.float64)


def train_and_calibrate(
    table: dict[str, np.ndarray], config: RTSConfig, *, match_threshold: float, device: str = "cpu"
) -> tuple[RTSQualityHead, QualityCalibration, dict[str, Any]]:
    """Train and calibrate a head on the table's found faces (clean and degraded): ``(head, calibration, record)``,
    the record counting the identities and the faces the loss saw (those with another clean photo of their
    identity), with the per-epoch losses."""
    rows = np.flatnonzero(table["found"])
    if rows.size < config.batch_size:
        raise InvalidParameterError(
            f"only {rows.size} faces found; need at least {config.batch_size} faces (the training batch): add photos"
        )
    present, labels = np.unique(table["identity"][rows], return_inverse=True)
    emb = table["emb"][rows].astype(np.float64)
    clean = table["variant"][rows] == 0
    class_sum = np.zeros((present.size, emb.shape[1]))
    np.add.at(class_sum, labels[clean], emb[clean])
    # leave-one-out target: the class sum minus the face's own clean photo, where another clean photo exists
    own = {p: emb[k] for k, p in enumerate(table["path"][rows]) if clean[k]}
    own_rows = np.stack([own.get(p, np.zeros(emb.shape[1])) for p in table["path"][rows]])
    has_own = np.array([p in own for p in table["path"][rows]])
    train = np.flatnonzero(np.bincount(labels[clean], minlength=present.size)[labels] - has_own > 0)
    proto = (class_sum[labels] - own_rows)[train]
    log.info("training on %d faces of %d identities", train.size, present.size)
    head, history = train_rts_head(
        table["head_in"][rows[train]],
        emb[train],
        labels[train],
        np.where(np.linalg.norm(class_sum, axis=1, keepdims=True) > 0, class_sum, 1.0),
        proto,
        config,
        device=device,
    )
    fi, succ = genuine_outcomes(table, rows, match_threshold, max_refs=config.max_refs, seed=config.seed)
    if not 0 < succ.mean() < 1:
        raise InvalidParameterError("every genuine comparison had the same outcome: nothing to calibrate on")
    cal = fit_logistic(head_sigma2(head, table["head_in"][fi]), succ, transform="log")
    if cal.direction != -1:
        log.warning("calibration direction came out %+d, expected -1", cal.direction)
    cal.note = f"P(genuine match >= {match_threshold:.4f}) on training identities"
    return head, cal, {"identities": int(present.size), "training_faces": int(train.size), "history": history}


def train_quality(
    source: Path | Sequence[str | Path],
    out: Path,
    *,
    match_threshold: float,
    config: RTSConfig = RTSConfig(),
    device: str = "cpu",
    n_random: int = 2,
    save_features: Path | None = None,
    command: str = "",
) -> dict[str, Any]:
    """``facegate train-quality``: train a head on a photo folder (``<root>/<identity>/*.jpg``, clean + ``n_random``
    random degradations of each) or ``.npz`` feature parts, write it to ``out``; returns a summary."""
    t0 = time.perf_counter()
    if isinstance(source, (str, Path)) and Path(source).is_dir() and not any(Path(source).glob("*.npz")):
        from facegate.config import Settings
        from facegate.pipeline.pipeline import FacePipeline

        root = Path(source)
        exts = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
        paths = sorted(str(p.relative_to(root)) for p in root.glob("*/*") if p.suffix.lower() in exts)
        if not paths:
            raise InvalidParameterError(f"no <identity>/<image> files under {root}", detail={"root": str(root)})
        pipe = FacePipeline.from_settings(Settings(device=device, precision="fp32", compile="off"))
        with tqdm(total=len(paths) * (1 + n_random), unit="img", desc="features", file=sys.stderr) as bar:
            plan = plan_variants(paths, n_random, 0, config.seed)
            table = extract(pipe, root, paths, plan, seed=config.seed, progress=bar.update)
        if save_features is not None:
            save_features.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(save_features, **table)
        table["identity"] = np.array([p.split("/")[0] for p in table["path"]])
    else:
        table = read_parts([source] if isinstance(source, (str, Path)) else list(source), FEATURE_COLUMNS)
    head, cal, record = train_and_calibrate(table, config, match_threshold=match_threshold, device=device)
    meta = {
        "trained_on": str(source),
        "identities": record["identities"],
        "training_faces": record["training_faces"],
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": asdict(config),
        "match_threshold": float(match_threshold),
        "final_loss": record["history"][-1],
    }
    save_head(Path(out), head, cal, meta)  # train_rts_head builds the head for "sface"
    return {
        "out": str(out),
        **record,
        "faces_found": float(table["found"].mean()),
        "match_threshold": float(match_threshold),
        "calibration": cal.to_dict(),
        "seconds": round(time.perf_counter() - t0, 2),
    }
