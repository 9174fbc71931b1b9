"""benchmarks/activation_floor.py: the weights + largest layer floor, from shapes on the meta device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
af = pytest.importorskip("activation_floor")


def test_floor_is_weights_plus_the_largest_layers_input_and_output() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(), nn.AvgPool2d(4))
    row = af.floor("toy", net, batch=2, dtype_bytes=2)
    conv_in, conv_out = 2 * 3 * 112 * 112, 2 * 8 * 112 * 112  # ReLU's in + out are 2 × conv_out: larger
    assert row["peak_layer_type"] == "ReLU" and row["peak_layer_out_shape"] == [2, 8, 112, 112]
    assert row["peak_in_out_mib"] == round(2 * conv_out * 2 / af.MIB, 1)
    assert row["weights_mib"] == round(8 * 3 * 3 * 3 * 2 / af.MIB, 1)
    assert row["largest_output_mib"] == round(conv_out * 2 / af.MIB, 1) and conv_in < conv_out


def test_irse64_shapes_scale_with_the_batch() -> None:
    from facegate.models.irse import tiny_irse

    small, big = (af.floor("tiny", tiny_irse(), batch=b, dtype_bytes=2) for b in (4, 16))
    assert big["weights_mib"] == small["weights_mib"]
    assert big["peak_in_out_mib"] == pytest.approx(4 * small["peak_in_out_mib"], rel=0.05)
