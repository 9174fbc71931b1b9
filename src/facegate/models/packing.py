"""All of a model's GPU weights in one allocation (pure function over modules).

PyTorch's caching allocator serves every tensor of 1-10 MiB from a segment of 20 MiB and every smaller one
from segments of 2 MiB, so a network's few hundred parameter tensors hold more device memory than their
bytes: on the H200, SFace + YuNet's 18.6 MiB of weights kept 26 MiB reserved, IR-SE-64's 92.3 MiB 114 MiB
(benchmarks/results/serve_memory_gpu_run45.json). :func:`pack_parameters` copies every parameter and buffer
into views of one byte buffer, so they cost one allocation rounded up to 2 MiB. Strides (channels_last),
dtypes and sharing between modules are kept; values are copied bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

#: byte alignment of each tensor in the buffer (cuDNN and Triton kernels vectorise on 16 bytes and more)
ALIGN = 512


def _span(t: Tensor) -> int:
    """Elements a tensor's strides reach: ``1 + Σ (size-1)·stride`` (its numel when dense), 0 when empty."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))


def pack_parameters(modules: Sequence[nn.Module], device: torch.device | str) -> int:
    """Move every parameter and buffer of ``modules`` that lives on ``device`` into one buffer; returns its
    size in bytes (0 when there is nothing to pack).

    Each tensor is replaced by a view with its own shape, strides and dtype (parameters through ``.data``, so
    the ``Parameter`` objects and any sharing between modules stay). The old storages are freed when nothing
    else refers to them; call ``torch.cuda.empty_cache()`` after to hand their segments back to the driver.
    Call it before capturing CUDA graphs or compiling: those keep the addresses they saw.
    """
    dev = torch.device(device)
    seen: dict[int, Tensor] = {}
    owners: list[tuple[nn.Module, str, bool, Tensor]] = []  # (module, name, is_parameter, tensor)
    for module in modules:
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and p.device == dev:
                    owners.append((m, name, True, p))
                    seen.setdefault(id(p), p)
            for name, b in m._buffers.items():
                if b is not None and b.device == dev:
                    owners.append((m, name, False, b))
                    seen.setdefault(id(b), b)
    offsets: dict[int, int] = {}
    total = 0
    for key, t in seen.items():
        offsets[key] = total
        total += -(-_span(t) * t.element_size() // ALIGN) * ALIGN
    if total == 0:
        return 0
    buf = torch.empty(total, dtype=torch.uint8, device=dev)
    packed: dict[int, Tensor] = {}
    with torch.no_grad():
        for key, t in seen.items():
            nbytes = _span(t) * t.element_size()
            flat = buf[offsets[key] : offsets[key] + nbytes].view(t.dtype)
            view = flat.as_strided(t.shape, t.stride()) if t.numel() else flat[:0].reshape(t.shape)
            view.copy_(t)
            packed[key] = view
    for m, name, is_param, t in owners:
        if is_param:
            t.data = packed[id(t)]
        else:
            m._buffers[name] = packed[id(t)]
    log.info("packed %d weight tensors into one %.1f MiB buffer on %s", len(seen), total / 2**20, dev)
    return total
