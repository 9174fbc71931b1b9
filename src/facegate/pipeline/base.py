"""What the pipeline's stages share below :class:`~facegate.pipeline.pipeline.FacePipeline` (the import contract
keeps them from importing it): the face-selection rule and the detector's batch grouping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from facegate.errors import NoFaceError
from facegate.types import Detection, FaceSelect


def detector_batches(sizes: Sequence[tuple[int, int]], detector: Any, max_rows: int | None) -> list[list[int]]:
    """Image indices per ``detector`` forward: images of one padded size (so each result equals the one the image
    gets alone), at most ``max_rows`` images and the detector's ``max_batch_pixels`` padded pixels per forward (at
    least one image)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (h, w) in enumerate(sizes):
        groups.setdefault(detector.padded_hw(h, w), []).append(i)
    out = []
    for (hp, wp), idx in groups.items():
        step = max_rows or len(idx)
        if detector.max_batch_pixels:
            step = min(step, max(1, detector.max_batch_pixels // (hp * wp)))
        out += [idx[k : k + step] for k in range(0, len(idx), step)]
    return out


def select_faces(detections: Sequence[Detection], select: FaceSelect | str = FaceSelect.LARGEST) -> list[Detection]:
    """Apply a face-selection policy to one image's detections (sorted by score, descending); NoFaceError without
    any."""
    select = FaceSelect(select)
    if not detections:
        raise NoFaceError("no face found in the image")
    if select is FaceSelect.ALL:
        return list(detections)
    return [max(detections, key=lambda d: d.area)]
