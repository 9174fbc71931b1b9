"""Fixed-bucket CUDA-graph execution for a module with one batched input.

``GraphedModule`` pads each incoming batch up to the smallest configured bucket, copies it into a
static input buffer and replays a CUDA graph captured for that bucket; it returns views of the
static outputs sliced to the real batch size (cloned, so the next replay cannot overwrite them).
Buckets are captured once at warm-up, so the first real request does not pay for it. Optionally
the module is first compiled with ``torch.compile`` (Inductor kernels), and the graph is captured
over the compiled code; without compilation, the eager (cuDNN/cuBLAS) kernels are captured, which
costs well under a second per bucket.

On CPU the module runs eagerly; a batch larger than the largest bucket is chunked by the largest bucket,
so results never depend on the path taken beyond floating-point tolerance.

Memory (measured on the H200, ``benchmarks/results/serve_memory_gpu.json``): every CUDA graph in the process,
the recognizer's and the detector's, is captured by :func:`capture_graph`, which

* warms up and captures on **one** side stream per device: PyTorch keeps a cuBLAS workspace (~34 MiB on
  the H200) for every stream that ever ran a GEMM, for the process's lifetime; a fresh stream per capture
  cost 269 MiB for 7 recognizer buckets and as much again for the detector's;
* captures into **one** memory pool per device, so the graphs' intermediate activations share memory
  instead of each model keeping its own peak.

Sharing one pool needs two rules. Every replay is issued on the device's default stream (checked in
:func:`replay`), so replays never run concurrently. And between a graph's replay and the moment its
outputs have been copied out (the copies enqueued on that stream), no other graph of the pool replays:
a graph captured later may keep its outputs in memory that an earlier capture used for intermediates and
freed, so replaying the earlier graph overwrites them. :func:`replay_lock` is that rule's lock, one per
device, held by :class:`GraphedModule` and the detector from copy-in to copy-out. Without it, the
serving engine's detect and embed stages interleave replays, and a share of photos would find no face.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from facegate.errors import EngineError

log = logging.getLogger(__name__)

DEFAULT_BUCKETS: tuple[int, ...] = (1, 4, 16, 64)
#: Inductor options ``compile=inductor`` serves with, on top of the ``max-autotune-no-cudagraphs`` mode:
#: ``freezing`` (weights become constants, so Inductor can fold and re-layout them) and ``conv_1x1_as_mm``
#: (SFace's pointwise convolutions become matmuls whose Triton templates absorb bias and PReLU). With them
#: SFace fp16 runs about twice the eager kernels' rate under CUDA graphs, after minutes of autotuning while
#: the compile cache holds none of its kernels, and seconds once it does.
INDUCTOR_SERVING_OPTIONS: dict[str, Any] = {"freezing": True, "conv_1x1_as_mm": True}

#: One record per capture of this process (bounded: buckets and detector shapes are few): where a capture's
#: seconds go (the first eager run plans cuDNN convolutions and loads kernels) and the shared pool's size
#: after it. Read by ``benchmarks/serve_memory.py``.
capture_records: list[dict[str, Any]] = []
_MAX_RECORDS = 256

_shared_lock = threading.Lock()
_side_streams: dict[int, torch.cuda.Stream] = {}
_pools: dict[int, Any] = {}


_replay_locks: dict[int, threading.RLock] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def replay_lock(device: torch.device) -> threading.RLock:
    """The lock every user of ``device``'s shared graph pool holds from copy-in through replay to copy-out.

    Re-entrant, so a lazy capture (the detector's new batch shapes) can run under it.
    """
    dev = _device_index(device) if device.type == "cuda" else -1
    with _shared_lock:
        lock = _replay_locks.get(dev)
        if lock is None:
            lock = _replay_locks[dev] = threading.RLock()
    return lock


def capture_graph(
    fn: Callable[[Tensor], Any], static_in: Tensor, *, warmup: int = 2
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn(static_in)`` as a CUDA graph in the device's shared pool; returns ``(graph, outputs)``.

    ``fn`` is first run ``warmup`` times eagerly on the device's one side stream (loads kernels, plans
    convolutions), then captured on the same stream with ``capture_error_mode="thread_local"``, so other
    threads of a serving process (which keep replaying graphs and copying tensors meanwhile) are not
    disturbed by it. Captures are serialised process-wide. ``outputs`` is whatever ``fn`` returned; its
    tensors are the graph's static outputs, overwritten by each :func:`replay`.
    """
    dev = _device_index(static_in.device)
    with _shared_lock:
        side = _side_streams.get(dev)
        if side is None:
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
        if len(capture_records) < _MAX_RECORDS:
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
    """Replay ``graph`` on the current stream, which must be the default one (the shared pool's invariant).

    Raises:
        EngineError: called under a non-default stream, where a replay could run concurrently with
            another graph that uses the same pool memory.
    """
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        raise EngineError("CUDA graphs must be replayed on the default stream (they share one memory pool)")
    graph.replay()


class GraphedModule(nn.Module):
    """Run ``module(x)`` through per-bucket CUDA graphs.

    Args:
        module: maps ``x (N, *item_shape)`` to a tensor or a tuple of tensors whose first dim is N.
        item_shape: shape of one item, e.g. ``(112, 112, 3)``.
        dtype: dtype of ``x`` (e.g. ``torch.uint8`` for crops).
        buckets: batch sizes to capture, ascending.
        compile_mode: ``None`` (capture eager kernels) or a ``torch.compile`` mode such as
            ``"max-autotune-no-cudagraphs"`` (compile first; slow start, faster kernels).
        compile_options: Inductor options added to the mode's (e.g. :data:`INDUCTOR_SERVING_OPTIONS`);
            only with ``compile_mode``.
    """

    def __init__(
        self,
        module: nn.Module,
        item_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        compile_mode: str | None = None,
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.item_shape = tuple(item_shape)
        self.in_dtype = dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.compile_mode = compile_mode
        self.compile_options = dict(compile_options or {})
        if self.compile_options and not compile_mode:
            raise ValueError("compile_options need a compile_mode")
        if not compile_mode:
            self._fn: Callable[[Tensor], Any] = module
        elif self.compile_options:  # torch.compile takes a mode or options, not both: spell the mode out
            opts = {**torch._inductor.list_mode_options(compile_mode), **self.compile_options}
            self._fn = torch.compile(module, options=opts, dynamic=False)
        else:
            self._fn = torch.compile(module, mode=compile_mode, dynamic=False)
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
        for b in reversed(self.buckets):  # largest first, so smaller graphs fit in the memory it freed
            t0 = time.perf_counter()
            static_in = torch.zeros((b, *self.item_shape), dtype=self.in_dtype, device=self.device)
            g, out = capture_graph(self._fn, static_in, warmup=3)
            self._tuple_out = isinstance(out, tuple)
            outs = out if isinstance(out, tuple) else (out,)
            self._graphs[b] = (g, static_in, outs)
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
        # copy-in, replay and copy-out under the pool's lock: no other graph may replay in between (module doc)
        with replay_lock(self.device):
            static_in[:n].copy_(x, non_blocking=True)
            if n < b:
                static_in[n:].zero_()
            replay(g)
            res = tuple(o[:n].clone() for o in outs)
        return res if self._tuple_out else res[0]
