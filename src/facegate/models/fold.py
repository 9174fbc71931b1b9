"""Folding eval-mode BatchNorm into the convolution or linear layer before it (pure functions).

Both recognizers use these in their ``fuse()``: fewer kernels per forward (which is what bounds small
batches under CUDA graphs), the same outputs up to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def fold_bn(weight: Tensor, bias: Tensor | None, bn: nn.modules.batchnorm._BatchNorm) -> tuple[Tensor, Tensor]:
    """Weight and bias of ``bn(layer(x))`` for a conv/linear ``layer``.

    Computed in fp64 and returned in ``weight``'s dtype. ``weight``: ``(C_out, ...)``; ``bias``:
    ``(C_out,)`` or ``None``; returns ``(weight' (C_out, ...), bias' (C_out,))``.
    """
    assert bn.running_mean is not None and bn.running_var is not None
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    b = bias.double() if bias is not None else torch.zeros_like(scale)
    new_w = weight.double() * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    new_b = (b - bn.running_mean.double()) * scale + bn.bias.double()
    return new_w.to(weight.dtype), new_b.to(weight.dtype)


@torch.no_grad()
def fold_into(layer: nn.Conv2d | nn.Linear, bn: nn.modules.batchnorm._BatchNorm) -> None:
    """Fold ``bn`` (which follows ``layer``) into ``layer`` in place; ``layer`` gains a bias if it had none."""
    w, b = fold_bn(layer.weight, layer.bias, bn)
    layer.weight.copy_(w)
    if layer.bias is None:
        layer.bias = nn.Parameter(b, requires_grad=layer.weight.requires_grad)
    else:
        layer.bias.copy_(b)


__all__ = ["fold_bn", "fold_into"]
