"""Bounded-activation trunks (models/chunked.py): the split rule, and outputs equal to the unsplit forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from facegate.models.chunked import ActivationPlan, run_trunk
from facegate.models.irse import IRSE64RTS
from facegate.models.recognizer import build_recognizer
from facegate.models.registry import IRSE64_RTS, SFACE, WeightsSource
from facegate.runtime.kernels import set_fused_epilogues

TINY_IRSE = dataclasses.replace(IRSE64_RTS, weights=WeightsSource("random"))
TINY_SFACE = dataclasses.replace(SFACE, weights=WeightsSource("random"))


def _crops(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 112, 112, 3), dtype=torch.uint8, generator=g)


def test_split_runs_the_large_stages_in_sub_batches() -> None:
    # per-crop peaks fall 16x across four stages; outputs likewise
    plan = ActivationPlan(stage_peak=(160, 40, 10, 10), stage_out=(40, 10, 10, 5), budget_elems=640)
    assert plan.split(4) == (0, 4)  # 4 x 160 fits: one pass
    assert plan.split(8) == (1, 2)  # 8 x 40 from stage 1 on fits half; the sub-batches get the other 320
    assert plan.split(16) == (2, 3)  # 16 x 10 from stage 2 on; (640 - 16 x 10) // 160 = 3 crops at a time
    assert plan.split(64) == (4, 2)  # no boundary fits: every stage in sub-batches into the features' buffer
    assert plan.split(128) == (4, 1)  # the buffer fills the budget: one crop at a time, never fewer
    assert dataclasses.replace(plan, budget_elems=100).split(8) == (4, 1)


def test_a_later_stage_larger_than_the_first_splits_the_batch() -> None:
    """SFace's first block holds more per crop than its stem: the whole batch runs in one pass only when every
    stage fits (10 SFace crops fit the stem's peak under a 16 MiB budget but not the first block's)."""
    plan = ActivationPlan(stage_peak=(100, 400, 10), stage_out=(100, 50, 5), budget_elems=1000)
    assert plan.split(2) == (0, 2)  # 2 x 400 fits
    assert plan.split(10) == (2, 1)  # 10 x 100 fits the stem, not the block: (1000 - 10 x 50) // 400 = 1


def test_measure_counts_the_stage_input_and_its_largest_layer() -> None:
    stages = [nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU()), nn.Sequential(nn.Conv2d(8, 4, 3, 2, 1), nn.Flatten())]
    plan = ActivationPlan.measure(stages, torch.zeros(1, 3, 8, 8), budget_bytes=4096)
    assert plan.stage_out == (8 * 64, 4 * 16)
    # stage input + the largest layer's input + output (the ReLU's: 8 x 64 each; the second conv's: 512 + 64)
    assert plan.stage_peak == (3 * 64 + 2 * 8 * 64, 8 * 64 + 8 * 64 + 4 * 16)
    assert plan.budget_elems == 1024  # fp32: 4 bytes an element


def test_run_trunk_places_mirrored_rows_after_the_originals() -> None:
    stages = [nn.Sequential(nn.Conv2d(3, 6, 3, 1, 1)), nn.Sequential(nn.Conv2d(6, 2, 3, 2, 1), nn.Flatten())]
    x = torch.randn(10, 3, 8, 8)
    rows = lambda a, b: torch.cat([x[a:b], x[a:b].flip(3)])  # noqa: E731
    whole = rows(0, 10)
    for stage in stages:
        whole = stage(whole)
    plan = ActivationPlan.measure(stages, x[:1], budget_bytes=4 * 1200)
    assert plan.split(10) == (2, 1), plan
    torch.testing.assert_close(run_trunk(stages, plan, 10, rows), whole, rtol=1e-5, atol=1e-6)
    assert plan.split(10)[1] < 10  # it did run in sub-batches


@pytest.mark.parametrize("spec", [TINY_IRSE, TINY_SFACE], ids=["irse64_rts", "sface"])
@pytest.mark.parametrize("flip", [False, True])
def test_recognizer_with_a_budget_equals_the_unsplit_forward(spec: object, flip: bool) -> None:
    rec = build_recognizer(spec).eval()  # type: ignore[arg-type]
    rec.flip_tta = flip
    crops = _crops(9, seed=3)
    with torch.inference_mode():
        want = rec(crops)
        for mib in (0.5, 2.0, 8.0):  # every stage in ones; some stages; (nearly) none
            plan = rec.set_activation_budget(mib)
            assert plan is not None
            got = rec(crops)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert rec.set_activation_budget(0.5).split(9)[1] == 1  # type: ignore[union-attr]
        assert rec.set_activation_budget(None) is None and rec.activation_plan is None
        for g, w in zip(rec(crops), want, strict=True):
            torch.testing.assert_close(g, w)


def test_the_budget_is_not_a_registered_submodule() -> None:
    rec = build_recognizer(TINY_SFACE).eval()
    keys = set(rec.state_dict())
    rec.set_activation_budget(1.0)
    assert set(rec.state_dict()) == keys


def test_real_sface_plan_at_fp16_sizes() -> None:
    """SFace's first stages hold ~1.5-3.8 MiB per crop in fp16 and its features 0.1 MiB: a 24 MiB budget runs a
    batch of 64 four at a time through every stage, 64 MiB runs its last stages on the whole batch."""
    rec = build_recognizer(SFACE).eval()
    rec.backbone.fuse()
    plan = rec.set_activation_budget(16.0)
    assert plan is not None
    assert max(plan.stage_peak) * 2 / 2**20 == pytest.approx(3.83, abs=0.01)
    assert dataclasses.replace(plan, budget_elems=24 * 2**20 // 2).split(64) == (len(plan.stage_peak), 4)
    assert dataclasses.replace(plan, budget_elems=64 * 2**20 // 2).split(64) == (12, 13)


def test_irse_stages_compose_to_the_trunk() -> None:
    m = IRSE64RTS(units=(1, 1, 1, 1), widths=(16, 16, 32, 32)).eval()
    x = torch.randn(2, 3, 112, 112)
    with torch.inference_mode():
        h = x
        for s in m.stages():
            h = s(h)
        torch.testing.assert_close(h, m.features(x))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SFACE, TINY_IRSE], ids=["sface", "irse64_rts_random"])
def test_cuda_budget_bounds_the_forward_peak(spec: object) -> None:
    """fp16 on CUDA at batch 64: with a 16 MiB budget the forward's peak allocation above the weights is at most
    1.25x the budget and under half the unsplit forward's, and the embeddings agree."""
    rec = build_recognizer(spec, device="cuda", dtype="fp16", channels_last=True).eval()  # type: ignore[arg-type]
    rec.backbone.fuse()
    set_fused_epilogues(rec.backbone, True)  # as the pipeline runs it: conv bias + PReLU in one kernel
    x = _crops(64, seed=1).cuda()

    def peak_above_base() -> tuple[float, tuple[torch.Tensor, ...]]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            out = rec(x)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, out

    full_mib, want = peak_above_base()
    rec.set_activation_budget(16.0)
    split_mib, got = peak_above_base()
    assert split_mib < 0.5 * full_mib, (split_mib, full_mib)
    assert split_mib <= 16.0 * 1.25, split_mib  # the estimate's margin: cuDNN workspaces come on top
    assert float((got[0] * want[0]).sum(1).min()) > 0.999
    assert float((got[1] - want[1]).abs().max()) < 0.01
    # every batch size keeps to it, not only the largest: the engine pads batches to 4, 16, 32 and 64 crops
    # (a budget checked at the largest batch alone once let 10 SFace crops run unsplit, past the budget)
    full = x
    for n in (2, 4, 10, 16, 20, 32):
        x = full[:n]
        n_mib, _ = peak_above_base()
        assert n_mib <= 16.0 * 1.25, (n, n_mib)
