"""Folding eval-mode BatchNorm into the convolution or linear layer before it (pure functions).

Both recognizers use these in their ``fuse()``: fewer kernels per forward (which is what bounds small
batches under CUDA graphs), the same outputs up to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def fold_bn(weight: Tensor, bias: Tensor | None, bn: nn.modules.batchnorm._BatchNorm) -> tuple[Tensor, Tensor]:
    """Weight and bias of ``bn(layer(x))`` for a conv/linear ``layer``.

    Computed in fp64 on the host and returned in ``weight``'s dtype, on its device: an fp64 copy of a large
    layer on the GPU (SFace's ``pre_fc1``: 49 MiB, twice over) would stay reserved by the caching allocator.
    ``weight``: ``(C_out, ...)``; ``bias``: ``(C_out,)`` or ``None``; returns ``(weight' (C_out, ...), bias'
    (C_out,))``.
    """
    assert bn.running_mean is not None and bn.running_var is not None

    host = weight.device if weight.device.type == "meta" else torch.device("cpu")  # meta: shapes only

    def f64(t: Tensor) -> Tensor:
        return t.detach().to(host, torch.float64)

    scale = f64(bn.weight) / torch.sqrt(f64(bn.running_var) + bn.eps)
    b = f64(bias) if bias is not None else torch.zeros_like(scale)
    new_w = f64(weight) * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    new_b = (b - f64(bn.running_mean)) * scale + f64(bn.bias)
    return new_w.to(weight.device, weight.dtype), new_b.to(weight.device, weight.dtype)


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
