"""CUDA graphs: :class:`GraphedModule` (one per batch bucket) and :func:`capture_graph` / :func:`replay` /
:func:`replay_lock`, which every graph of the process goes through. All captures share **one** side stream per
device (PyTorch keeps a cuBLAS workspace per stream that ran a GEMM) and **one** memory pool per device. Sharing the
pool needs every replay on the default stream (:func:`replay` checks) and no other replay between a graph's copy-in
and copy-out (a later capture may keep its outputs where an earlier one kept intermediates): :func:`replay_lock`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from facegate.errors import EngineError

log = logging.getLogger(__name__)

#: Inductor options of ``compile=inductor`` on top of ``max-autotune-no-cudagraphs``: weights as constants, and
#: pointwise convs as matmuls that absorb bias and PReLU.
INDUCTOR_SERVING_OPTIONS: dict[str, Any] = {"freezing": True, "conv_1x1_as_mm": True}

#: One record per capture (the latest 256): its seconds and the pool's size after it (``benchmarks/serve_memory.py``).
capture_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

_shared_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}
_pools: dict[int, Any] = {}
_replay_locks: dict[int, threading.RLock] = {}


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def replay_lock(device: torch.device) -> threading.RLock:
    """The re-entrant lock every user of ``device``'s graph pool holds from copy-in to copy-out."""
    dev = device_index(device) if device.type == "cuda" else -1
    with _shared_lock:
        return _replay_locks.setdefault(dev, threading.RLock())


def capture_graph(
    fn: Callable[[Tensor], Any], static_in: Tensor, *, warmup: int = 2
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, outputs)`` of ``fn(static_in)`` captured in the shared pool after ``warmup`` eager runs, on the side
    stream with ``capture_error_mode="thread_local"`` (serving threads keep working); serialised process-wide."""
    dev = device_index(static_in.device)
    with _shared_lock:
        side = _side_streams.get(dev)
        if side is None:  # one per device, made once (setdefault would construct a stream at every capture)
            side = _side_streams[dev] = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        runs: list[float] = []
        with torch.cuda.stream(side):
            for _ in range(warmup):
                t0 = time.perf_counter()
                fn(static_in)
                side.synchronize()
                runs.append(time.perf_counter() - t0)
        torch.cuda.current_stream(dev).wait_stream(side)
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=_pools.get(dev), stream=side, capture_error_mode="thread_local"):
            out = fn(static_in)
        _pools[dev] = g.pool()
        torch.cuda.synchronize(dev)
        capture_records.append(
            {
                "shape": list(static_in.shape),
                "first_run_s": round(runs[0], 4) if runs else None,
                "other_runs_s": round(sum(runs[1:]), 4),
                "capture_s": round(time.perf_counter() - t0, 4),
                "reserved_mib": round(torch.cuda.memory_reserved(dev) / 2**20, 1),
            }
        )
    return g, out


def replay(graph: torch.cuda.CUDAGraph) -> None:
    """Replay ``graph``; :class:`EngineError` off the default stream (it could overlap another graph of the pool)."""
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        raise EngineError("CUDA graphs must be replayed on the default stream (they share one memory pool)")
    graph.replay()


class GraphedModule(nn.Module):
    """``module(x)`` (``x (N, *item_shape)`` of ``dtype`` → a tuple of tensors, first dim N) through one CUDA graph per
    bucket: padded, copied in, replayed, the real rows cloned out; eager on the CPU or past the largest bucket.
    ``compile_mode``: ``None`` or a ``torch.compile`` mode, plus ``compile_options``."""

    def __init__(
        self,
        module: nn.Module,
        item_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        buckets: Sequence[int],
        compile_mode: str | None = None,
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.item_shape = tuple(item_shape)
        self.in_dtype = dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.compile_mode = compile_mode
        self._fn: Callable[[Tensor], Any] = module
        if compile_mode:  # torch.compile takes a mode or options, not both: spell the mode out
            opts = {**torch._inductor.list_mode_options(compile_mode), **(compile_options or {})}
            self._fn = torch.compile(module, options=opts, dynamic=False)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, tuple[Tensor, ...]]] = {}

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @torch.inference_mode()
    def capture(self) -> None:
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        for b in reversed(self.buckets):  # largest first, so smaller graphs fit in the memory it freed
            static_in = torch.zeros((b, *self.item_shape), dtype=self.in_dtype, device=self.device)
            g, outs = capture_graph(self._fn, static_in, warmup=3)
            self._graphs[b] = (g, static_in, tuple(outs))
        secs = time.perf_counter() - t0
        log.info("captured CUDA graphs for buckets %s (compile=%s) in %.1f s", self.buckets, self.compile_mode, secs)

    @torch.inference_mode()
    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        n = x.shape[0]
        b = next((b for b in self.buckets if b >= n), None)
        if b is None or b not in self._graphs:
            if n > self.buckets[-1] and self._graphs:
                parts = [self.forward(x[i : i + self.buckets[-1]]) for i in range(0, n, self.buckets[-1])]
                return tuple(torch.cat(p) for p in zip(*parts, strict=True))
            return self._fn(x)
        g, static_in, outs = self._graphs[b]
        with replay_lock(self.device):
            static_in[:n].copy_(x, non_blocking=True)
            if n < b:
                static_in[n:].zero_()
            replay(g)
            return tuple(o[:n].clone() for o in outs)
