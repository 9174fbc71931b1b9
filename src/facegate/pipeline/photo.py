"""The photo stage: encoded photos → decoded, detected, aligned and embedded faces in one engine step on the device.

``prepare`` (overlapping the previous batch's ``execute``) checks the headers, decodes the JPEGs with one nvJPEG
call, builds the detector canvases and enqueues the detector, whose CUDA graph also chooses and aligns the face
(:mod:`facegate.pipeline.photo_select`). ``execute`` warps, embeds and copies the results to the host once.
Only JPEGs with the ``largest`` policy and no crops come here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from facegate.errors import FacegateError, NoFaceError
from facegate.io.decode import decode_batch
from facegate.models.detector import DetPending
from facegate.pipeline.align import ARCFACE_TEMPLATE, estimate_transforms
from facegate.pipeline.align_torch import pixel_to_theta, warp_theta
from facegate.pipeline.base import detector_batches, select_faces
from facegate.pipeline.photo_select import choose_and_align, geometry
from facegate.pipeline.results import PhotoFaces
from facegate.quality_reasons import FACE_COLS, FACE_ROWS, N_STATS, SHARP_SCALE, flat_fraction
from facegate.types import Detection, FaceSelect


@dataclass(slots=True)
class PreparedPhotos:
    """A batch after :meth:`PhotoStage.prepare`: ``decoded`` per photo a ``(3, H, W) uint8`` tensor or its error;
    ``photos`` the tensors only; ``det_batches`` ``(indices, DetBatch)`` per detector forward; ``det_pending`` the
    forwards ``prepare`` enqueued."""

    decoded: list[Any]
    photos: dict[int, torch.Tensor]
    det_batches: list[tuple[list[int], Any]]
    det_pending: DetPending


def crop_stats_torch(crops: torch.Tensor) -> torch.Tensor:
    """:func:`facegate.quality_reasons.crop_stats` on the device: ``(K, 112, 112, 3) uint8 → (K, 3) float32``."""
    face = crops[:, FACE_ROWS, FACE_COLS].float()
    # Python-scalar weights: a weight tensor made here would be a host→device copy per batch
    grey = 0.299 * face[..., 0] + 0.587 * face[..., 1] + 0.114 * face[..., 2]
    lap = grey[:, 1:-1, :-2] + grey[:, 1:-1, 2:] + grey[:, :-2, 1:-1] + grey[:, 2:, 1:-1] - 4.0 * grey[:, 1:-1, 1:-1]
    spread = grey.flatten(1).std(dim=1, unbiased=False)
    flat = flat_fraction(grey, spread)
    sharp = SHARP_SCALE * lap.flatten(1).var(dim=1, unbiased=False) / (spread**2 + 1.0)
    return torch.stack([sharp, grey.mean(dim=(1, 2)), flat], 1)


def warp_crops(photos: list[torch.Tensor], theta: torch.Tensor, max_float_bytes: int | None) -> list[torch.Tensor]:
    """``(k, 112, 112, 3) uint8`` crops of ``photos`` (``(3, H, W)``, one size) by ``theta (k, 2, 3)``, warped in runs
    of photos whose float32 copy fits in ``max_float_bytes`` (at least one photo per run; ``None``: one run)."""
    step = len(photos) if max_float_bytes is None else max(1, max_float_bytes // (4 * photos[0].numel()))
    runs = (warp_theta(torch.stack(photos[a : a + step]), theta[a : a + step]) for a in range(0, len(photos), step))
    return [w.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1) for w in runs]


def _warp_rows(
    photos: dict[int, torch.Tensor], keys: list[int], theta: torch.Tensor, max_float_bytes: int | None
) -> tuple[torch.Tensor, list[int]]:
    """``(K, 112, 112, 3) uint8`` crops of ``photos[keys[k]]`` by ``theta[k]`` (``(K, 2, 3)`` on their device), warped
    per photo size, and each crop's photo."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for k, i in enumerate(keys):
        by_shape.setdefault(tuple(photos[i].shape), []).append(k)
    crops: list[torch.Tensor] = []
    for ks in by_shape.values():
        rows: slice | torch.Tensor = slice(ks[0], ks[0] + len(ks))  # a run (LFW: the whole batch): no index copy
        if ks != list(range(ks[0], ks[0] + len(ks))):  # non-blocking: a blocking copy waits for all queued work
            rows = torch.tensor(ks, pin_memory=theta.is_cuda).to(theta.device, non_blocking=True)
        crops += warp_crops([photos[keys[k]] for k in ks], theta[rows], max_float_bytes)
    return torch.cat(crops).contiguous(), [keys[k] for ks in by_shape.values() for k in ks]


def _warp(
    photos: dict[int, torch.Tensor], chosen: dict[int, Detection], max_float_bytes: int | None
) -> tuple[torch.Tensor, list[int]]:
    """:func:`_warp_rows` of the chosen face of each photo, aligned by its landmarks (the host rule's crops)."""
    keys = list(chosen)
    hw = np.array([tuple(photos[i].shape[1:]) for i in keys])
    mats = estimate_transforms(np.stack([chosen[i].landmarks for i in keys]))
    theta = pixel_to_theta(mats, hw[:, 0], hw[:, 1], photos[keys[0]].device)
    return _warp_rows(photos, keys, theta, max_float_bytes)


def _photo_faces(det: Detection, row: np.ndarray) -> PhotoFaces:
    """The :class:`PhotoFaces` of one face (its photo's largest) from its row ``(d + 2 + N_STATS,)`` float32: the
    recognizer's outputs, then the crop's statistics."""
    d = len(row) - 2 - N_STATS
    emb, stats = row[None, :d].copy(), row[None, d + 2 :].copy()
    return PhotoFaces([det], emb, row[d : d + 1].copy(), row[d + 1 : d + 2].copy(), stats)


class PhotoStage:
    """Engine stage ``photo``: the ``(n,) uint8`` bytes of one encoded photo → :class:`PhotoFaces`; an item that
    fails (bad image, no face) fails alone."""

    name = "photo"

    def __init__(self, pipeline: Any, *, max_bytes: int, max_pixels: int) -> None:
        self.p = pipeline
        self.max_bytes = int(max_bytes)
        self.max_pixels = int(max_pixels)
        if pipeline._photo_select_post is None:  # one per pipeline: the detector captures a graph per shape and post
            dst = torch.tensor(ARCFACE_TEMPLATE, device=pipeline.device)
            post = functools.partial(choose_and_align, iou_threshold=pipeline.detector.nms_threshold, dst=dst)
            pipeline._photo_select_post = post
        self._post = pipeline._photo_select_post

    def prepare(self, payloads: list[np.ndarray]) -> PreparedPhotos:
        datas = [np.ascontiguousarray(p, dtype=np.uint8).tobytes() for p in payloads]
        decoded = decode_batch(datas, self.p.device, max_bytes=self.max_bytes, max_pixels=self.max_pixels)
        photos = {i: t for i, t in enumerate(decoded) if not isinstance(t, FacegateError)}
        keys = list(photos)
        sizes = [(int(photos[i].shape[1]), int(photos[i].shape[2])) for i in keys]
        det = self.p.detector
        batches = [  # the detector canvases, on the device
            ([keys[j] for j in idx], det.preprocess_tensors([photos[keys[j]] for j in idx]))
            for idx in detector_batches(sizes, det, None)
        ]
        canvases = [b for _, b in batches]
        pending = det.enqueue_many(
            canvases, keep_on_device=True, post=self._post, post_args=[geometry(b) for b in canvases]
        )
        return PreparedPhotos(decoded, photos, batches, pending)

    def execute(self, prepared: PreparedPhotos) -> list[Any]:
        return self.execute_with(prepared)[0]

    @torch.inference_mode()
    def execute_with(
        self, prepared: PreparedPhotos, extra: Callable[[torch.Tensor, list[int]], Any] | None = None
    ) -> tuple[list[Any], np.ndarray | None, set[int]]:
        """Per photo a :class:`PhotoFaces` (its largest face) or its FacegateError; then ``extra``'s host copy and the
        photos whose rows in it are void (settled by the host rule: not exact on the device).

        The host waits once, for one array. ``extra(embeddings (K, D) float32 on the device, owners)`` may queue
        more device work and return a float32 device tensor (or None), copied back in the same wait.
        """
        decoded, photos = prepared.decoded, prepared.photos
        out: list[Any] = [t if isinstance(t, FacegateError) else None for t in decoded]
        det, pending = self.p.detector, prepared.det_pending
        assert pending.post_out is not None
        order = [i for idx, _ in prepared.det_batches for i in idx]
        if not order:
            return out, None, set()
        chosen, flags, theta = (torch.cat(parts) for parts in zip(*pending.post_out, strict=True))
        pos = {i: k for k, i in enumerate(order)}
        crops, owners = _warp_rows(photos, order, theta, self.p.photo_warp_bytes)
        rec = self.p.recognize(crops)
        res = torch.cat([rec, crop_stats_torch(crops)], 1)
        more = extra(rec[:, :-2], owners) if extra is not None else None
        parts = [torch.cat([chosen, flags], 1).to(res.device), res, *([more] if more is not None else [])]
        got = torch.cat([t.flatten() for t in parts]).cpu().numpy()  # the one wait
        meta, host, *more_host = np.split(got, np.cumsum([t.numel() for t in parts])[:-1])
        meta, host = meta.reshape(len(order), -1), host.reshape(res.shape)
        fallback: set[int] = set()
        for r, i in enumerate(owners):
            m = meta[pos[i]]  # chosen (box, landmarks, score), then flags (has a face, exact)
            if not m[16]:
                fallback.add(i)
            elif not m[15]:
                out[i] = NoFaceError("no face found in the image")
            else:
                lm, wh = m[4:14].reshape(5, 2).copy(), (int(photos[i].shape[2]), int(photos[i].shape[1]))
                face = Detection(box=m[:4].copy(), landmarks=lm, score=float(m[14]), photo_wh=wh)
                out[i] = _photo_faces(face, host[r])
        if fallback:  # the host rule for the photos the device could not settle exactly
            found = det.finish_many(pending)
            chosen_fb: dict[int, Detection] = {}
            for (idx, _), per_batch in zip(prepared.det_batches, found, strict=True):
                for i, dets in zip(idx, per_batch, strict=True):
                    if i in fallback:
                        try:
                            chosen_fb[i] = select_faces(dets, FaceSelect.LARGEST)[0]
                        except FacegateError as exc:
                            out[i] = exc
            if chosen_fb:
                fb_crops, fb_owners = _warp(photos, chosen_fb, self.p.photo_warp_bytes)
                fb_res = torch.cat([self.p.recognize(fb_crops), crop_stats_torch(fb_crops)], 1).cpu().numpy()
                for r, i in enumerate(fb_owners):
                    out[i] = _photo_faces(chosen_fb[i], fb_res[r])
        return out, more_host[0] if more_host else None, fallback
