"""IR-SE-64 with RTS uncertainty heads: ModelScope ``damo/cv_ir_face-recognition-ood_rts``.

This is a re-implementation of ModelScope's ``RTSBackbone`` (``modelscope/models/cv/face_recognition/
torchkit/rts_backbone.py``) whose module tree reproduces that model's ``state_dict`` keys exactly, so
its ``pytorch_model.pt`` (a plain state_dict, not TorchScript) loads with ``strict=True``.

Layout (``units=(3, 8, 16, 3)``, ``widths=(64, 128, 256, 512)``, 112×112 input)::

    features.0                 stem: Conv2d(3,64,3,1,1,bias=False), BatchNorm2d(64), PReLU(64)
    features.1.N               30 IR-SE units (stride 2 in the first unit of every stage):
        shortcut_layer           MaxPool2d(1, s) when in == out, else {0 Conv2d 1×1 (no bias), 1 BN}
        res_layer                {0 BN(in), 1 Conv3×3(in→out, s=1), 2 PReLU(out),
                                  3 Conv3×3(out→out, stride s), 4 BN(out), 5 SE}
        res_layer.5              SE: AdaptiveAvgPool2d(1) → fc1 Conv1×1(out→out/16, no bias) → ReLU
                                  → fc2 Conv1×1(out/16→out, no bias) → Sigmoid, multiplied in
    features.2                 {0 BatchNorm2d(512), 1 Dropout (p=0.5, identity in eval), 2 Flatten}
    features_backbone          {0 Linear(25088→512), 1 BatchNorm1d(512)}        → embedding
    logvar_rts_backbone        {0 Linear(25088→1), 1 BatchNorm1d(1)}            → logvar (RTS)
    logvar_rts_plus_backbone   {0 Linear(25088→alpha), 1 BatchNorm1d(alpha)}    → RTS+ (unused here)

Input: aligned 112×112 **RGB**, normalised as ``(x/255 − 0.5)/0.5`` (mean = std = 127.5 on 0–255).
ModelScope's pipeline reports ``exp(logvar)`` of ``logvar_rts_backbone`` as the face's "OOD score".
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from facegate.errors import CheckpointError, InvalidParameterError
from facegate.models.fold import fold_into

log = logging.getLogger(__name__)

#: IR-SE-64 units per stage and channel widths (ModelScope ``get_blocks(64)``).
IRSE64_UNITS: tuple[int, int, int, int] = (3, 8, 16, 3)
IRSE64_WIDTHS: tuple[int, int, int, int] = (64, 128, 256, 512)
#: Default RTS+ head width when nothing else is known (only the checkpoint fixes it).
DEFAULT_ALPHA = 16
_LIST_LIMIT = 10


class SEModule(nn.Module):
    """Squeeze-and-excitation gate; ``(N, C, H, W) → (N, C, H, W)`` (same dtype)."""

    def __init__(self, channels: int, reduction: int) -> None:
        super().__init__()
        hidden = channels // reduction
        if hidden < 1:
            raise ValueError(f"SE reduction {reduction} leaves no channels for width {channels}")
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, hidden, kernel_size=1, padding=0, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(hidden, channels, kernel_size=1, padding=0, bias=False)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        """Scale each channel of ``x`` by a gate in ``(0, 1)`` computed from its global average."""
        w = self.sigmoid(self.fc2(self.relu(self.fc1(self.avg_pool(x)))))
        return x * w


class Subsample(nn.Module):
    """``x[:, :, ::s, ::s]``: what ``MaxPool2d(1, s)`` computes, as a view (no kernel); ``(N, C, H, W)`` →
    ``(N, C, ceil(H/s), ceil(W/s))``. Used by :meth:`BottleneckIRSE.fuse` for the identity shortcuts."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = int(stride)

    def forward(self, x: Tensor) -> Tensor:
        """A strided view of ``x`` (``x`` itself when the stride is 1)."""
        return x if self.stride == 1 else x[:, :, :: self.stride, :: self.stride]

    def extra_repr(self) -> str:
        return f"stride={self.stride}"


class BottleneckIRSE(nn.Module):
    """One IR-SE unit (``bottleneck_IR_SE``): pre-BN residual branch with SE, plus a shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, se_reduction: int = 16) -> None:
        super().__init__()
        self.shortcut_layer: nn.Module
        if in_channels == out_channels:
            self.shortcut_layer = nn.MaxPool2d(1, stride)
        else:
            self.shortcut_layer = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, (1, 1), stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.res_layer = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.Conv2d(in_channels, out_channels, (3, 3), (1, 1), 1, bias=False),
            nn.PReLU(out_channels),
            nn.Conv2d(out_channels, out_channels, (3, 3), stride, 1, bias=False),
            nn.BatchNorm2d(out_channels),
            SEModule(out_channels, se_reduction),
        )

    def forward(self, x: Tensor) -> Tensor:
        """``(N, in, H, W) → (N, out, H/stride, W/stride)``."""
        return self.res_layer(x) + self.shortcut_layer(x)

    @torch.no_grad()
    def fuse(self) -> None:
        """Fold the BatchNorms that follow a convolution into it, and make the identity shortcut a view.

        ``res_layer.4`` goes into ``res_layer.3``, the shortcut's BN into its 1×1 conv (both become
        ``nn.Identity``), and ``MaxPool2d(1, s)`` becomes :class:`Subsample`. ``res_layer.0`` stays: it
        precedes a zero-padded convolution, so folding it would change the border pixels. Idempotent.
        """
        if isinstance(self.res_layer[4], nn.BatchNorm2d):
            fold_into(self.res_layer[3], self.res_layer[4])
            self.res_layer[4] = nn.Identity()
        sc = self.shortcut_layer
        if isinstance(sc, nn.MaxPool2d):
            stride = sc.stride if isinstance(sc.stride, int) else sc.stride[0]
            self.shortcut_layer = Subsample(stride)
        elif isinstance(sc, nn.Sequential) and isinstance(sc[1], nn.BatchNorm2d):
            fold_into(sc[0], sc[1])
            sc[1] = nn.Identity()


class IRSE64RTS(nn.Module):
    """ModelScope ``RTSBackbone`` (IR-SE-64 + RTS heads) with the exact state_dict layout.

    Args:
        alpha: width of the RTS+ head ``logvar_rts_plus_backbone`` (fixed by the checkpoint).
        units: IR-SE units per stage (``(3, 8, 16, 3)`` for IR-SE-64).
        widths: output channels per stage; the stem has ``widths[0]`` channels.
        embedding_dim: embedding size D (512).
        input_size: side of the square input (112); the body downsamples by 16.
        se_reduction: squeeze-and-excitation reduction (16).

    ``forward(x)``: ``x`` ``(N, 3, S, S)`` normalised RGB in the model dtype →
    ``(embedding (N, D) un-normalised, logvar (N, 1))`` in the model dtype.
    """

    def __init__(
        self,
        alpha: int = DEFAULT_ALPHA,
        *,
        units: Sequence[int] = IRSE64_UNITS,
        widths: Sequence[int] = IRSE64_WIDTHS,
        embedding_dim: int = 512,
        input_size: int = 112,
        se_reduction: int = 16,
    ) -> None:
        super().__init__()
        if len(units) != 4 or len(widths) != 4:
            raise ValueError("units and widths need 4 stages each")
        if input_size % 16:
            raise ValueError(f"input_size {input_size} is not a multiple of 16")
        self.alpha = int(alpha)
        self.embedding_dim = int(embedding_dim)
        self.input_size = int(input_size)
        side = input_size // 16
        self.feature_dim = int(widths[-1] * side * side)

        body: list[nn.Module] = []
        in_ch = widths[0]
        for n_units, out_ch in zip(units, widths, strict=True):
            for i in range(n_units):
                body.append(BottleneckIRSE(in_ch, out_ch, 2 if i == 0 else 1, se_reduction))
                in_ch = out_ch
        self.features = nn.Sequential(
            nn.Sequential(
                nn.Conv2d(3, widths[0], (3, 3), 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.PReLU(widths[0])
            ),
            nn.Sequential(*body),
            nn.Sequential(nn.BatchNorm2d(widths[-1]), nn.Dropout(), nn.Flatten()),
        )
        self.features_backbone = nn.Sequential(
            nn.Linear(self.feature_dim, embedding_dim), nn.BatchNorm1d(embedding_dim)
        )
        self.logvar_rts_backbone = nn.Sequential(nn.Linear(self.feature_dim, 1), nn.BatchNorm1d(1))
        self.logvar_rts_plus_backbone = nn.Sequential(
            nn.Linear(self.feature_dim, self.alpha), nn.BatchNorm1d(self.alpha)
        )

    def forward_features(self, x: Tensor) -> Tensor:
        """Flattened body output: ``(N, 3, S, S) → (N, feature_dim)`` (25088 for the full model)."""
        return self.features(x)

    def stages(self) -> list[nn.Module]:
        """The trunk as a list of modules applied in order (stem, each unit, the output BN + flatten):
        ``(N, 3, S, S)`` → ``(N, feature_dim)``, the same as :meth:`forward_features`."""
        return [self.features[0], *self.features[1], self.features[2]]

    def heads(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Embedding and RTS logvar from flattened features: ``(N, F) → ((N, D), (N, 1))``."""
        return self.features_backbone(features), self.logvar_rts_backbone(features)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(N, 3, S, S)`` normalised RGB → ``(embedding (N, D) un-normalised, logvar (N, 1))``."""
        return self.heads(self.forward_features(x))

    @property
    def fused(self) -> bool:
        """Whether :meth:`fuse` has run (the stem's BatchNorm is then an ``nn.Identity``)."""
        return isinstance(self.features[0][1], nn.Identity)

    @torch.no_grad()
    def fuse(self) -> IRSE64RTS:
        """Fold every BatchNorm that follows a conv/linear layer into it, in place; returns ``self``.

        Folded: the stem's BN, each unit's post-conv BN and shortcut BN (:meth:`BottleneckIRSE.fuse`),
        and the BatchNorm1d of the three heads. Kept: each unit's leading BN (before a zero-padded
        convolution) and ``features.2.0`` (its output is what :meth:`forward_features` returns, the
        input of an RTS quality head). That removes ~90 of the ~480 kernels of a forward, which is what
        bounds batch 1 under CUDA graphs. The outputs are unchanged up to rounding; ``state_dict`` keys
        differ afterwards (load first, then fuse). Eval-only; idempotent.

        Raises:
            InvalidParameterError: the module is in training mode.
        """
        if self.training:
            raise InvalidParameterError("IRSE64RTS.fuse() folds eval BatchNorm statistics; call .eval() first")
        if self.fused:
            return self
        stem = self.features[0]
        fold_into(stem[0], stem[1])
        stem[1] = nn.Identity()
        for unit in self.features[1]:
            unit.fuse()
        for head in (self.features_backbone, self.logvar_rts_backbone, self.logvar_rts_plus_backbone):
            fold_into(head[0], head[1])
            head[1] = nn.Identity()
        return self


def tiny_irse(seed: int = 0, alpha: int = 4, *, embedding_dim: int = 512) -> IRSE64RTS:
    """A narrow IR-SE-RTS (units ``[1,1,1,1]``, widths ``(16,32,48,64)``) with random weights, for CPU tests.

    Same class and key pattern as the full model (including a MaxPool and three conv shortcuts), with
    seeded random weights and non-trivial BatchNorm statistics so eval-mode outputs are not degenerate.
    Returned in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = IRSE64RTS(alpha, units=(1, 1, 1, 1), widths=(16, 32, 48, 64), embedding_dim=embedding_dim)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm1d | nn.BatchNorm2d):
            n = mod.num_features
            mod.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
            mod.running_var.copy_(0.5 + torch.rand(n, generator=gen))
            mod.weight.data.copy_(0.75 + 0.5 * torch.rand(n, generator=gen))
            mod.bias.data.copy_(0.1 * torch.randn(n, generator=gen))
    return model.eval()


# --------------------------------------------------------------------------- checkpoint loading
def _first(items: Sequence[str]) -> list[str]:
    return list(items[:_LIST_LIMIT])


def _is_torchscript_archive(path: Path) -> bool:
    """TorchScript archives are zips with a ``<root>/code/`` folder or ``constants.pkl``."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.split("/", 1)[-1].startswith("code/") or n.endswith("/constants.pkl") for n in names)


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """``torch.load(weights_only=True)`` → a flat ``{key: Tensor}`` dict, or :class:`CheckpointError`."""
    detail: dict[str, Any] = {"path": str(path)}
    if not path.is_file():
        raise CheckpointError(f"RTS checkpoint {path} does not exist or is not a file.", detail=detail)
    if _is_torchscript_archive(path):
        raise CheckpointError(
            f"{path} is a TorchScript archive; facegate needs the plain state_dict "
            "(ModelScope's pytorch_model.pt, saved with torch.save(model.state_dict())).",
            detail={**detail, "reason": "torchscript"},
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError/RuntimeError/EOFError/... variants
        raise CheckpointError(
            f"Cannot read RTS checkpoint {path} as a weights-only torch file: {type(exc).__name__}: {exc}",
            detail={**detail, "reason": "unreadable", "error": f"{type(exc).__name__}: {exc}"},
        ) from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(obj).__name__}, not a state_dict (a mapping of names to tensors).",
            detail={**detail, "reason": "not_a_state_dict", "type": type(obj).__name__},
        )
    non_tensor = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
    if non_tensor:
        raise CheckpointError(
            f"{path} is not a plain state_dict: {len(non_tensor)} entries are not tensors, "
            f"e.g. {_first(non_tensor)} (a training checkpoint? save model.state_dict() instead).",
            detail={
                **detail,
                "reason": "not_a_state_dict",
                "non_tensor_keys": _first(non_tensor),
                "non_tensor_count": len(non_tensor),
            },
        )
    sd = {str(k): v for k, v in obj.items()}
    if sd and all(k.startswith("module.") for k in sd):
        log.warning("%s: stripping the leading 'module.' (DataParallel) prefix from all %d keys", path, len(sd))
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return sd


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], *, source: str = "state_dict") -> None:
    """Raise :class:`CheckpointError` unless ``state_dict`` has exactly ``model``'s keys and shapes.

    The message and ``detail`` name the first 10 missing, unexpected and mis-shaped keys with the count
    of each.
    """
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {_first(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {_first(unexpected)})")
    if shapes:
        parts.append(f"{len(shapes)} mis-shaped (e.g. {_first(shapes)})")
    raise CheckpointError(
        f"{source} does not match {type(model).__name__}: " + "; ".join(parts),
        detail={
            "source": source,
            "missing": _first(missing),
            "missing_count": len(missing),
            "unexpected": _first(unexpected),
            "unexpected_count": len(unexpected),
            "mismatched_shapes": _first(shapes),
            "mismatched_count": len(shapes),
        },
    )


def load_rts_checkpoint(path: Path) -> IRSE64RTS:
    """Build :class:`IRSE64RTS` from ModelScope's ``pytorch_model.pt`` and load it strictly.

    ``alpha`` is read from ``logvar_rts_plus_backbone.0.weight``'s first dimension (else
    :data:`DEFAULT_ALPHA`, and the key is then reported missing). A leading ``module.`` prefix on
    every key is tolerated and logged. Returns the model on CPU, fp32, eval mode.

    Raises:
        CheckpointError: the file is missing, unreadable, TorchScript, not a plain state_dict, or its
            keys/shapes differ from the architecture (the message names the keys).
    """
    path = Path(path)
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


__all__ = [
    "DEFAULT_ALPHA",
    "IRSE64RTS",
    "IRSE64_UNITS",
    "IRSE64_WIDTHS",
    "BottleneckIRSE",
    "SEModule",
    "Subsample",
    "check_state_dict",
    "load_rts_checkpoint",
    "tiny_irse",
]
