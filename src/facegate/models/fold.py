"""Folding eval-mode BatchNorm into the convolution or linear layer before it (the recognizers' ``fuse()``)."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn

from facegate.errors import InvalidParameterError


@torch.no_grad()
def fold_into(layer: nn.Conv2d | nn.Linear, bn: nn.modules.batchnorm._BatchNorm) -> None:
    """Fold ``bn`` into the ``layer`` before it, in place, computed in fp64 on the host (a GPU allocates nothing
    more; on ``meta`` for meta tensors: shapes only)."""
    assert bn.running_mean is not None and bn.running_var is not None
    host = layer.weight.device if layer.weight.device.type == "meta" else torch.device("cpu")

    def f64(t: Tensor) -> Tensor:
        return t.detach().to(host, torch.float64)

    scale = f64(bn.weight) / torch.sqrt(f64(bn.running_var) + bn.eps)
    b = f64(layer.bias) if layer.bias is not None else torch.zeros_like(scale)
    w = f64(layer.weight) * scale.reshape(-1, *([1] * (layer.weight.ndim - 1)))
    b = (b - f64(bn.running_mean)) * scale + f64(bn.bias)
    layer.weight.copy_(w.to(layer.weight.dtype))
    if layer.bias is None:
        layer.bias = nn.Parameter(
            b.to(layer.weight.device, layer.weight.dtype), requires_grad=layer.weight.requires_grad
        )
    else:
        layer.bias.copy_(b.to(layer.bias.dtype))


def fold_batchnorms(model: nn.Module) -> None:
    """:func:`fold_into` every BatchNorm registered right after the conv or linear layer that feeds it (in an
    ``nn.Sequential``, or a module whose forward runs its children in that order), in place; each becomes
    ``nn.Identity``. A BatchNorm after anything else stays. Idempotent; eval only (its running statistics)."""
    if model.training:
        kind = type(model).__name__
        raise InvalidParameterError(f"{kind}.fuse() folds eval BatchNorm statistics; call .eval() first")
    for parent in list(model.modules()):
        for (_, layer), (name, bn) in itertools.pairwise(list(parent.named_children())):
            if isinstance(layer, nn.Conv2d | nn.Linear) and isinstance(bn, nn.modules.batchnorm._BatchNorm):
                fold_into(layer, bn)
                setattr(parent, name, nn.Identity())
