"""Bounded-activation execution of a recognizer trunk: the high-resolution layers run in sub-batches.

A recognizer's activation memory is dominated by its first layers, which run at full crop resolution
(SFace: 64 × 112 × 112 per face after the stem, 1.5 MiB in fp16; IR-SE-64 likewise), while its later layers
hold 16-64× less per face. Splitting the whole batch into small sub-batches bounds the memory but runs the
cheap low-resolution layers at small batches too. :class:`ActivationPlan` splits the trunk in two instead:

* the **prefix** (the first ``split`` stages) runs ``chunk`` crops at a time, each sub-batch's output being
  copied into one preallocated buffer of the whole batch;
* the **suffix** (the remaining stages) runs on the whole batch at once.

``split`` is the first stage boundary from which the whole batch fits half the budget; ``chunk`` is the most
crops the prefix's largest stage holds within what the buffer leaves of it. Each kernel then gets a similar
number of elements: a sub-batch of 6 at 112 × 112 is as large a tensor as a batch of 96 at 28 × 28.

The estimate of what one stage holds per crop is ``its input + the largest input + output of one of its
leaf layers`` (a residual unit keeps its input alive while its layers run), measured once with forward hooks
on a one-crop batch (:meth:`ActivationPlan.measure`). It is an estimate, not an allocator bound: caching-
allocator rounding, cuDNN workspaces and, under CUDA graphs, the pool's layout come on top; what a whole
process holds is measured by ``benchmarks/serve_memory.py``. The outputs equal the unsplit forward's up to
the kernels' rounding (different batch sizes can select different cuDNN kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from facegate.errors import InvalidParameterError


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """Per-stage activation sizes of a trunk, and the split they imply under a budget.

    Attributes:
        stage_peak: per stage, the estimated elements one crop holds while the stage runs.
        stage_out: per stage, the elements of one crop's output.
        budget_elems: the activation budget, in elements of the compute dtype.
    """

    stage_peak: tuple[int, ...]
    stage_out: tuple[int, ...]
    budget_elems: int

    def __post_init__(self) -> None:
        if not self.stage_peak or len(self.stage_peak) != len(self.stage_out):
            raise InvalidParameterError("an activation plan needs one peak and one output size per stage")
        if self.budget_elems < 1:
            raise InvalidParameterError(f"activation budget must be positive, got {self.budget_elems} elements")

    @classmethod
    def measure(cls, stages: Sequence[nn.Module], x: Tensor, budget_bytes: float) -> ActivationPlan:
        """Run ``x`` (a one-crop batch ``(1, 3, H, W)`` in the compute dtype, on the stages' device) through
        ``stages`` with forward hooks on their leaf modules, and size the plan for ``budget_bytes``.

        On CUDA each stage also runs once on :data:`PROBE_CROPS` copies of its input, and what the caching
        allocator reached above that input (:func:`_cuda_peak_per_crop`) counts when it exceeds the hooks'
        estimate: fused layers call their kernels directly (no leaf hook fires), and cuDNN workspaces are
        invisible to hooks. This resets CUDA's peak-memory statistics.
        """
        if x.shape[0] != 1:
            raise InvalidParameterError(f"measure() takes a one-crop batch, got {tuple(x.shape)}")
        peaks: list[int] = []
        outs: list[int] = []
        h = x
        with torch.inference_mode():
            for stage in stages:
                largest = [0]

                def hook(m: nn.Module, inputs: tuple[object, ...], out: object, largest: list[int] = largest) -> None:
                    ins = sum(t.numel() for t in inputs if isinstance(t, Tensor))
                    got = sum(t.numel() for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, Tensor))
                    largest[0] = max(largest[0], ins + got)

                leaves = [m for m in stage.modules() if not list(m.children())] or [stage]
                handles = [m.register_forward_hook(hook) for m in leaves]
                try:
                    y = stage(h)
                finally:
                    for hd in handles:
                        hd.remove()
                peak = max(largest[0], h.numel() + y.numel())
                if h.is_cuda:
                    peak = max(peak, _cuda_peak_per_crop(stage, h))
                peaks.append(h.numel() + peak)
                outs.append(y.numel())
                h = y
        return cls(tuple(peaks), tuple(outs), max(1, int(budget_bytes // x.element_size())))

    def split(self, n: int) -> tuple[int, int]:
        """``(split, chunk)`` for a batch of ``n`` crops: stages ``[0, split)`` run ``chunk`` crops at a time,
        the rest on the whole batch. ``split == 0`` means the whole batch fits: no sub-batches.

        The whole batch runs from the first stage whose remaining stages, and the buffer of the prefix's
        output, fit in half the budget; the sub-batches get what the buffer leaves (so at least the other
        half). When no stage boundary fits, every stage runs in sub-batches into a buffer of the features.
        """
        # every stage's peak, not only the first: a batch that fits the stem's peak can overrun the budget later
        if n * max(self.stage_peak) <= self.budget_elems:
            return 0, n
        stages = len(self.stage_peak)
        for s in range(1, stages + 1):
            suffix = max(self.stage_peak[s:], default=0)
            if 2 * n * max(suffix, self.stage_out[s - 1]) <= self.budget_elems:
                break
        room = self.budget_elems - n * self.stage_out[s - 1]
        chunk = max(1, min(n, room // max(self.stage_peak[:s])))
        return (0, n) if chunk >= n else (s, chunk)


#: crops per CUDA probe of a stage in :meth:`ActivationPlan.measure` (its fixed costs, e.g. a workspace, are
#: shared by this many crops: a larger batch gets a smaller share, so the estimate errs on the safe side)
PROBE_CROPS = 4


def _cuda_peak_per_crop(stage: nn.Module, h: Tensor) -> int:
    """Elements (of ``h``'s dtype) per crop the caching allocator reached above a batch of :data:`PROBE_CROPS`
    copies of the one-crop input ``h`` while ``stage`` ran, its output included."""
    batch = torch.cat([h] * PROBE_CROPS)  # keeps channels_last
    torch.cuda.synchronize(h.device)
    base = torch.cuda.memory_allocated(h.device)
    torch.cuda.reset_peak_memory_stats(h.device)
    y = stage(batch)
    torch.cuda.synchronize(h.device)
    extra = torch.cuda.max_memory_allocated(h.device) - base
    del y, batch
    return -(-extra // (PROBE_CROPS * h.element_size()))


def run_trunk(
    stages: Sequence[nn.Module],
    plan: ActivationPlan | None,
    n: int,
    inputs: Callable[[int, int], Tensor],
) -> Tensor:
    """The trunk's output for ``n`` crops, the prefix in sub-batches as ``plan`` says.

    Args:
        stages: the trunk, applied in order.
        plan: the activation plan; ``None`` runs the whole batch at once.
        n: the batch size.
        inputs: ``inputs(start, stop)`` → the trunk's input rows for crops ``[start, stop)``; it may return
            more rows than crops (e.g. a mirrored copy after them): row ``j`` of a sub-batch of ``m`` crops
            that maps to ``r = j // m`` and ``i = j % m`` goes to output row ``r * n + start + i``.

    Returns:
        the last stage's output, ``(rows, ...)`` in the stages' dtype.
    """
    split, chunk = plan.split(n) if plan is not None else (0, n)
    if split == 0:
        h = inputs(0, n)
        for stage in stages:
            h = stage(h)
        return h
    buf: Tensor | None = None
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        h = inputs(start, stop)
        for stage in stages[:split]:
            h = stage(h)
        m = stop - start
        copies = h.shape[0] // m
        if buf is None:
            fmt = torch.channels_last if h.ndim == 4 and not h.is_contiguous() else torch.contiguous_format
            buf = torch.empty((copies * n, *h.shape[1:]), dtype=h.dtype, device=h.device, memory_format=fmt)
        for r in range(copies):
            buf[r * n + start : r * n + stop].copy_(h[r * m : (r + 1) * m])
        del h
    assert buf is not None
    h = buf
    for stage in stages[split:]:
        h = stage(h)
    return h
