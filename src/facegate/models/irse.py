"""IR-SE-64 with RTS uncertainty heads (ModelScope ``damo/cv_ir_face-recognition-ood_rts``) with that model's exact
``state_dict`` keys, so its ``pytorch_model.pt`` loads with ``strict=True``. Input 112×112 RGB normalised ``(x −
127.5) / 127.5``; ``features.0`` stem; ``features.1.N`` 30 IR-SE units; ``features.2`` BN, dropout, flatten (25088);
heads ``features_backbone`` (→ 512: the embedding), ``logvar_rts_backbone`` (→ 1: RTS logvar) and
``logvar_rts_plus_backbone`` (RTS+, width alpha, unused)."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from facegate.errors import CheckpointError
from facegate.models.fold import fold_batchnorms

log = logging.getLogger(__name__)

#: IR-SE-64 units per stage and channel widths (ModelScope ``get_blocks(64)``).
IRSE64_UNITS: tuple[int, int, int, int] = (3, 8, 16, 3)
IRSE64_WIDTHS: tuple[int, int, int, int] = (64, 128, 256, 512)
#: RTS+ head width when the checkpoint does not fix it.
DEFAULT_ALPHA = 16
_LIST_LIMIT = 10


class SEModule(nn.Module):
    """Squeeze-and-excitation gate: ``(N, C, H, W) → (N, C, H, W)``."""

    def __init__(self, channels: int, reduction: int) -> None:
        super().__init__()
        hidden = channels // reduction
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, hidden, kernel_size=1, padding=0, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(hidden, channels, kernel_size=1, padding=0, bias=False)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return x * self.sigmoid(self.fc2(self.relu(self.fc1(self.avg_pool(x)))))


class Subsample(nn.Module):
    """``MaxPool2d(1, s)`` as a view ``x[:, :, ::s, ::s]``, for the fused identity shortcuts."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = int(stride)

    def forward(self, x: Tensor) -> Tensor:
        return x if self.stride == 1 else x[:, :, :: self.stride, :: self.stride]


class BottleneckIRSE(nn.Module):
    """One IR-SE unit: pre-BN residual branch with SE, plus a shortcut: ``(N, in, H, W) → (N, out, H/s, W/s)``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.shortcut_layer: nn.Module
        if in_channels == out_channels:
            self.shortcut_layer = nn.MaxPool2d(1, stride)
        else:
            self.shortcut_layer = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, (1, 1), stride, bias=False), nn.BatchNorm2d(out_channels)
            )
        self.res_layer = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.Conv2d(in_channels, out_channels, (3, 3), (1, 1), 1, bias=False),
            nn.PReLU(out_channels),
            nn.Conv2d(out_channels, out_channels, (3, 3), stride, 1, bias=False),
            nn.BatchNorm2d(out_channels),
            SEModule(out_channels, 16),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.res_layer(x) + self.shortcut_layer(x)


class IRSE64RTS(nn.Module):
    """ModelScope ``RTSBackbone``. ``alpha``: the RTS+ head's width; ``units``, ``widths``: per stage."""

    def __init__(
        self, alpha: int = DEFAULT_ALPHA, *, units: Sequence[int] = IRSE64_UNITS, widths: Sequence[int] = IRSE64_WIDTHS
    ) -> None:
        super().__init__()
        self.alpha = int(alpha)
        self.embedding_dim = 512
        side = 112 // 16  # four stride-2 stages on 112×112 crops
        self.feature_dim = int(widths[-1] * side * side)

        body: list[nn.Module] = []
        in_ch = widths[0]
        for n_units, out_ch in zip(units, widths, strict=True):
            for i in range(n_units):
                body.append(BottleneckIRSE(in_ch, out_ch, 2 if i == 0 else 1))
                in_ch = out_ch
        self.features = nn.Sequential(
            nn.Sequential(
                nn.Conv2d(3, widths[0], (3, 3), 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.PReLU(widths[0])
            ),
            nn.Sequential(*body),
            nn.Sequential(nn.BatchNorm2d(widths[-1]), nn.Dropout(), nn.Flatten()),
        )
        self.features_backbone = nn.Sequential(
            nn.Linear(self.feature_dim, self.embedding_dim), nn.BatchNorm1d(self.embedding_dim)
        )
        self.logvar_rts_backbone = nn.Sequential(nn.Linear(self.feature_dim, 1), nn.BatchNorm1d(1))
        self.logvar_rts_plus_backbone = nn.Sequential(
            nn.Linear(self.feature_dim, self.alpha), nn.BatchNorm1d(self.alpha)
        )

    def stages(self) -> list[nn.Module]:
        """The trunk ``features`` in order: ``(N, 3, S, S)`` → ``(N, feature_dim)`` (25088 for the full model)."""
        return [self.features[0], *self.features[1], self.features[2]]

    def heads(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``(N, F)`` → ``(raw embedding (N, D), logvar (N, 1))``."""
        return self.features_backbone(features), self.logvar_rts_backbone(features)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(N, 3, S, S)`` normalised RGB → ``(raw embedding (N, D), logvar (N, 1))``."""
        return self.heads(self.features(x))

    def fuse(self) -> IRSE64RTS:
        """Fold every BN that follows a conv or linear layer, in place (each unit's leading BN, before a zero-padded
        conv, and ``features.2.0`` stay); an identity shortcut becomes a :class:`Subsample`. Eval only, idempotent,
        after loading (the keys change)."""
        fold_batchnorms(self)
        for unit in self.features[1]:
            if isinstance(unit.shortcut_layer, nn.MaxPool2d):
                unit.shortcut_layer = Subsample(unit.shortcut_layer.stride)  # built with an int stride
        return self


def tiny_irse(seed: int = 0, alpha: int = 4) -> IRSE64RTS:
    """A narrow IR-SE-RTS (the full model's key pattern), seeded random weights and BN statistics, eval, for tests."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = IRSE64RTS(alpha, units=(1, 1, 1, 1), widths=(16, 32, 48, 64))
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm1d | nn.BatchNorm2d):
            n = mod.num_features
            mod.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
            mod.running_var.copy_(0.5 + torch.rand(n, generator=gen))
            mod.weight.data.copy_(0.75 + 0.5 * torch.rand(n, generator=gen))
            mod.bias.data.copy_(0.1 * torch.randn(n, generator=gen))
    return model.eval()


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """``torch.load(weights_only=True)`` → ``{key: Tensor}``, or :class:`CheckpointError`."""
    detail: dict[str, Any] = {"path": str(path)}
    if not path.is_file():
        raise CheckpointError(f"RTS checkpoint {path} does not exist or is not a file.", detail=detail)
    if zipfile.is_zipfile(path):  # TorchScript archives hold a <root>/code/ folder or constants.pkl
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
        if any(n.split("/", 1)[-1].startswith("code/") or n.endswith("/constants.pkl") for n in names):
            raise CheckpointError(
                f"{path} is a TorchScript archive; facegate needs the plain state_dict "
                "(ModelScope's pytorch_model.pt, saved with torch.save(model.state_dict())).",
                detail={**detail, "reason": "torchscript"},
            )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError/EOFError/... variants
        error = f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"Cannot read RTS checkpoint {path} as a weights-only torch file: {error}",
            detail={**detail, "reason": "unreadable", "error": error},
        ) from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(obj).__name__}, not a state_dict (a mapping of names to tensors).",
            detail={**detail, "reason": "not_a_state_dict", "type": type(obj).__name__},
        )
    bad = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise CheckpointError(
            f"{path} is not a plain state_dict: {len(bad)} entries are not tensors, e.g. {bad[:_LIST_LIMIT]} "
            "(a training checkpoint? save model.state_dict() instead).",
            detail={**detail, "reason": "not_a_state_dict", "non_tensor_keys": bad[:_LIST_LIMIT]},
        )
    sd = {str(k): v for k, v in obj.items()}
    if sd and all(k.startswith("module.") for k in sd):
        log.warning("%s: stripping the leading 'module.' (DataParallel) prefix from all %d keys", path, len(sd))
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
    return sd


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], *, source: str = "state_dict") -> None:
    """:class:`CheckpointError` (naming the first missing, unexpected and mis-shaped keys, with counts) unless
    ``state_dict`` has exactly ``model``'s keys and shapes."""
    expected = model.state_dict()
    found = {
        "missing": [k for k in expected if k not in state_dict],
        "unexpected": [k for k in state_dict if k not in expected],
        "mismatched": [
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
            for k, v in expected.items()
            if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
        ],
    }
    if not any(found.values()):
        return
    words = {"missing": "missing", "unexpected": "unexpected", "mismatched": "mis-shaped"}
    parts = [f"{len(v)} {words[k]} (e.g. {v[:_LIST_LIMIT]})" for k, v in found.items() if v]
    detail: dict[str, Any] = {"source": source}
    for k, v in found.items():
        detail[k if k != "mismatched" else "mismatched_shapes"] = v[:_LIST_LIMIT]
        detail[f"{k}_count"] = len(v)
    raise CheckpointError(f"{source} does not match {type(model).__name__}: " + "; ".join(parts), detail=detail)


def load_rts_checkpoint(path: Path) -> IRSE64RTS:
    """:class:`IRSE64RTS` strictly loaded from ModelScope's ``pytorch_model.pt``, CPU, fp32, eval (``alpha`` from
    ``logvar_rts_plus_backbone.0.weight``). :class:`CheckpointError`: missing, unreadable, TorchScript, not a plain
    state_dict, or keys/shapes that differ."""
    sd = _read_state_dict(path)
    w = sd.get("logvar_rts_plus_backbone.0.weight")
    alpha = int(w.shape[0]) if w is not None and w.ndim == 2 else DEFAULT_ALPHA
    model = IRSE64RTS(alpha)
    check_state_dict(model, sd, source=str(path))
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:  # e.g. dtype that cannot be copied; keys/shapes were checked above
        raise CheckpointError(f"Cannot load {path}: {exc}", detail={"path": str(path)}) from exc
    log.info("loaded RTS IR-SE-64 from %s (alpha=%d, %d entries)", path, alpha, len(sd))
    return model.float().eval()
