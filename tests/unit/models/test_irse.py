"""IR-SE-64-RTS: exact ModelScope layout, counts, FLOPs, strict loading and its failure modes."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from facegate.errors import CheckpointError, InvalidParameterError, ModelError
from facegate.models.irse import IRSE64RTS, Subsample, check_state_dict, load_rts_checkpoint, tiny_irse

ALPHA = 16  # an RTS+ width consistent with the 47.8 M parameter target


@pytest.fixture(scope="module")
def meta_model() -> IRSE64RTS:
    with torch.device("meta"):
        return IRSE64RTS(ALPHA).eval()


def _cheap_full_state_dict(alpha: int = ALPHA) -> dict[str, torch.Tensor]:
    """Every key and shape of the full model, each tensor a broadcast scalar (tiny on disk)."""
    with torch.device("meta"):
        ref = IRSE64RTS(alpha)
    return {k: torch.full((), 0.5, dtype=v.dtype).expand(v.shape) for k, v in ref.state_dict().items()}


def test_full_model_counts_and_layout(meta_model: IRSE64RTS) -> None:
    sd = meta_model.state_dict()
    assert len(sd) == 501
    n_bn = sum(isinstance(m, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d) for m in meta_model.modules())
    assert (
        sum(k.endswith("num_batches_tracked") for k in sd) == n_bn == 68
    )  # stem 1 + 30x2 + 3 shortcuts + features.2.0 + 3 heads
    n_params = sum(p.numel() for p in meta_model.parameters())
    assert n_params == 47_792_883  # 47.8 M
    # only the RTS+ head depends on alpha: Linear(25088→alpha) + BN1d(alpha) affine
    assert n_params - ALPHA * (25088 + 1 + 2) == 47_391_427
    units = meta_model.features[1]
    assert len(units) == 30
    assert [type(u.shortcut_layer).__name__ for u in units].count("MaxPool2d") == 27
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert shapes["features.0.0.weight"] == (64, 3, 3, 3)
    assert shapes["features.0.2.weight"] == (64,)
    assert shapes["features.1.0.res_layer.1.weight"] == (64, 64, 3, 3)
    assert shapes["features.1.0.res_layer.5.fc1.weight"] == (4, 64, 1, 1)
    assert shapes["features.1.0.res_layer.5.fc2.weight"] == (64, 4, 1, 1)
    assert "features.1.0.shortcut_layer.0.weight" not in shapes  # MaxPool2d(1, 2): no parameters
    assert shapes["features.1.3.shortcut_layer.0.weight"] == (128, 64, 1, 1)
    assert shapes["features.1.3.shortcut_layer.1.num_batches_tracked"] == ()
    assert shapes["features.1.11.shortcut_layer.0.weight"] == (256, 128, 1, 1)
    assert shapes["features.1.27.shortcut_layer.0.weight"] == (512, 256, 1, 1)
    assert shapes["features.1.29.res_layer.5.fc1.weight"] == (32, 512, 1, 1)
    assert shapes["features.2.0.running_var"] == (512,)
    assert shapes["features_backbone.0.weight"] == (512, 25088)
    assert shapes["features_backbone.1.running_mean"] == (512,)
    assert shapes["logvar_rts_backbone.0.weight"] == (1, 25088)
    assert shapes["logvar_rts_backbone.1.weight"] == (1,)
    assert shapes["logvar_rts_plus_backbone.0.weight"] == (ALPHA, 25088)
    assert not any("bias" in k for k in shapes if k.startswith("features.1.") and ".fc" in k)


def test_full_model_flops(meta_model: IRSE64RTS) -> None:
    x = torch.empty(1, 3, 112, 112, device="meta")
    with FlopCounterMode(display=False) as counter:
        emb, logvar = meta_model(x)
    assert emb.shape == (1, 512) and logvar.shape == (1, 1)
    flops = counter.get_total_flops()  # FlopCounterMode counts 2 FLOPs per multiply-accumulate
    assert flops == 15_368_048_640
    assert round(flops / 1e9, 1) == 15.4  # so "15.4 GFLOP" is 2 x 7.68 GMAC


def test_full_model_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = IRSE64RTS(alpha=7).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "pytorch_model.pt"
    torch.save(model.state_dict(), path)
    loaded = load_rts_checkpoint(path)
    assert loaded.alpha == 7 and not loaded.training
    x = torch.randn(1, 3, 112, 112)
    with torch.no_grad():
        e0, v0 = model(x)
        e1, v1 = loaded(x)
    assert torch.equal(e0, e1) and torch.equal(v0, v1)
    assert e0.shape == (1, 512) and v0.shape == (1, 1)


def test_alpha_inferred_and_module_prefix_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sd = {"module." + k: v for k, v in _cheap_full_state_dict(alpha=9).items()}
    path = tmp_path / "dp.pt"
    torch.save(sd, path)
    with caplog.at_level(logging.WARNING, logger="facegate.models.irse"):
        model = load_rts_checkpoint(path)
    assert model.alpha == 9
    assert model.logvar_rts_plus_backbone[1].running_var.shape == (9,)
    assert any("module." in r.getMessage() for r in caplog.records)


def _save(tmp_path: Path, sd: dict[str, torch.Tensor], name: str = "ckpt.pt") -> Path:
    path = tmp_path / name
    torch.save(sd, path)
    return path


def test_missing_key_is_named(tmp_path: Path) -> None:
    sd = _cheap_full_state_dict()
    key = "features.1.5.res_layer.5.fc2.weight"
    del sd[key]
    with pytest.raises(CheckpointError) as ei:
        load_rts_checkpoint(_save(tmp_path, sd))
    assert key in ei.value.message and "1 missing" in ei.value.message
    assert ei.value.detail["missing"] == [key] and ei.value.detail["missing_count"] == 1
    assert ei.value.detail["unexpected_count"] == 0 and ei.value.detail["mismatched_count"] == 0


def test_unexpected_key_is_named(tmp_path: Path) -> None:
    sd = _cheap_full_state_dict()
    key = "features.1.30.res_layer.0.weight"
    sd[key] = torch.zeros(512)
    with pytest.raises(CheckpointError) as ei:
        load_rts_checkpoint(_save(tmp_path, sd))
    assert key in ei.value.message and ei.value.detail["unexpected"] == [key]
    assert ei.value.detail["missing_count"] == 0


def test_misshaped_key_is_named(tmp_path: Path) -> None:
    sd = _cheap_full_state_dict()
    sd["features_backbone.0.weight"] = torch.zeros(512, 100)
    with pytest.raises(CheckpointError) as ei:
        load_rts_checkpoint(_save(tmp_path, sd))
    assert "features_backbone.0.weight" in ei.value.message
    (entry,) = ei.value.detail["mismatched_shapes"]
    assert entry.startswith("features_backbone.0.weight") and "(512, 100)" in entry and "(512, 25088)" in entry


def test_many_mismatches_are_counted_and_truncated(tmp_path: Path) -> None:
    sd = {k: v.clone() for k, v in tiny_irse().state_dict().items()}  # a different (tiny) architecture
    with pytest.raises(CheckpointError) as ei:
        load_rts_checkpoint(_save(tmp_path, sd))
    d = ei.value.detail
    assert d["missing_count"] > 10 and len(d["missing"]) == 10
    assert d["mismatched_count"] > 0
    assert f"{d['missing_count']} missing" in ei.value.message
    assert d["missing"][0] in ei.value.message


def test_check_state_dict_accepts_exact_match(meta_model: IRSE64RTS) -> None:
    check_state_dict(meta_model, meta_model.state_dict())  # no exception


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_file_is_refused(tmp_path: Path) -> None:
    scripted = torch.jit.trace(tiny_irse(), torch.randn(2, 3, 112, 112))
    path = tmp_path / "scripted.pt"
    torch.jit.save(scripted, str(path))
    with pytest.raises(CheckpointError, match="TorchScript") as ei:
        load_rts_checkpoint(path)
    assert ei.value.detail["reason"] == "torchscript"


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a torch file")
    with pytest.raises(CheckpointError, match="Cannot read") as ei:
        load_rts_checkpoint(junk)
    assert ei.value.detail["reason"] == "unreadable"
    with pytest.raises(CheckpointError, match="does not exist"):
        load_rts_checkpoint(tmp_path / "nope.pt")


def test_training_checkpoint_is_not_a_plain_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "train.pt"
    torch.save({"state_dict": {"a": torch.zeros(1)}, "epoch": 3}, path)
    with pytest.raises(CheckpointError, match="not a plain state_dict") as ei:
        load_rts_checkpoint(path)
    assert sorted(ei.value.detail["non_tensor_keys"]) == ["epoch", "state_dict"]
    assert isinstance(ei.value, ModelError)


def test_tiny_model_forward_shapes_and_determinism() -> None:
    model = tiny_irse(seed=0, alpha=4)
    assert not model.training
    keys = model.state_dict().keys()
    assert "features.1.0.res_layer.5.fc1.weight" in keys and "logvar_rts_plus_backbone.0.weight" in keys
    x = torch.randn(3, 3, 112, 112)
    with torch.no_grad():
        feats = model.features(x)
        emb, logvar = model(x)
        emb2, _ = tiny_irse(seed=0, alpha=4)(x)
        emb3, _ = tiny_irse(seed=1, alpha=4)(x)
    assert feats.shape == (3, model.feature_dim) == (3, 64 * 7 * 7)
    assert emb.shape == (3, 512) and logvar.shape == (3, 1)
    assert torch.isfinite(emb).all() and torch.isfinite(logvar).all()
    assert torch.equal(emb, emb2) and not torch.allclose(emb, emb3)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_fuse_folds_batchnorms_and_keeps_outputs() -> None:
    model = tiny_irse(seed=3, alpha=4)
    x = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats0 = model.features(x)
        emb0, logvar0 = model(x)
    fused = copy.deepcopy(model).fuse()
    assert isinstance(fused.features[0][1], torch.nn.Identity)  # the stem's BN, folded
    assert isinstance(model.features[0][1], torch.nn.BatchNorm2d)  # the copy: the model itself is unchanged
    assert fused.fuse() is fused  # idempotent
    units = list(fused.features[1])
    assert all(isinstance(u.res_layer[4], torch.nn.Identity) for u in units)
    assert all(isinstance(u.res_layer[0], torch.nn.BatchNorm2d) for u in units)  # before a padded conv: kept
    # tiny_irse: the first unit keeps 16 channels (stride 2: MaxPool2d(1, 2) → a strided view), the rest convolve
    assert isinstance(units[0].shortcut_layer, Subsample) and units[0].shortcut_layer.stride == 2
    assert all(isinstance(u.shortcut_layer[1], torch.nn.Identity) for u in units[1:])
    assert isinstance(fused.features[2][0], torch.nn.BatchNorm2d)  # the trunk's output is unchanged
    n_bn = sum(isinstance(m, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d) for m in fused.modules())
    assert n_bn == len(units) + 1
    with torch.no_grad():
        feats1 = fused.features(x)
        emb1, logvar1 = fused(x)
    torch.testing.assert_close(feats1, feats0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(emb1, emb0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logvar1, logvar0, rtol=1e-4, atol=1e-5)


def test_fuse_of_the_full_layout_turns_identity_shortcuts_into_views() -> None:
    with torch.device("meta"):
        model = IRSE64RTS(ALPHA).eval()
    model.fuse()
    shortcuts = [u.shortcut_layer for u in model.features[1]]
    views = [s.stride for s in shortcuts if isinstance(s, Subsample)]
    assert views == [2] + [1] * 26  # 27 MaxPool2d(1, s) shortcuts; the other 3 are folded 1×1 convs
    assert sum(isinstance(s, torch.nn.Sequential) for s in shortcuts) == 3


def test_subsample_matches_maxpool_1() -> None:
    x = torch.randn(2, 4, 7, 7)
    for s in (1, 2):
        torch.testing.assert_close(Subsample(s)(x), torch.nn.MaxPool2d(1, s)(x), rtol=0, atol=0)


def test_fuse_requires_eval() -> None:
    model = tiny_irse(seed=0).train()
    with pytest.raises(InvalidParameterError, match="eval"):
        model.fuse()
