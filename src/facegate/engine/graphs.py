"""Fixed-bucket CUDA-graph execution for a module with one batched input.

``GraphedModule`` pads each incoming batch up to the smallest configured bucket, copies it into a
static input buffer and replays a CUDA graph captured for that bucket; it returns views of the
static outputs sliced to the real batch size (cloned, so the next replay cannot overwrite them).
Buckets are captured once at warm-up, so the first real request does not pay for it. Optionally
the module is first compiled with ``torch.compile`` (Inductor kernels), and the graph is captured
over the compiled code; without compilation, the eager (cuDNN/cuBLAS) kernels are captured, which
costs well under a second per bucket.

On CPU, or for a batch larger than the largest bucket, the module runs eagerly (chunked by the
largest bucket), so results never depend on the path taken beyond floating-point tolerance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class GraphedModule(nn.Module):
    """Run ``module(x)`` through per-bucket CUDA graphs.

    Args:
        module: maps ``x (N, *item_shape)`` to a tensor or a tuple of tensors whose first dim is N.
        item_shape: shape of one item, e.g. ``(112, 112, 3)``.
        dtype: dtype of ``x`` (e.g. ``torch.uint8`` for crops).
        buckets: batch sizes to capture, ascending.
        compile_mode: ``None`` (capture eager kernels) or a ``torch.compile`` mode such as
            ``"max-autotune-no-cudagraphs"`` (compile first; slow start, faster kernels).
    """

    def __init__(
        self,
        module: nn.Module,
        item_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        compile_mode: str | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.item_shape = tuple(item_shape)
        self.in_dtype = dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.compile_mode = compile_mode
        self._fn = torch.compile(module, mode=compile_mode, dynamic=False) if compile_mode else module
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, tuple[Tensor, ...]]] = {}
        self._tuple_out = True
        self.capture_seconds: dict[int, float] = {}

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one CUDA graph per bucket (no-op on CPU)."""
        if self.device.type != "cuda":
            return
        pool = None
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            t0 = time.perf_counter()
            static_in = torch.zeros((b, *self.item_shape), dtype=self.in_dtype, device=self.device)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    out = self._fn(static_in)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._fn(static_in)
            pool = g.pool()
            self._tuple_out = isinstance(out, tuple)
            outs = out if isinstance(out, tuple) else (out,)
            self._graphs[b] = (g, static_in, outs)
            torch.cuda.synchronize()
            self.capture_seconds[b] = time.perf_counter() - t0
        log.info(
            "captured CUDA graphs for buckets %s (compile=%s) in %.1f s",
            self.buckets,
            self.compile_mode,
            sum(self.capture_seconds.values()),
        )

    @torch.inference_mode()
    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        n = x.shape[0]
        b = self._bucket(n)
        if b is None or b not in self._graphs:
            if n > self.buckets[-1] and self._graphs:
                parts = [self.forward(x[i : i + self.buckets[-1]]) for i in range(0, n, self.buckets[-1])]
                if isinstance(parts[0], tuple):
                    return tuple(torch.cat(p) for p in zip(*parts, strict=True))
                return torch.cat(parts)  # type: ignore[arg-type]
            return self._fn(x)
        g, static_in, outs = self._graphs[b]
        static_in[:n].copy_(x, non_blocking=True)
        if n < b:
            static_in[n:].zero_()
        g.replay()
        res = tuple(o[:n].clone() for o in outs)
        return res if self._tuple_out else res[0]
