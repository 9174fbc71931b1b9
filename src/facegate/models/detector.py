"""Batched YuNet face detection: preprocess (host or device canvases), forward, then select, NMS and rescale."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from facegate.errors import EmptyInputError, InvalidParameterError
from facegate.models.nms import NMS_GROUPED_MAX, NMS_ROWS_MAX, nms, nms_grouped, nms_rows
from facegate.models.yunet import SIZE_DIVISOR, STRIDES, RawOutputs, YuNet, decode_yunet, flat_outputs
from facegate.runtime.graphs import capture_graph, device_index, replay, replay_lock
from facegate.types import Detection

log = logging.getLogger(__name__)

#: ``post(packed, arg)`` of :meth:`FaceDetector.enqueue_many`: device work on the packed candidates
PostFn = Callable[[Tensor, Tensor], tuple[Tensor, ...]]


@dataclass(frozen=True, slots=True)
class DetBatch:
    """A preprocessed batch: ``images (N, Hp, Wp, 3) uint8`` RGB, each resized and placed top-left on a zero canvas
    (host array, or a device tensor); ``orig_sizes`` / ``resized_sizes (n, 2) int64`` ``(H, W)`` of the ``n`` real
    images; ``pinned``: on CUDA, the pinned tensor owning ``images``' memory (the allocator tracks the copy)."""

    images: np.ndarray | Tensor
    orig_sizes: np.ndarray
    resized_sizes: np.ndarray
    pinned: Tensor | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        """Real images (``images`` may have extra zero rows)."""
        return int(self.orig_sizes.shape[0])

    @property
    def input_hw(self) -> tuple[int, int]:
        """The padded network input size ``(Hp, Wp)``."""
        return int(self.images.shape[1]), int(self.images.shape[2])


@dataclass(slots=True)
class DetPending:
    """Batches from :meth:`FaceDetector.enqueue_many`. ``packed``: per batch its candidates ``(n, p·15 + 1)`` (pinned
    host copies on CUDA; with ``keep_on_device`` on the device) and the decoded ``(boxes, landmarks, scores)`` (``None``
    when not kept, or after a replay); ``event``: after the last host copy; ``done``: the detections (off CUDA);
    ``post_out``: ``post``'s outputs for the real rows."""

    batches: list[DetBatch]
    packed: list[tuple[Tensor, tuple[Tensor, ...] | None]]
    event: Any
    done: list[list[list[Detection]]] | None
    post_out: list[tuple[Tensor, ...]] | None = None


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are one device (a missing index is the current device: ``cuda`` is ``cuda:0`` there)."""
    return a.type == b.type and (a.type != "cuda" or device_index(a) == device_index(b))


def _pad32(n: int) -> int:
    return -(-n // SIZE_DIVISOR) * SIZE_DIVISOR


@functools.lru_cache(maxsize=64)
def _anchors(input_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Anchors in :func:`decode_yunet`'s order: ``grid (A, 2) float32`` (col, row), ``stride (A, 1) float32``."""
    h, w = input_hw
    grids, strides = [], []
    for s in STRIDES:
        rows, cols = np.mgrid[0 : h // s, 0 : w // s]
        grids.append(np.stack([cols.ravel(), rows.ravel()], 1))
        strides.append(np.full((rows.size, 1), s))
    return np.concatenate(grids).astype(np.float32), np.concatenate(strides).astype(np.float32)


def _detections(cand: np.ndarray, rows: np.ndarray, batch: DetBatch, n: int) -> list[list[Detection]]:
    """Per batch row ``0..n-1`` its kept candidates ``cand (K, 15) float32`` (box 4, landmarks 10, score) of rows
    ``rows (K,)`` (each row's in score order), rescaled to image pixels in fp64 and clipped; a box left with no
    area lay in the padding and is dropped (landmarks are not clipped); each detection carries its photo's size."""
    whs = batch.orig_sizes[:, ::-1]  # (n, 2) (W, H)
    scale = (whs / batch.resized_sizes[:, ::-1])[rows]  # (k, 2) (sx, sy), fp64
    boxes = (cand[:, :4].reshape(-1, 2, 2) * scale[:, None, :]).reshape(-1, 4)
    np.minimum(np.maximum(boxes, 0, out=boxes), np.tile(whs[rows], 2), out=boxes)
    lms32 = (cand[:, 4:14].reshape(-1, 5, 2) * scale[:, None, :]).astype(np.float32)
    good = ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).tolist()
    boxes32, scores, rows_l = boxes.astype(np.float32), cand[:, 14].tolist(), rows.tolist()
    sizes = [(int(w), int(h)) for w, h in whs.tolist()]
    out: list[list[Detection]] = [[] for _ in range(n)]
    for k, ok in enumerate(good):
        if ok:
            det = Detection(box=boxes32[k], landmarks=lms32[k], score=scores[k], photo_wh=sizes[rows_l[k]])
            out[rows_l[k]].append(det)
    return out


class FaceDetector:
    """YuNet on ``(H, W, 3) uint8`` RGB images → :class:`~facegate.types.Detection` in image pixels, by score.
    The model is moved in place to ``device``, ``dtype`` (fp32/fp16/bf16) and the memory format; decoding is fp32."""

    #: Candidates per image in the one device→host copy; an image with more above the threshold needs a second.
    prefetch: int = 256

    def __init__(
        self,
        model: YuNet,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        score_threshold: float = 0.6,
        nms_threshold: float = 0.3,
        top_k: int = 5000,
        max_side: int = 640,
        channels_last: bool = True,
    ) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidParameterError(f"unsupported detector dtype {dtype}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.channels_last = bool(channels_last)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        self.model = model.to(device=self.device, dtype=dtype, memory_format=fmt).eval()
        self.score_threshold = float(score_threshold)
        self.nms_threshold = float(nms_threshold)
        self.top_k = int(top_k)
        self.max_side = int(max_side)
        #: CUDA batch sizes: zero rows pad up to one, so cuDNN meets only the shapes planned at warm-up.
        self.batch_buckets: tuple[int, ...] | None = None
        #: Largest padded forward (rows × Hp × Wp pixels) bucket padding may reach; None: no cap.
        self.max_batch_pixels: int | None = None
        self._graphs: dict[Any, tuple[Any, ...]] = {}
        self._max_graphs = 0  # no CUDA graphs until enable_graphs

    def _resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """``(H, W)`` shrunk so that the longer side is at most ``max_side`` (never enlarged)."""
        s = self.max_side / max(height, width)
        return (max(1, round(height * s)), max(1, round(width * s))) if s < 1.0 else (height, width)

    def padded_hw(self, height: int, width: int) -> tuple[int, int]:
        """The network input ``(Hp, Wp)`` of this image alone. Batch only images of one padded size: YuNet's outputs
        near a face depend on the zero padding around it."""
        h, w = self._resized_hw(height, width)
        return _pad32(h), _pad32(w)

    def preprocess(self, images: Sequence[np.ndarray]) -> DetBatch:
        """Validate, shrink (longer side ≤ ``max_side``, ``INTER_AREA``) and pad top-left. Raises
        :class:`EmptyInputError` (no images) and :class:`InvalidParameterError` (not ``(H, W, 3) uint8``)."""
        if len(images) == 0:
            raise EmptyInputError("no images to detect faces in")
        resized: list[np.ndarray] = []
        for i, img in enumerate(images):
            if not isinstance(img, np.ndarray):
                raise InvalidParameterError(
                    f"image {i} is a {type(img).__name__}, expected an (H, W, 3) uint8 numpy array", detail={"index": i}
                )
            if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
                raise InvalidParameterError(
                    f"image {i} must be (H, W, 3) uint8 RGB, got shape {img.shape} dtype {img.dtype}",
                    detail={"index": i, "shape": list(img.shape), "dtype": str(img.dtype)},
                )
            size = self._resized_hw(*img.shape[:2])
            if size != img.shape[:2]:
                try:
                    img = cv2.resize(np.ascontiguousarray(img), size[::-1], interpolation=cv2.INTER_AREA)
                except cv2.error as exc:
                    raise InvalidParameterError(f"image {i} cannot be resized: {exc}", detail={"index": i}) from exc
            resized.append(img)
        hp, wp = _pad32(max(r.shape[0] for r in resized)), _pad32(max(r.shape[1] for r in resized))
        # rows past len(images) are zero padding; the post-processing ignores them
        shape = (self._batch_rows(len(images), hp, wp), hp, wp, 3)
        pinned = torch.zeros(shape, dtype=torch.uint8, pin_memory=True) if self.device.type == "cuda" else None
        canvas = np.zeros(shape, np.uint8) if pinned is None else pinned.numpy()
        for i, r in enumerate(resized):
            canvas[i, : r.shape[0], : r.shape[1]] = r
        return DetBatch(
            images=canvas,
            orig_sizes=np.array([img.shape[:2] for img in images], np.int64),
            resized_sizes=np.array([r.shape[:2] for r in resized], np.int64),
            pinned=pinned,
        )

    def _batch_rows(self, n: int, hp: int, wp: int) -> int:
        """Rows for ``n`` images: the next bucket within :attr:`max_batch_pixels`, else what the cap holds (≥ n)."""
        if not self.batch_buckets:
            return n
        cap = self.max_batch_pixels // (hp * wp) if self.max_batch_pixels else None
        fits = [b for b in sorted(self.batch_buckets) if b >= n and (cap is None or b <= cap)]
        return fits[0] if fits else max(n, cap or n)

    @torch.inference_mode()
    def preprocess_tensors(self, images: Sequence[Tensor]) -> DetBatch:
        """:meth:`preprocess` for ``(3, H, W) uint8`` RGB tensors on the detector's device (e.g. from nvJPEG), shrunk
        by ``F.interpolate(mode="area")``; the same errors."""
        if len(images) == 0:
            raise EmptyInputError("no images to detect faces in")
        resized: list[Tensor] = []
        for i, img in enumerate(images):
            if (
                img.dtype != torch.uint8
                or img.ndim != 3
                or img.shape[0] != 3
                or not same_device(img.device, self.device)
            ):
                raise InvalidParameterError(
                    f"image {i} must be a (3, H, W) uint8 tensor on {self.device}, got {tuple(img.shape)} "
                    f"{img.dtype} on {img.device}",
                    detail={"index": i},
                )
            h, w = int(img.shape[1]), int(img.shape[2])
            size = self._resized_hw(h, w)
            if size != (h, w):
                img = F.interpolate(img[None].float(), size=size, mode="area").round_().clamp_(0, 255)[0].byte()
            resized.append(img)
        hp, wp = _pad32(max(int(r.shape[1]) for r in resized)), _pad32(max(int(r.shape[2]) for r in resized))
        canvas = torch.zeros((self._batch_rows(len(images), hp, wp), hp, wp, 3), dtype=torch.uint8, device=self.device)
        k = 0
        # one copy per run of same-size images (LFW: one for the whole batch)
        for (h, w), run in itertools.groupby(resized, key=lambda r: tuple(r.shape[1:])):
            group = list(run)
            canvas[k : k + len(group), :h, :w] = (
                torch.stack(group).permute(0, 2, 3, 1) if len(group) > 1 else group[0].permute(1, 2, 0)
            )
            k += len(group)
        return DetBatch(
            images=canvas,
            orig_sizes=np.array([(int(im.shape[1]), int(im.shape[2])) for im in images], np.int64),
            resized_sizes=np.array([(int(r.shape[1]), int(r.shape[2])) for r in resized], np.int64),
        )

    def _to_input(self, x: Tensor) -> Tensor:
        """``(N, Hp, Wp, 3) uint8`` RGB on the device → the network input ``(N, 3, Hp, Wp)`` BGR in the model dtype."""
        x = x.permute(0, 3, 1, 2).flip(1).to(self.dtype)
        return x.contiguous(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)

    def _host_batch(self, batch: DetBatch) -> Tensor:
        if isinstance(batch.images, Tensor):  # preprocess_tensors: already on the device
            return batch.images
        x = batch.pinned if batch.pinned is not None else torch.from_numpy(batch.images)  # pinned on CUDA
        return x.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, batch: DetBatch) -> RawOutputs:
        """The batch's raw outputs on the device, in the model dtype (an ORT network takes the uint8 batch)."""
        x = self._host_batch(batch)  # ONNX Runtime: the cast and flip are in its graph
        return self.model(self._to_input(x) if isinstance(self.model, nn.Module) else x)

    def _select(self, raw: RawOutputs, input_hw: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode and take each row's top ``p = prefetch`` on the device: ``packed (N, p·15 + 1) fp32`` (box 4,
        landmarks 10, score; then the count above the threshold, ≤ ``top_k``), and the decoded ``boxes (N, A, 4)``,
        ``landmarks (N, A, 5, 2)``, ``scores (N, A)`` for rows with more than ``p``."""
        boxes, lms, scores = decode_yunet(*raw, input_hw=input_hw)
        n, a = scores.shape
        k_max = min(self.top_k, a)
        p = min(k_max, self.prefetch)
        top_s, top_i = torch.topk(scores, p, dim=1)  # sorted, descending
        packed = torch.cat(
            [
                boxes.gather(1, top_i[..., None].expand(-1, -1, 4)),
                lms.reshape(n, a, 10).gather(1, top_i[..., None].expand(-1, -1, 10)),
                top_s[..., None],
            ],
            dim=-1,
        )  # (N, p, 15)
        counts = (scores >= self.score_threshold).sum(1).clamp(max=k_max)
        return torch.cat([packed.reshape(n, -1), counts[:, None].to(packed.dtype)], 1), boxes, lms, scores

    def enable_graphs(self, max_graphs: int = 32) -> None:
        """Run cast, network, decode and top-k as one CUDA graph per batch shape ``(rows, Hp, Wp)``, captured on
        first use, up to ``max_graphs`` (others run eagerly); held under ``replay_lock`` until the copy-out."""
        if self.device.type == "cuda":
            self._max_graphs = int(max_graphs)

    def _graph_for(self, shape: tuple[int, int, int], post: PostFn | None, post_width: int) -> tuple[Any, ...] | None:
        """``(graph, static_in, outputs, static_arg)`` of a shape (with ``post``: of ``(shape, post)``), captured on
        first use: ``_select``'s four outputs then ``post(packed, static_arg)``'s (``static_arg`` ``None`` without)."""
        key: Any = shape if post is None else (shape, post)
        if key in self._graphs or len(self._graphs) >= self._max_graphs:
            return self._graphs.get(key)
        t0 = time.perf_counter()
        static_in = torch.zeros((*shape, 3), dtype=torch.uint8, device=self.device)
        static_arg = (
            None if post is None else torch.ones((shape[0], post_width), dtype=torch.float64, device=self.device)
        )

        def fn(x: Tensor) -> tuple[Tensor, ...]:
            sel = self._select(self.model(self._to_input(x)), shape[1:])
            return sel if post is None else (*sel, *post(sel[0], static_arg))

        g, outs = capture_graph(fn, static_in)
        self._graphs[key] = (g, static_in, outs, static_arg)
        log.info("detector: captured a CUDA graph for batch shape %s in %.2f s", shape, time.perf_counter() - t0)
        return self._graphs[key]

    def _selected(
        self, b: DetBatch, post: PostFn | None = None, arg: Tensor | None = None
    ) -> tuple[tuple[Tensor, ...], bool]:
        """``_select``'s four outputs of ``b`` then ``post(packed, arg)``'s, through its CUDA graph or eagerly, and
        whether they are the graph's (the next replay overwrites them). Under ``replay_lock`` on CUDA."""
        entry = self._graph_for((int(b.images.shape[0]), *b.input_hw), post, 0 if arg is None else arg.shape[1])
        if entry is None:
            sel = self._select(self.forward(b), b.input_hw)
            extra = () if post is None or arg is None else post(sel[0], arg.to(self.device, non_blocking=True))
            return (*sel, *extra), False
        g, static_in, outs, static_arg = entry
        static_in.copy_(self._host_batch(b), non_blocking=True)
        if post is not None:
            static_arg.copy_(arg, non_blocking=True)
        replay(g)
        return outs, True

    def run_many(self, batches: Sequence[DetBatch]) -> list[list[list[Detection]]]:
        """The detections of each batch (through a CUDA graph after :meth:`enable_graphs`), with one device wait."""
        return self.finish_many(self.enqueue_many(batches))

    @torch.inference_mode()
    def enqueue_many(
        self,
        batches: Sequence[DetBatch],
        *,
        keep_on_device: bool = False,
        post: PostFn | None = None,
        post_args: Sequence[np.ndarray] | None = None,
    ) -> DetPending:
        """Enqueue each batch's forward and the copy of its candidates to pinned memory, without waiting (off CUDA:
        all of it); :meth:`finish_many` finishes on any thread. ``keep_on_device``: the candidates stay on the device;
        ``post(packed, arg)`` (with it): device work on ``(rows, p·15 + 1)`` and ``post_args`` ``(n, k) float64``."""
        cuda = self.device.type == "cuda"
        if not keep_on_device and (not batches or not cuda):
            return DetPending(
                list(batches), [], None, [self._postprocess_host(self._host_outputs(b), b) for b in batches]
            )
        packed: list[tuple[Tensor, tuple[Tensor, ...] | None]] = []
        post_out: list[tuple[Tensor, ...]] = []
        args = list(post_args) if post_args is not None else [None] * len(batches)
        event = None
        with replay_lock(self.device) if cuda else contextlib.nullcontext():
            for b, a in zip(batches, args, strict=True):
                n = len(b)
                arg = None
                if post is not None:  # pinned on CUDA: a copy from pageable memory may wait for the device
                    arg = torch.ones((int(b.images.shape[0]), a.shape[1]), dtype=torch.float64, pin_memory=cuda)
                    arg[:n] = torch.from_numpy(a)
                outs, graphed = self._selected(b, post, arg)
                if not keep_on_device:
                    # the decoded outputs are not kept, as after a replay (a crowd row runs its batch again): memory
                    host = torch.empty((n, outs[0].shape[1]), dtype=outs[0].dtype, pin_memory=True)
                    packed.append((host.copy_(outs[0][:n], non_blocking=True), None))
                elif graphed:  # the next replay overwrites the graph's outputs
                    packed.append((outs[0][:n].clone(), None))
                    post_out.append(tuple(t[:n].clone() for t in outs[4:]))
                else:
                    packed.append((outs[0][:n], outs[1:4]))
                    post_out.append(tuple(t[:n] for t in outs[4:]))
            if not keep_on_device:
                event = torch.cuda.Event()
                event.record()
        return DetPending(list(batches), packed, event, None, post_out if post is not None else None)

    @torch.inference_mode()
    def finish_many(self, pending: DetPending) -> list[list[list[Detection]]]:
        """Wait for :meth:`enqueue_many`'s copies, then NMS and rescale on the host: detections per batch."""
        if pending.done is not None:
            return pending.done
        if pending.event is not None:
            pending.event.synchronize()
        pairs = zip(pending.batches, pending.packed, strict=True)
        return [self._finish_host(p.cpu().numpy(), b, full) for b, (p, full) in pairs]

    def _rare_candidates(self, batch: DetBatch, i: int, c: int, full: tuple[Tensor, ...] | None) -> np.ndarray:
        """The top ``c > prefetch`` candidates ``(c, 15)`` of row ``i``, from ``full`` (decoded outputs) or, after a
        replay (``None``), by running the batch again."""
        with replay_lock(self.device) if full is None else contextlib.nullcontext():
            boxes, lms, scores = self._selected(batch)[0][1:4] if full is None else full
            s_i, idx_i = torch.topk(scores[i], c)
            return torch.cat([boxes[i, idx_i], lms[i, idx_i].reshape(c, 10), s_i[:, None]], 1).cpu().numpy()

    def _host_outputs(self, batch: DetBatch) -> list[np.ndarray]:
        """:func:`flat_outputs` of a batch as fp32 host arrays (an ORT network computes them in its graph)."""
        if isinstance(self.model, nn.Module):
            return [t.float().numpy() for t in flat_outputs(self.forward(batch))]
        return self.model.flat(batch.images)

    def _postprocess_host(self, flat: Sequence[np.ndarray], batch: DetBatch) -> list[list[Detection]]:
        """Detections of host :func:`flat_outputs`: decode only the anchors above the threshold (ties keep the anchor
        order), ``top_k``, NMS, map to image pixels and clip, the whole batch's candidates together."""
        n = len(batch)
        scores, bbox, kps = (f[:n] for f in flat)
        r, a = np.nonzero(scores >= self.score_threshold)
        if not r.size:
            return [[] for _ in range(n)]
        grid, stride = _anchors(batch.input_hw)
        g, s, sc, bb = grid[a], stride[a], scores[r, a], bbox[r, a]
        centre = (g + bb[:, :2]) * s
        half = np.exp(bb[:, 2:4]) * (s / 2)
        lms = (kps[r, a].reshape(-1, 5, 2) + g[:, None]) * s[:, None]
        order = np.lexsort((-sc, r))  # by row, then score (descending); ties keep the anchor order
        cand = np.concatenate([centre - half, centre + half, lms.reshape(-1, 10), sc[:, None]], 1)[order]
        rows = r[order]
        if rows.size > self.top_k:  # each row's best top_k
            first = np.arange(rows.size) - np.searchsorted(rows, rows) < self.top_k
            cand, rows = cand[first], rows[first]
        if rows.size > NMS_GROUPED_MAX:  # a crowd: one IoU matrix per image instead of one for the batch
            ends = np.searchsorted(rows, np.arange(n + 1))  # rows is sorted
            return [self._finish(cand[ends[i] : ends[i + 1]], batch, i) for i in range(n)]
        keep = nms_grouped(cand[:, :4], rows, self.nms_threshold)
        return _detections(cand[keep], rows[keep], batch, n)

    def _finish_host(self, host: np.ndarray, batch: DetBatch, full: tuple[Tensor, ...] | None) -> list[list[Detection]]:
        """Detections of each real row from ``host (n, p·15 + 1)``: small rows through :func:`nms_rows` at once."""
        n = len(batch)
        p = (host.shape[1] - 1) // 15
        cand = host[:, :-1].reshape(n, p, 15)
        counts = host[:, -1].astype(np.int64)
        cap = min(NMS_ROWS_MAX, p)
        small = np.flatnonzero((counts > 0) & (counts <= cap))
        out: list[list[Detection]] = [[] for _ in range(n)]
        if small.size:
            c = int(counts[small].max())
            sub = cand[small, :c]
            keep = nms_rows(sub[..., :4], np.arange(c)[None, :] < counts[small, None], self.nms_threshold)
            out = _detections(sub[keep], np.broadcast_to(small[:, None], keep.shape)[keep], batch, n)
        for i in np.flatnonzero(counts > cap):
            c = int(counts[i])
            ci = self._rare_candidates(batch, int(i), c, full) if c > p else cand[i, :c]
            out[i] = self._finish(ci, batch, int(i))
        return out

    def _finish(self, cand: np.ndarray, batch: DetBatch, i: int) -> list[Detection]:
        """NMS, rescale and clip one image's candidates ``(c, 15)``."""
        kept = cand[nms(cand[:, :4], cand[:, 14], self.nms_threshold)]
        return _detections(kept, np.full(len(kept), i), batch, i + 1)[i]

    def detect(self, images: Sequence[np.ndarray]) -> list[list[Detection]]:
        """Faces in each ``(H, W, 3) uint8`` RGB image, by score, in its pixels."""
        return self.run_many([self.preprocess(images)])[0] if len(images) else []
