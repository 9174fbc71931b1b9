"""Export a recognizer to a dynamic-batch ONNX file: ``crops (N, 112, 112, 3) uint8`` RGB → ``embedding (N, D)``
(L2-normalised), ``quality (N,)`` in [0, 1] and ``raw (N,)``, checked with ONNX Runtime at another batch size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from facegate.models.onnx_backend import trace_onnx


def export_onnx(recognizer: torch.nn.Module, out: Path, *, opset: int = 17, verify: bool = True) -> dict[str, Any]:
    """Write ``recognizer`` to ``out`` with a dynamic batch axis; returns a report with the parity numbers.
    ModelError when the export or the ONNX Runtime check fails."""
    recognizer = recognizer.eval().float().cpu()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randint(0, 256, (2, 112, 112, 3), dtype=torch.uint8)
    axes = {n: {0: "batch"} for n in ("crops", "embedding", "quality", "raw")}
    trace_onnx(recognizer, x, str(out), (["crops"], ["embedding", "quality", "raw"]), axes, opset)
    report: dict[str, Any] = {"out": str(out), "opset": opset, "bytes": out.stat().st_size}
    if not verify:
        return report
    import onnxruntime as ort

    # ONNX Runtime and PyTorch on the same random crops, at another batch size than the export's
    batch = 5
    x = torch.randint(0, 256, (batch, 112, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    emb_o, q_o, raw_o = sess.run(None, {"crops": x.numpy()})
    with torch.inference_mode():
        emb, q, raw = (t.numpy() for t in recognizer(x))
    return report | {
        "verify_batch": batch,
        "embedding_cosine_min": float(np.min(np.sum(emb_o * emb, axis=1))),
        "embedding_max_abs_diff": float(np.max(np.abs(emb_o - emb))),
        "quality_max_abs_diff": float(np.max(np.abs(q_o - q))),
        "raw_max_rel_diff": float(np.max(np.abs(raw_o - raw) / np.maximum(np.abs(raw), 1e-12))),
    }
