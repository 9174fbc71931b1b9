"""ONNX Runtime as the CPU execution of facegate's own YuNet module (PyTorch stays the reference), and the
recognizer's ONNX export (:func:`export_onnx`). YuNet is ~100 tiny convolutions, where ORT's planned graph beats eager
dispatch; the graph is exported in memory from the loaded module at start-up and checked against it before it serves.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from facegate.errors import ModelError
from facegate.models.yunet import STRIDES, RawOutputs, flat_outputs

if TYPE_CHECKING:
    from facegate.models.detector import FaceDetector

log = logging.getLogger(__name__)

#: Largest |ONNX Runtime − PyTorch| on the parity input (outputs of scale 0..1 and a few units; fp32 noise ~1e-5).
PARITY_MAX_ABS_DIFF = 1e-3
OPSET = 17
#: The graph's outputs, over the anchors ``A`` of all levels in :func:`~facegate.models.yunet.decode_yunet`'s order:
#: ``scores (N, A)`` (:func:`~facegate.models.yunet.flat_outputs`); ``heads (N, A, 16)``: bbox 4, kps 10, then the
#: cls and obj logits; ``probs (N, A, 2)``: cls and obj probabilities. Nothing per level: ORT runs every node of
#: the graph on every call, whichever outputs are fetched, and the levels are views of these on the host.
_OUTPUTS = ["scores", "heads", "probs"]
_HEAD_CH = 16


def ort_session(model: bytes, threads: int) -> Any:
    """A CPU ``InferenceSession`` (sequential, all graph optimisations: ORT's defaults) with ``threads`` intra-op
    threads, none inter-op (the graphs are chains), and no spinning after a run (other threads need the cores)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def trace_onnx(
    module: nn.Module,
    x: Tensor,
    out: Any,
    names: tuple[list[str], list[str]],
    axes: dict[str, dict[int, str]],
    opset: int,
) -> None:
    """``torch.onnx.export`` of ``module(x)`` to ``out`` by the legacy tracer, ``names``: ``(inputs, outputs)``;
    :class:`ModelError` when it fails."""
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # the tracer warns about the shape checks it constant-folds
            torch.onnx.export(
                module,
                (x,),
                out,
                input_names=names[0],
                output_names=names[1],
                dynamic_axes=axes,
                opset_version=opset,
                dynamo=False,
            )
    except Exception as exc:  # the exporter raises many kinds; one error type for the caller
        raise ModelError(f"ONNX export of {type(module).__name__} failed: {type(exc).__name__}: {exc}") from exc


def export_onnx(recognizer: nn.Module, out: Path, *, opset: int = OPSET) -> dict[str, Any]:
    """Write ``recognizer`` to ``out`` as a dynamic-batch ONNX file: ``crops (N, 112, 112, 3) uint8`` RGB →
    ``embedding (N, D)`` (L2-normalised), ``quality (N,)`` in [0, 1] and ``raw (N,)``. Returns a report with the
    parity numbers of ONNX Runtime against PyTorch at another batch size; :class:`ModelError` when the
    export fails."""
    recognizer = recognizer.eval().float().cpu()
    out.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randint(0, 256, (2, 112, 112, 3), dtype=torch.uint8)
    axes = {n: {0: "batch"} for n in ("crops", "embedding", "quality", "raw")}
    trace_onnx(recognizer, x, str(out), (["crops"], ["embedding", "quality", "raw"]), axes, opset)
    report: dict[str, Any] = {"out": str(out), "opset": opset, "bytes": out.stat().st_size}
    batch = 5
    x = torch.randint(0, 256, (batch, 112, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    emb_o, q_o, raw_o = ort_session(out.read_bytes(), torch.get_num_threads()).run(None, {"crops": x.numpy()})
    with torch.inference_mode():
        emb, q, raw = (t.numpy() for t in recognizer(x))
    return report | {
        "verify_batch": batch,
        "embedding_cosine_min": float(np.min(np.sum(emb_o * emb, axis=1))),
        "embedding_max_abs_diff": float(np.max(np.abs(emb_o - emb))),
        "quality_max_abs_diff": float(np.max(np.abs(q_o - q))),
        "raw_max_rel_diff": float(np.max(np.abs(raw_o - raw) / np.maximum(np.abs(raw), 1e-12))),
    }


def export_yunet_onnx(model: nn.Module) -> bytes:
    """The serialised ONNX graph of an fp32 copy of a YuNet module on ``images (N, H, W, 3) uint8`` RGB (symbolic
    N/H/W; the cast is in the graph, the BGR flip in the stem's weights), the heads merged per level
    (:class:`_MergedHeadLevel`). Outputs :data:`_OUTPUTS`, float32; :class:`ModelError` when the export fails."""
    ref = _host_fp32_copy(model)
    stem = ref.backbone.model0.conv1
    stem.weight.data = stem.weight.data.flip(1)  # RGB input: the BGR flip in the weights, not on the image
    x = torch.zeros((1, 64, 64, 3), dtype=torch.uint8)
    axes = {"images": {0: "N", 1: "H", 2: "W"}, **{name: {0: "N", 1: "A"} for name in _OUTPUTS}}
    buf = io.BytesIO()
    trace_onnx(_HostBatchYuNet(ref), x, buf, (["images"], _OUTPUTS), axes, OPSET)
    return buf.getvalue()


class _FlattenRows(torch.autograd.Function):
    """``(N, h, w, 16)`` → ``(N, h·w, 16)``, exported as one Reshape by the constant ``[0, -1, 16]`` (0: keep the batch
    dimension) instead of the shape arithmetic the tracer builds for symbolic ``h, w`` (run on every call)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.flatten(1, 2)

    @staticmethod
    def symbolic(g: Any, x: Any) -> Any:
        return g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([0, -1, _HEAD_CH])))


class _MergedHeadLevel(nn.Module):
    """One level's four prediction branches as one 1×1 conv and one depthwise conv of ``16`` channels (bbox 4,
    kps 10, cls 1, obj 1): each output channel is computed as in its own branch (a 1×1 conv is per output channel,
    a depthwise conv per channel), in one pass over the feature map instead of four. ``(N, 64, h, w)`` →
    ``(N, h·w, 16)``."""

    def __init__(self, branches: list[nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(branches[0].conv1.in_channels, _HEAD_CH, 1, bias=True)
        self.conv2 = nn.Conv2d(_HEAD_CH, _HEAD_CH, 3, 1, 1, bias=True, groups=_HEAD_CH)
        for name in ("weight", "bias"):
            for merged, part in ((self.conv1, "conv1"), (self.conv2, "conv2")):
                getattr(merged, name).data = torch.cat([getattr(getattr(b, part), name).data for b in branches])

    def forward(self, feat: Tensor) -> Tensor:
        return _FlattenRows.apply(self.conv2(self.conv1(feat)).permute(0, 2, 3, 1))


class _HostBatchYuNet(nn.Module):
    """The module :func:`export_yunet_onnx` traces: ``images (N, H, W, 3) uint8`` RGB → :data:`_OUTPUTS`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        head = model.bbox_head
        branches = (head.multi_level_bbox, head.multi_level_kps, head.multi_level_cls, head.multi_level_obj)
        self.levels = nn.ModuleList([_MergedHeadLevel([b[i] for b in branches]) for i in range(len(STRIDES))])

    def forward(self, images: Tensor) -> tuple[Tensor, ...]:
        # contiguous: a permuted NHWC batch would trace YuNet's channels-last path (matmuls between transposes)
        x = images.permute(0, 3, 1, 2).to(torch.float32).contiguous()
        feats = self.model.neck(self.model.backbone(x))
        heads = torch.cat([m(f) for m, f in zip(self.levels, feats, strict=True)], 1)
        probs = heads[..., 14:16].sigmoid()
        # one ReduceProd of the pair, not two gathers and a Mul (the product of two is the same rounding)
        return torch.sqrt(probs.clamp(0, 1).prod(-1)), heads, probs


def _host_fp32_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).to(device="cpu", dtype=torch.float32, memory_format=torch.contiguous_format)
    return ref.eval().requires_grad_(False)


def parity_input(height: int = 256, width: int = 256, seed: int = 0) -> np.ndarray:
    """A fixed ``(1, height, width, 3) uint8`` RGB batch: blobs plus noise (activations leave their saturation)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        for _ in range(6):
            cy, cx = rng.uniform(0, height), rng.uniform(0, width)
            r = rng.uniform(8, 48)
            img[..., c] += rng.uniform(60, 200) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    img += rng.normal(0, 12, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).round().astype(np.uint8)[None]


def yunet_parity(model: nn.Module, session: Any, images: np.ndarray | None = None) -> float:
    """Max |ORT − PyTorch| over every output on ``images (N, H, W, 3) uint8`` RGB (default :func:`parity_input`)."""
    images = parity_input() if images is None else images
    ref = _host_fp32_copy(model)
    with torch.inference_mode():  # the detector's own input conversion: BGR, float32 NCHW
        x = torch.from_numpy(images).permute(0, 3, 1, 2).flip(1).to(torch.float32)
        raw = ref(x)
        scores, bbox, kps = flat_outputs(raw)
        cls, obj = (torch.cat(list(group), 1) for group in raw[:2])
        expected = [t.numpy() for t in (scores, torch.cat([bbox, kps], -1), torch.cat([cls, obj], -1))]
    got = session.run(_OUTPUTS, {"images": images})
    got[1] = got[1][..., :14]  # heads without its logits
    return max(float(np.max(np.abs(e - g))) for e, g in zip(expected, got, strict=True))


@dataclasses.dataclass
class OrtYuNet:
    """YuNet run by ONNX Runtime: ``(N, H, W, 3) uint8`` RGB host tensor → :data:`~facegate.models.yunet.RawOutputs`
    of float32 host tensors. ``torch_model``: the module it was exported from."""

    session: Any
    torch_model: nn.Module

    def __call__(self, images: Tensor) -> RawOutputs:
        _, heads, probs = self.session.run(_OUTPUTS, {"images": np.ascontiguousarray(images.numpy())})
        h, w = images.shape[1:3]
        sizes = [(h // s) * (w // s) for s in STRIDES]
        levels = [
            torch.from_numpy(np.ascontiguousarray(t)).split(sizes, 1)
            for t in (probs[..., 0:1], probs[..., 1:2], heads[..., 0:4], heads[..., 4:14])
        ]
        return tuple(list(group) for group in levels)  # type: ignore[return-value]

    def flat(self, images: np.ndarray) -> list[np.ndarray]:
        """:func:`~facegate.models.yunet.flat_outputs` of a ``(N, H, W, 3) uint8`` RGB batch, as host arrays."""
        scores, heads = self.session.run(_OUTPUTS[:2], {"images": images})
        return [scores, heads[..., :4], heads[..., 4:14]]


def attach_onnx_detector(detector: FaceDetector, *, threads: int | None = None) -> OrtYuNet:
    """Run an fp32 CPU ``detector``'s network with ONNX Runtime (``threads``, default torch's): export, check
    parity, swap in place. :class:`ModelError` on a failed export or past :data:`PARITY_MAX_ABS_DIFF`."""
    if detector.device.type != "cpu" or detector.dtype is not torch.float32:
        raise ModelError(f"the ONNX detector runs fp32 on the CPU, not {detector.dtype} on {detector.device}")
    t0 = time.perf_counter()
    torch_model = detector.model if not isinstance(detector.model, OrtYuNet) else detector.model.torch_model
    n_threads = int(threads) if threads else torch.get_num_threads()
    session = ort_session(export_yunet_onnx(torch_model), n_threads)
    diff = yunet_parity(torch_model, session)
    if not diff <= PARITY_MAX_ABS_DIFF:
        raise ModelError(
            f"the ONNX export of YuNet differs from PyTorch by {diff:.3g} (allowed {PARITY_MAX_ABS_DIFF})",
            detail={"max_abs_diff": diff},
        )
    ort_model = OrtYuNet(session, torch_model)
    detector.model = ort_model  # type: ignore[assignment]
    detector.channels_last = False
    log.info(
        "detector: ONNX Runtime on the CPU (%d thread(s); export + parity check %.2f s, max abs diff %.1e)",
        n_threads,
        time.perf_counter() - t0,
        diff,
    )
    return ort_model
