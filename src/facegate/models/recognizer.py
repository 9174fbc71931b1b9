"""The Recognizer: aligned uint8 crops → L2-normalised embedding + calibrated quality, in torch ops with no host sync.
Quality sources: ``"feature_norm"``, the raw embedding's L2 norm (direction +1); ``"rts_head"``, ``σ² = exp(logvar)``
of a trained :class:`~facegate.models.quality.RTSQualityHead` (−1); ``"logvar"``, IR-SE-64-RTS's own head (−1, not
verified on real RTS weights). Without a fitted calibration, a provisional logistic map from the final BatchNorm
puts a typical training face near 0.5: ``sigmoid(−(logvar − β)/|γ|)``, or ``sigmoid(4 · (log‖e‖ − log c))`` with
``c = sqrt(Σ β_i² + γ_i²)``.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import InvalidParameterError, ModelError, WeightsNotFoundError
from facegate.models.chunked import ActivationPlan, run_trunk
from facegate.models.irse import IRSE64RTS, load_rts_checkpoint, tiny_irse
from facegate.models.quality import (
    QualityCalibration,
    RTSQualityHead,
    bn_logvar_calibration,
    load_head,
    sface_head_input,
)
from facegate.models.registry import ModelSpec, QualitySource

log = logging.getLogger(__name__)

#: Slope of the provisional feature-norm map on the log scale (arbitrary).
_FEATURE_NORM_SLOPE = 4.0
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32/float16/bfloat16`` or ``"fp32"/"fp16"/"bf16"`` → a torch dtype."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InvalidParameterError(f"unknown precision {dtype!r}; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise InvalidParameterError(f"unsupported model dtype {dtype}; use float32, float16 or bfloat16")
    return dtype


class Recognizer(nn.Module):
    """Backbone (an :class:`IRSE64RTS` or :class:`~facegate.models.sface.SFace`: ``stages()``, ``heads``) +
    quality source (:func:`build_recognizer` checks that it fits the backbone) + calibration + input normalisation."""

    def __init__(
        self,
        spec: ModelSpec,
        backbone: nn.Module,
        *,
        quality_source: QualitySource,
        calibration: QualityCalibration,
        quality_head: RTSQualityHead | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.backbone = backbone
        self.quality_source: QualitySource = quality_source
        self.calibration = calibration
        self.quality_head = quality_head
        self.channels_last = bool(channels_last)
        #: also embed the mirrored crop and sum
        self.flip_tta = False
        self._is_irse = isinstance(backbone, IRSE64RTS)
        dim = int(backbone.embedding_dim)
        if dim != spec.embedding_dim:
            raise ModelError(
                f"backbone embedding_dim {dim} differs from spec {spec.name!r} embedding_dim {spec.embedding_dim}",
                detail={"backbone": dim, "spec": spec.embedding_dim},
            )
        self.register_buffer("mean", torch.tensor(spec.mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(spec.std, dtype=torch.float32).view(1, 3, 1, 1))
        #: how the trunk splits into sub-batches under :meth:`set_activation_budget`
        self.activation_plan: ActivationPlan | None = None
        #: the trunk in order (a plain list: not registered as submodules again; fuse() folds inside them)
        self._stages: list[nn.Module] = list(backbone.stages())

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    def preprocess(self, crops: Tensor) -> Tensor:
        """``(N, H, W, 3) uint8`` RGB → normalised ``(N, 3, H, W)`` input in the backbone's (compute) dtype."""
        h, w = self.spec.input_size
        if crops.dtype != torch.uint8 or crops.ndim != 4 or tuple(crops.shape[1:]) != (h, w, 3):
            raise InvalidParameterError(
                f"uint8 crops must be (N, {h}, {w}, 3) RGB, got {tuple(crops.shape)} {crops.dtype}",
                detail={"shape": list(crops.shape)},
            )
        x = crops.permute(0, 3, 1, 2).float()
        if self.spec.colour == "BGR":  # crops arrive RGB
            x = x.flip(1)
        x = ((x - self.mean.float()) / self.std.float()).to(next(self.backbone.parameters()).dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        elif x.is_cuda:
            # the permuted crops are NHWC-strided: cuDNN would plan NHWC kernels, for seconds
            x = x.contiguous()
        return x

    def _input(self, crops: Tensor) -> Tensor:
        x = self.preprocess(crops)
        return torch.cat([x, x.flip(3)]) if self.flip_tta else x

    def set_activation_budget(self, mib: float | None) -> ActivationPlan | None:
        """Bound the trunk's activations to about ``mib`` MiB (``None``: no bound) with sub-batches
        (:mod:`facegate.models.chunked`); after moving the model, before capturing graphs."""
        if mib is None:
            self.activation_plan = None
            return None
        h, w = self.spec.input_size
        with torch.inference_mode():
            probe = self._input(torch.zeros((1, h, w, 3), dtype=torch.uint8, device=self.device))[:1]
            self.activation_plan = ActivationPlan.measure(self._stages, probe, mib * 2**20)
        peaks, (split, chunk) = list(self.activation_plan.stage_peak), self.activation_plan.split(64)
        log.info("activation budget %.0f MiB (stage peaks %s): 64 crops run %d stages by %d", mib, peaks, split, chunk)
        return self.activation_plan

    def forward(self, crops: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``crops (N, 112, 112, 3) uint8`` RGB on the model's device →
        ``(embedding (N, D) float32 L2-normalised, quality (N,) float32 in [0, 1], raw (N,) float32)``."""
        n = crops.shape[0]
        feats = run_trunk(self._stages, self.activation_plan, n, lambda a, b: self._input(crops[a:b]))
        heads = self.backbone.heads(feats)  # IR-SE: (embedding, logvar); SFace: the embedding
        emb_raw, logvar = heads if self._is_irse else (heads, None)
        emb_sum = emb_raw[:n] + emb_raw[n:] if self.flip_tta else emb_raw  # the mirrored rows follow the crops
        emb_raw, feats = emb_raw[:n].float(), feats[:n]
        if self.quality_source == "feature_norm":
            raw = torch.linalg.vector_norm(emb_raw, dim=1)
        elif self.quality_source == "logvar":
            assert logvar is not None
            raw = torch.exp(logvar[:n].float()).reshape(-1)
        else:
            assert self.quality_head is not None
            head_in = feats if self._is_irse else sface_head_input(emb_raw, feats.float(), feats.shape[1] // 49)
            raw = torch.exp(self.quality_head(head_in.float()).float()).reshape(-1)
        return F.normalize(emb_sum.float(), dim=1), self.calibration(raw), raw


def _build_backbone(spec: ModelSpec, checkpoint: Path | None) -> nn.Module:
    random = spec.weights.kind == "random"
    if spec.arch == "irse64_rts":
        if random:
            return tiny_irse(seed=0)
        if checkpoint is None:  # explicit only: never pick up a stray pytorch_model.pt from the cwd
            raise WeightsNotFoundError(
                "Model 'irse64_rts' needs ModelScope's RTS state_dict (damo/cv_ir_face-recognition-ood_rts "
                "pytorch_model.pt); pass its path (FACEGATE_RTS_CHECKPOINT / --rts-checkpoint).",
                detail={"model": spec.name},
            )
        return load_rts_checkpoint(checkpoint)
    if spec.arch == "sface":
        from facegate.models.sface import load_sface, tiny_sface

        if random:
            return tiny_sface(seed=0)
        return load_sface(checkpoint)
    raise InvalidParameterError(f"unknown arch {spec.arch!r} in model spec {spec.name!r}")


def build_recognizer(
    spec: ModelSpec,
    *,
    checkpoint: Path | None = None,
    quality_head: Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    channels_last: bool = False,
) -> Recognizer:
    """The :class:`Recognizer` of a spec (``weights.kind == "random"``: the tiny model), eval, no gradients.
    ``checkpoint``: the RTS state_dict (required for ``irse64_rts``) or an SFace ONNX file; ``quality_head``: a head
    file (source ``"rts_head"``); ``dtype``: the compute dtype (outputs are fp32). Raises
    :class:`WeightsNotFoundError`, or :class:`CheckpointError` / :class:`QualityHeadError` / :class:`ModelError`."""
    dt = resolve_dtype(dtype)
    source: QualitySource = spec.quality_source
    head_path = quality_head
    if head_path is not None:
        if source != "rts_head":
            log.info("quality head %s given: quality source %r -> 'rts_head'", head_path, source)
        source = "rts_head"
    elif source == "rts_head" and spec.quality_head:
        head_path = Path(str(resources.files("facegate").joinpath(spec.quality_head)))  # package-relative
    # fail fast, before loading any weights
    if source == "rts_head" and head_path is None and spec.weights.kind != "random":
        raise WeightsNotFoundError(
            f"model {spec.name!r} uses quality source 'rts_head' but no head file was given "
            "(FACEGATE_QUALITY_HEAD / --quality-head)",
            detail={"model": spec.name},
        )
    if source == "logvar" and spec.arch != "irse64_rts":
        raise ModelError(f"quality source 'logvar' needs arch 'irse64_rts', spec {spec.name!r} has {spec.arch!r}")

    backbone = _build_backbone(spec, checkpoint)
    head: RTSQualityHead | None = None
    if source == "rts_head":
        # the head reads IR-SE-64's features, or sface_head_input's pooled trunk and embedding
        fd = backbone.feature_dim
        if not isinstance(backbone, IRSE64RTS):
            fd = backbone.embedding_dim + fd // 49
        if head_path is not None:
            head, calibration, meta = load_head(head_path, backbone=spec.arch, feature_dim=fd)
            log.info("quality head %s (trained on %s)", head_path, meta.get("trained_on", "?"))
        else:  # random test weights: a seeded random head
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                head = RTSQualityHead(fd, backbone=spec.arch).eval()
            calibration = bn_logvar_calibration(head.bn, "rts_head, random test head")
    elif source == "logvar":
        assert isinstance(backbone, IRSE64RTS)
        calibration = bn_logvar_calibration(backbone.logvar_rts_backbone[1], "logvar")
    elif spec.quality_calibration is not None and spec.weights.kind != "random":
        calibration = QualityCalibration.from_dict(spec.quality_calibration)  # fitted, from the registry
    else:  # centred at the embedding BatchNorm's norm (not fused yet): IR-SE features_backbone.1, SFace fc1
        bn = backbone.features_backbone[1] if isinstance(backbone, IRSE64RTS) else backbone.fc1
        c2 = float((bn.bias.detach().double() ** 2 + bn.weight.detach().double() ** 2).sum())
        b = -_FEATURE_NORM_SLOPE * 0.5 * math.log(c2)
        note = "provisional (feature_norm): centred at the embedding BatchNorm's norm"
        calibration = QualityCalibration(
            "logistic", direction=1, transform="log", a=_FEATURE_NORM_SLOPE, b=b, note=note
        )
    if not calibration.fitted:
        log.warning("model %r: quality calibration is provisional (%s)", spec.name, calibration.note)

    rec = Recognizer(
        spec, backbone, quality_source=source, calibration=calibration, quality_head=head, channels_last=channels_last
    )
    # cast on the host, then move (the device allocator would keep the peak of both copies); the head stays fp32
    rec.backbone.to(dtype=dt, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return rec.to(device=device).eval().requires_grad_(False)


def frozen_cpu(rec: Recognizer, dtype: torch.dtype | str = "fp32", *, atol: float = 1e-4) -> torch.jit.ScriptModule:
    """The fp32 CPU ``rec`` (BatchNorms folded in place, then its backbone cast to ``dtype``; no activation budget) as
    one frozen TorchScript graph: a forward is one call, releasing the GIL for all of it, so forwards on several
    threads run at once. Traced at batch 2, checked at batch 3 against ``rec`` before folding: :class:`ModelError`
    past ``atol`` (relative for ``raw``), or in bf16 an embedding cosine below 0.99 (LFW: benchmarks/parity_lfw.py)."""
    x = torch.randint(
        0, 256, (3, *rec.spec.input_size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    t0 = time.perf_counter()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the input checks are Python; callers check first
        # torch.jit is deprecated for torch.compile, which on the CPU needs a C++ toolchain and compiles at each start;
        # the frozen graph embeds more faces/s per thread than the eager module (benchmarks/cpu_models.py)
        warnings.simplefilter("ignore", DeprecationWarning)
        ref = rec(x)
        rec.backbone.fuse().to(resolve_dtype(dtype))
        graph = torch.jit.freeze(torch.jit.trace(rec, x[:2], check_trace=False))
        got = graph(x)
        diff = max(float((got[i] - ref[i]).abs().max()) for i in (0, 1))
        diff = max(diff, float(((got[2] - ref[2]).abs() / ref[2].abs().clamp_min(1e-12)).max()))
        if resolve_dtype(dtype) != torch.float32:
            diff, atol = 1.0 - float((got[0] * ref[0]).sum(1).min()), 0.01
    if not diff <= atol:
        raise ModelError(f"the traced recognizer differs from the module by {diff:.3g}", detail={"max_abs_diff": diff})
    log.info("recognizer: frozen %s TorchScript graph (%.2f s; parity %.1e)", dtype, time.perf_counter() - t0, diff)
    return graph
