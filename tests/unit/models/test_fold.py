"""BatchNorm folding: the folded layer computes what layer → BatchNorm computed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from facegate.errors import InvalidParameterError
from facegate.models.fold import fold_batchnorms, fold_into


def _bn(cls: type[nn.modules.batchnorm._BatchNorm], n: int, seed: int) -> nn.modules.batchnorm._BatchNorm:
    g = torch.Generator().manual_seed(seed)
    bn = cls(n, eps=1e-3).eval()
    bn.running_mean.copy_(torch.randn(n, generator=g))
    bn.running_var.copy_(0.2 + torch.rand(n, generator=g))
    bn.weight.data.copy_(torch.randn(n, generator=g))
    bn.bias.data.copy_(torch.randn(n, generator=g))
    return bn


@pytest.mark.parametrize("bias", [False, True])
def test_fold_into_conv(bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 8, 3, padding=1, bias=bias)
    bn = _bn(nn.BatchNorm2d, 8, 1)
    x = torch.randn(2, 6, 9, 9)
    with torch.no_grad():
        want = bn(conv(x))
        folded = copy.deepcopy(conv)
        fold_into(folded, bn)
        got = folded(x)
    assert folded.bias is not None and folded.bias.shape == (8,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fold_into_linear_with_bias() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(10, 4)
    bn = _bn(nn.BatchNorm1d, 4, 2)
    x = torch.randn(5, 10)
    with torch.no_grad():
        want = bn(lin(x))
        fold_into(lin, bn)
        got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fold_bn_by_hand() -> None:
    """One channel: w·x → γ(w·x − μ)/√(σ²+ε) + β, so w' = γw/√(σ²+ε) and b' = β − γμ/√(σ²+ε)."""
    bn = nn.BatchNorm1d(1, eps=0.0).eval()
    bn.running_mean.fill_(2.0)
    bn.running_var.fill_(4.0)
    bn.weight.data.fill_(3.0)
    bn.bias.data.fill_(1.0)
    lin = nn.Linear(1, 1, bias=False)
    lin.weight.data.fill_(5.0)
    fold_into(lin, bn)
    assert lin.bias is not None
    assert lin.weight.item() == pytest.approx(3.0 * 5.0 / 2.0) and lin.bias.item() == pytest.approx(
        1.0 - 3.0 * 2.0 / 2.0
    )


def test_fold_batchnorms_folds_only_a_bn_right_after_a_conv_or_linear() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(_bn(nn.BatchNorm2d, 6, 1), nn.Conv2d(6, 8, 3, padding=1), _bn(nn.BatchNorm2d, 8, 2), nn.ReLU())
    seq.append(_bn(nn.BatchNorm2d, 8, 3)).eval()
    x = torch.randn(2, 6, 9, 9)
    with torch.no_grad():
        want = seq(x)
        fold_batchnorms(seq)
        got = seq(x)
    assert [type(m) for m in seq] == [nn.BatchNorm2d, nn.Conv2d, nn.Identity, nn.ReLU, nn.BatchNorm2d]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fold_batchnorms_needs_eval() -> None:
    with pytest.raises(InvalidParameterError, match=r"Sequential.fuse\(\) folds eval BatchNorm statistics"):
        fold_batchnorms(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
