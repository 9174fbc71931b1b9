"""The ``detect`` and ``embed`` engine stages of a :class:`~facegate.pipeline.pipeline.FacePipeline` (engine-side:
they import torch; what they deliver lives in the torch-free :mod:`facegate.pipeline.results`)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from facegate.errors import InvalidParameterError
from facegate.io.memcopy import pack_rows
from facegate.pipeline.base import detector_batches
from facegate.pipeline.results import EmbedOut
from facegate.types import Detection


class DetectStage:
    """Engine stage: payload ``(H,W,3) uint8`` RGB image → ``list[Detection]``."""

    name = "detect"

    def __init__(self, pipeline: Any) -> None:
        self.p = pipeline

    def prepare(self, payloads: list[np.ndarray]) -> list[tuple[list[int], Any]]:
        """The images preprocessed per detector forward (:func:`detector_batches`): ``[(indices, DetBatch)]``."""
        for i, im in enumerate(payloads):
            if not isinstance(im, np.ndarray) or im.ndim != 3:
                raise InvalidParameterError(f"image {i} must be (H, W, 3) uint8", detail={"index": i})
        det = self.p.detector
        rows = 1 if self.p.pool is not None else self.p.chunk  # a photo per pool thread and forward, at once
        batches = detector_batches([im.shape[:2] for im in payloads], det, rows)
        return [(idx, det.preprocess([payloads[i] for i in idx])) for idx in batches]

    def execute(self, groups: list[tuple[list[int], Any]]) -> list[list[Detection]]:
        """Forward + on-device decode/NMS + each group's one device→host copy; results back in input order."""
        out: list[list[Detection]] = [[] for _ in range(sum(len(idx) for idx, _ in groups))]
        batches = [batch for _, batch in groups]
        run = self.p.detector.run_many
        found = run(batches) if self.p.pool is None else self.p.map(lambda b: run([b])[0], batches)
        for (idx, _), per_batch in zip(groups, found, strict=True):
            for i, dets in zip(idx, per_batch, strict=True):
                out[i] = dets
        return out


class EmbedStage:
    """Engine stage: payload ``(k,112,112,3) uint8`` crops of one request → ``(emb, quality, raw)`` arrays
    (an :class:`EmbedOut`)."""

    name = "embed"
    #: Pinned staging buffers on CUDA, used in turn: the engine keeps at most 2 prepared batches alive, so 3 are
    #: never reused while a host→device copy may still read them.
    STAGING_BUFFERS = 3
    #: Rows of a staging buffer when first made (one full batch); a larger batch grows its buffer.
    STAGING_ROWS = 64

    def __init__(self, pipeline: Any) -> None:
        self.p = pipeline
        self._staging: list[torch.Tensor | None] = [None] * self.STAGING_BUFFERS
        self._turn = 0

    @staticmethod
    def item_cost(payload: np.ndarray) -> int:
        """Batches are capped in crops, not requests."""
        return max(1, len(payload))

    def prepare(self, payloads: list[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
        """The requests' crops stacked ``(N, 112, 112, 3) uint8`` (on CUDA in a pinned staging buffer) and each
        request's count."""
        sizes = [len(c) for c in payloads]
        n = sum(sizes)
        cuda = self.p.device.type == "cuda"
        n_pad = n
        buckets = self.p.detector.batch_buckets
        if cuda and buckets and not hasattr(self.p.recognizer, "capture"):
            # eager CUDA: pad to a bucket so cuDNN only meets batch shapes it planned at warm-up
            n_pad = next((b for b in buckets if b >= n), n)
        item_shape = tuple(payloads[0].shape[1:])
        if any(p.dtype != np.uint8 or tuple(p.shape[1:]) != item_shape for p in payloads):
            raise InvalidParameterError("the crops of one batch must all be uint8 of one shape")
        if cuda:  # the next pinned buffer of the ring, made or grown as needed
            i, self._turn = self._turn, (self._turn + 1) % self.STAGING_BUFFERS
            buf = self._staging[i]
            if buf is None or buf.shape[0] < n_pad or tuple(buf.shape[1:]) != item_shape:
                buf = torch.empty((max(n_pad, self.STAGING_ROWS), *item_shape), dtype=torch.uint8).pin_memory()
                self._staging[i] = buf
        else:
            buf = torch.empty((n, *item_shape), dtype=torch.uint8)
        pack_rows(buf[:n].numpy(), payloads)  # one memcpy per request with the GIL held (io/memcopy.py)
        if n_pad > n:
            buf[n:n_pad].zero_()
        return buf[:n_pad], sizes

    @torch.inference_mode()
    def execute(self, prepared: tuple[torch.Tensor, list[int]]) -> tuple[np.ndarray, list[int]]:
        """The rows ``(N_pad, D + 2) float32`` (embedding | quality | raw) on the host, and each request's count."""
        x, sizes = prepared
        out = self.p.recognize(x.to(self.p.device, non_blocking=True))
        return out.cpu().numpy(), sizes  # the one device→host copy for the whole batch

    def deliver(self, result: tuple[np.ndarray, list[int]], n: int) -> list[EmbedOut]:
        out, sizes = result
        return [EmbedOut(out[end - s : end]) for s, end in zip(sizes, itertools.accumulate(sizes), strict=True)]
