"""ONNX Runtime as the CPU execution of facegate's own modules (PyTorch stays the reference).

On the CPU, ONNX Runtime runs YuNet several times faster than PyTorch eager on the same weights
(``benchmarks/cpu_models.py``): the network is ~100 tiny convolutions, whose per-op dispatch PyTorch pays in
Python and ATen, while ORT runs one pre-planned graph with fused conv + activation kernels. The graph is not
a shipped file: it is exported at start-up, in memory, from the loaded :class:`~facegate.models.yunet.YuNet`
module, so it carries exactly the weights (and any fold) PyTorch runs. Before it serves, it is checked
against the PyTorch module on a fixed input; a mismatch fails the start-up rather than serve other numbers.

:func:`attach_onnx_detector` swaps a CPU :class:`~facegate.models.detector.FaceDetector`'s network for an
:class:`OrtYuNet`; everything around the network (preprocessing, decoding, NMS) is unchanged.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from facegate.errors import ModelError
from facegate.models.yunet import STRIDES, RawOutputs

if TYPE_CHECKING:
    from facegate.models.detector import FaceDetector

log = logging.getLogger(__name__)

__all__ = [
    "OrtYuNet",
    "attach_onnx_detector",
    "export_yunet_onnx",
    "onnxruntime_available",
    "ort_session",
    "yunet_parity",
]

#: Largest |ONNX Runtime − PyTorch| allowed on the parity input, on outputs whose scale is 0..1 (scores) and
#: a few units (regression offsets); float32 reassociation differences are ~1e-5.
PARITY_MAX_ABS_DIFF = 1e-3
#: opset of the exported graphs (ONNX Runtime ≥ 1.18 runs it; nothing in YuNet needs a newer one)
OPSET = 17
_HEADS = ("cls", "obj", "bbox", "kps")
_OUTPUTS = [f"{h}_{s}" for h in _HEADS for s in STRIDES]


def onnxruntime_available() -> bool:
    """Whether ``onnxruntime`` can be imported (without importing it)."""
    return importlib.util.find_spec("onnxruntime") is not None


def ort_session(model: bytes, threads: int) -> Any:
    """A CPU ``onnxruntime.InferenceSession`` on a serialised model with ``threads`` intra-op threads.

    Inter-op parallelism is off (the graphs are chains) and worker threads do not spin after a run: in a
    serving process the HTTP, decode and alignment threads need the cores between forwards.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def export_yunet_onnx(model: nn.Module, *, opset: int = OPSET) -> bytes:
    """The ONNX graph of a YuNet module behind the detector's input conversion, serialised.

    Input ``images (N, H, W, 3) uint8`` RGB (a :class:`~facegate.models.detector.DetBatch`'s canvas) with
    symbolic N/H/W; the graph transposes it to NCHW, flips it to BGR and casts it to float32, as
    ``FaceDetector._to_input`` does, then runs the network. Outputs ``cls_8 … kps_32``: the module's
    :data:`~facegate.models.yunet.RawOutputs`, ``(N, H/s·W/s, C)`` float32. The conversion is in the graph
    because PyTorch's channel flip and cast of a 256×256 photo cost a third of ORT's whole forward.

    The module is exported as it is (fp32, on the host, NCHW: the channels-last 1×1 path is a PyTorch CPU
    speed trick that would only add transposes to the graph).

    Raises:
        ModelError: the export failed.
    """
    ref = _host_fp32_copy(model)
    x = torch.zeros((1, 64, 64, 3), dtype=torch.uint8)
    axes: dict[str, dict[int, str]] = {"images": {0: "N", 1: "H", 2: "W"}}
    axes.update({name: {0: "N", 1: f"A_{name}"} for name in _OUTPUTS})
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # the legacy tracer warns about the shape checks it constant-folds
            torch.onnx.export(
                _HostBatchYuNet(ref),
                (x,),
                buf,
                input_names=["images"],
                output_names=_OUTPUTS,
                dynamic_axes=axes,
                opset_version=opset,
                dynamo=False,
            )
    except Exception as exc:  # the exporter raises many kinds; one error type for the caller
        raise ModelError(f"YuNet ONNX export failed: {type(exc).__name__}: {exc}") from exc
    return buf.getvalue()


def _to_network_input(images: Tensor) -> Tensor:
    """``(N, H, W, 3) uint8`` RGB → ``(N, 3, H, W) float32`` BGR on 0..255 (``FaceDetector._to_input``)."""
    bgr = torch.tensor([2, 1, 0], device=images.device)
    return images.permute(0, 3, 1, 2).index_select(1, bgr).to(torch.float32)


class _HostBatchYuNet(nn.Module):
    """YuNet on the detector's uint8 RGB batch, its four lists of outputs flattened into one tuple (ONNX
    outputs are flat)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> tuple[Tensor, ...]:
        return tuple(t for group in self.model(_to_network_input(images)) for t in group)


def _host_fp32_copy(model: nn.Module) -> nn.Module:
    """An fp32 NCHW copy of ``model`` on the host, in eval mode (the original is left as it is)."""
    import copy

    ref = copy.deepcopy(model).to(device="cpu", dtype=torch.float32, memory_format=torch.contiguous_format)
    return ref.eval().requires_grad_(False)


def parity_input(height: int = 256, width: int = 256, seed: int = 0) -> np.ndarray:
    """A fixed detector batch ``(1, height, width, 3) uint8`` RGB: smooth blobs plus noise, so that every
    level's activations and the score sigmoids move away from their saturated ends."""
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
    """Max |ONNX Runtime − PyTorch| over every YuNet output on ``images`` (``(N, H, W, 3) uint8`` RGB, default
    :func:`parity_input`); PyTorch runs the module on the detector's own input conversion."""
    images = parity_input() if images is None else images
    ref = _host_fp32_copy(model)
    with torch.inference_mode():
        expected = [t.numpy() for group in ref(_to_network_input(torch.from_numpy(images))) for t in group]
    got = session.run(_OUTPUTS, {"images": images})
    return max(float(np.max(np.abs(e - g))) for e, g in zip(expected, got, strict=True))


class OrtYuNet:
    """A YuNet forward run by ONNX Runtime on the detector's host batch: ``(N, H, W, 3) uint8`` RGB (a host
    tensor) → :data:`~facegate.models.yunet.RawOutputs` of ``(N, A, C)`` float32 host tensors that share ORT's
    output buffers. :attr:`takes_host_batch` tells :meth:`FaceDetector.forward` to skip its own conversion.

    ``torch_model`` is the PyTorch module the graph was exported from (the reference; kept for inspection).
    """

    takes_host_batch = True

    def __init__(self, session: Any, torch_model: nn.Module, *, threads: int) -> None:
        self.session = session
        self.torch_model = torch_model
        self.threads = threads

    def __call__(self, images: Tensor) -> RawOutputs:
        arr = np.ascontiguousarray(images.detach().numpy())
        outs = [torch.from_numpy(o) for o in self.session.run(_OUTPUTS, {"images": arr})]
        k = len(STRIDES)
        return outs[0:k], outs[k : 2 * k], outs[2 * k : 3 * k], outs[3 * k : 4 * k]

    def eval(self) -> OrtYuNet:
        """No-op (the graph is inference-only), for callers that treat the network as a module."""
        return self


def attach_onnx_detector(detector: FaceDetector, *, threads: int | None = None) -> OrtYuNet:
    """Run ``detector``'s network with ONNX Runtime: export its YuNet, check parity, swap it in place.

    ``detector`` must be a fp32 CPU detector. ``threads``: ORT intra-op threads (default: torch's current
    intra-op count, which :func:`~facegate.pipeline.pipeline.configure_cpu_threads` set). The detector's input
    conversion moves into the graph (its channels-last layout only served PyTorch's kernels).

    Raises:
        ModelError: onnxruntime is missing, the export failed, or the graph's outputs differ from PyTorch's by
            more than :data:`PARITY_MAX_ABS_DIFF` on the parity input.
    """
    if detector.device.type != "cpu" or detector.dtype is not torch.float32:
        raise ModelError(f"the ONNX detector runs fp32 on the CPU, not {detector.dtype} on {detector.device}")
    if not onnxruntime_available():
        raise ModelError("the ONNX Runtime CPU backend needs onnxruntime (pip install onnxruntime)")
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
    ort_model = OrtYuNet(session, torch_model, threads=n_threads)
    detector.model = ort_model  # type: ignore[assignment]
    detector.channels_last = False
    log.info(
        "detector: ONNX Runtime on the CPU (%d thread(s); export + parity check %.2f s, max abs diff %.1e)",
        n_threads,
        time.perf_counter() - t0,
        diff,
    )
    return ort_model
