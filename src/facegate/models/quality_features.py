"""What an RTS quality head reads from SFace: the trunk's 1024 channels average-pooled over the 7×7 grid, then the
raw 128-d embedding (1,152 numbers; IR-SE-64's heads read its flattened 25,088-d features)."""

from __future__ import annotations

import torch
from torch import Tensor


def sface_head_input(embedding_raw: Tensor, features_flat: Tensor, channels: int = 1024) -> Tensor:
    """``(N, D)`` raw embedding, ``(N, C·7·7)`` flattened trunk → ``(N, C + D)`` in the features' dtype."""
    n = features_flat.shape[0]
    pooled = features_flat.reshape(n, channels, -1).mean(dim=2)
    return torch.cat([pooled, embedding_raw.to(pooled.dtype)], dim=1)


def head_input_dim(embedding_dim: int, channels: int = 1024) -> int:
    return channels + embedding_dim
