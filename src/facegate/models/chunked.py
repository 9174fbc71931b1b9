"""Bounded activations for a recognizer trunk: its first, full-resolution stages (which dominate activation memory)
run ``chunk`` crops at a time into one buffer of the whole batch; the rest runs on the whole batch. A stage's cost
per crop is its input plus its largest leaf input + output (forward hooks on one crop)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """Per stage, elements one crop holds while it runs and its output's; the budget in compute-dtype elements."""

    stage_peak: tuple[int, ...]
    stage_out: tuple[int, ...]
    budget_elems: int

    @classmethod
    def measure(cls, stages: Sequence[nn.Module], x: Tensor, budget_bytes: float) -> ActivationPlan:
        """Measure ``stages`` on one crop ``x (1, 3, H, W)`` for ``budget_bytes``. On CUDA the allocator's peak over
        :data:`PROBE_CROPS` copies counts when larger (workspaces escape the hooks); it resets the peak statistics."""
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
        """``(split, chunk)`` for ``n`` crops: stages ``[0, split)`` run ``chunk`` at a time (``0``: no sub-batches),
        from the first stage whose rest and output buffer fit half the budget."""
        # every stage's peak, not only the first: a batch that fits the stem's peak can overrun the budget later
        if n * max(self.stage_peak) <= self.budget_elems:
            return 0, n
        for s in range(1, len(self.stage_peak) + 1):
            if 2 * n * max((self.stage_out[s - 1], *self.stage_peak[s:])) <= self.budget_elems:
                break
        room = self.budget_elems - n * self.stage_out[s - 1]
        chunk = max(1, min(n, room // max(self.stage_peak[:s])))
        return (0, n) if chunk >= n else (s, chunk)


#: crops per CUDA probe in :meth:`ActivationPlan.measure`
PROBE_CROPS = 4


def _cuda_peak_per_crop(stage: nn.Module, h: Tensor) -> int:
    """Elements per crop the allocator reached above :data:`PROBE_CROPS` copies of ``h`` while ``stage`` ran."""
    batch = torch.cat([h] * PROBE_CROPS)  # keeps channels_last
    torch.cuda.synchronize(h.device)
    base = torch.cuda.memory_allocated(h.device)
    torch.cuda.reset_peak_memory_stats(h.device)
    stage(batch)
    torch.cuda.synchronize(h.device)
    return -(-(torch.cuda.max_memory_allocated(h.device) - base) // (PROBE_CROPS * h.element_size()))


def run_trunk(
    stages: Sequence[nn.Module], plan: ActivationPlan | None, n: int, inputs: Callable[[int, int], Tensor]
) -> Tensor:
    """The trunk's output for ``n`` crops, split as ``plan`` says. ``inputs(start, stop)``: the rows of crops
    ``[start, stop)``, maybe with copies after them: row ``j`` of ``m`` goes to row ``(j // m) · n + start + j % m``."""
    split, chunk = plan.split(n) if plan is not None else (0, n)
    if split == 0:
        h = inputs(0, n)
    else:
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
