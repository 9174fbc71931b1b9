"""Fused convolution epilogues for CUDA, as Triton kernels: :func:`bias_act_` (``x = act(x + bias[c])`` in one pass,
where PyTorch runs bias and PReLU as two kernels) and :func:`depthwise3x3` (YuNet's ``ConvDPUnit`` tail in one
kernel). Elsewhere the same maths runs as torch operations (the kernels compute in fp32 and round once).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

Activation = Literal["relu", "prelu"]
_ACT_CODES = {"relu": 1, "prelu": 2}
_BLOCK = 1024


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    """The Triton kernels ``(bias_act, depthwise3x3)``, each compiled on first launch; None when Triton cannot be
    imported."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:
        log.info("Triton unavailable (%s): convolution epilogues run as torch operations", exc)
        return None

    # Triton's specialisation of the integer arguments ("divisible by 16") vectorises the loads and stores
    @triton.jit
    def bias_act_kernel(  # type: ignore[no-untyped-def]
        x_ptr, b_ptr, a_ptr, n, C, HW, CHANNELS_LAST: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        c = offs % C if CHANNELS_LAST else (offs // HW) % C
        y = tl.load(x_ptr + offs, mask=m).to(tl.float32) + tl.load(b_ptr + c, mask=m).to(tl.float32)
        if ACT == 1:
            y = tl.maximum(y, 0.0)
        elif ACT == 2:
            y = tl.where(y > 0.0, y, y * tl.load(a_ptr + c, mask=m).to(tl.float32))
        tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=m)

    # 2-D tiles (no divisions per element); only W is specialised (each variant is a compile at start-up)
    @triton.jit(do_not_specialize=["C", "H", "TILES_W"])
    def depthwise3x3_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, p_ptr, y_ptr, C, H, W, TILES_W,
        PRE_BIAS: tl.constexpr, RELU: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        plane = tl.program_id(0)  # n * C + c: one image channel per program row
        tile = tl.program_id(1)
        c = plane % C
        rows = (tile // TILES_W) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        cols = (tile % TILES_W) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
        base = plane.to(tl.int64) * H * W
        acc = tl.zeros((BLOCK_H, BLOCK_W), dtype=tl.float32) + tl.load(b_ptr + c).to(tl.float32)
        if PRE_BIAS:
            pre = tl.load(p_ptr + c).to(tl.float32)
        for dy in tl.static_range(3):
            r = rows + (dy - 1)
            for dx in tl.static_range(3):
                q = cols + (dx - 1)
                m = (r >= 0) & (r < H) & (q >= 0) & (q < W)
                v = tl.load(x_ptr + base + r * W + q, mask=m, other=0.0).to(tl.float32)
                if PRE_BIAS:  # the 1×1 conv's bias, inside the image only: the padding stays zero
                    v = tl.where(m, v + pre, 0.0)
                acc += v * tl.load(w_ptr + c * 9 + dy * 3 + dx).to(tl.float32)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        tl.store(y_ptr + base + rows * W + cols, acc.to(y_ptr.dtype.element_ty), mask=(rows < H) & (cols < W))

    return bias_act_kernel, depthwise3x3_kernel


def depthwise_reference(
    x: Tensor, weight: Tensor, bias: Tensor, pre_bias: Tensor | None = None, relu: bool = False
) -> Tensor:
    """:func:`depthwise3x3` as torch operations."""
    if pre_bias is not None:
        x = x + pre_bias.to(x.dtype).view(1, -1, 1, 1)
    y = F.conv2d(x, weight.to(x.dtype), bias.to(x.dtype), 1, 1, 1, x.shape[1])
    return F.relu_(y) if relu else y


def depthwise3x3(
    x: Tensor, weight: Tensor, bias: Tensor, *, pre_bias: Tensor | None = None, relu: bool = False
) -> Tensor:
    """``relu?(dwconv3x3(x + pre_bias[c]) + bias[c])`` (stride 1, zero padding 1; ``pre_bias`` inside the image
    only): one kernel on CUDA for an NCHW ``x``. ``x (N, C, H, W)``, ``weight (C, 1, 3, 3)``, biases ``(C,)``; a new
    tensor of ``x``'s dtype; ``ValueError`` when they do not fit."""
    c = x.shape[1] if x.ndim == 4 else -1
    if weight.shape != (c, 1, 3, 3) or bias.numel() != c or (pre_bias is not None and pre_bias.numel() != c):
        raise ValueError(f"depthwise3x3: weight {tuple(weight.shape)} / biases do not fit x {tuple(x.shape)}")
    if _failed or not fused_available(x) or not x.is_contiguous():
        return depthwise_reference(x, weight, bias, pre_bias, relu)
    n, _, h, w = x.shape
    y = torch.empty_like(x)
    bw = min(64, max(4, triton_next_pow2(w)))
    bh = max(1, min(triton_next_pow2(h), 2048 // bw))  # at most 2048 outputs per program
    tiles_w = -(-w // bw)
    grid = (n * c, tiles_w * -(-h // bh))
    b = bias.contiguous()
    p = pre_bias.contiguous() if pre_bias is not None else b  # unread unless PRE_BIAS
    try:
        _kernels()[1][grid](
            x, weight.contiguous(), b, p, y, c, h, w, tiles_w,
            PRE_BIAS=pre_bias is not None, RELU=bool(relu), BLOCK_H=bh, BLOCK_W=bw,
            num_warps=4 if bh * bw >= 1024 else 2,
        )  # fmt: skip
    except Exception as exc:  # see bias_act_
        _give_up(exc)
        return depthwise_reference(x, weight, bias, pre_bias, relu)
    return y


def triton_next_pow2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (≥ 1), a Triton block size."""
    return 1 << max(0, int(n) - 1).bit_length()


def is_channels_last(x: Tensor) -> bool:
    """Whether the 4-D ``x`` is NHWC and not also NCHW-contiguous (as 1×1 maps are)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def fused_available(x: Tensor) -> bool:
    """Whether :func:`bias_act_` runs its Triton kernel for ``x`` (else it uses torch operations)."""
    return (
        x.is_cuda
        and x.ndim == 4
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and not torch.compiler.is_compiling()
        and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))
        and _kernels() is not None
    )


def reference(x: Tensor, bias: Tensor, act: Activation, slope: Tensor | None = None) -> Tensor:
    """:func:`bias_act_` as torch operations (not in place)."""
    y = x + bias.to(x.dtype).view(1, -1, 1, 1)
    if act == "relu":
        return F.relu(y)
    assert slope is not None
    return F.prelu(y, slope.to(x.dtype))


def bias_act_(x: Tensor, bias: Tensor, act: Activation, slope: Tensor | None = None) -> Tensor:
    """``x = act(x + bias[c])`` in place, one kernel on CUDA; returns ``x`` (a new tensor on the fallback).
    ``x (N, C, H, W)`` float, ``bias (C,)``, ``slope (C,)`` for ``"prelu"``; ``ValueError`` for a bad ``act``."""
    if act not in _ACT_CODES:
        raise ValueError(f"unknown activation {act!r}; choose from {sorted(_ACT_CODES)}")
    if act == "prelu" and slope is None:
        raise ValueError("act='prelu' needs a slope tensor")
    if _failed or not fused_available(x) or x.shape[1] != bias.numel():
        return reference(x, bias, act, slope)
    n = x.numel()
    _, c, h, w = x.shape
    b = bias.contiguous()
    a = slope.contiguous() if slope is not None else b  # unread unless act == "prelu"
    grid = (-(-n // _BLOCK),)
    try:
        _kernels()[0][grid](x, b, a, n, c, h * w, CHANNELS_LAST=is_channels_last(x), ACT=_ACT_CODES[act], BLOCK=_BLOCK)
    except Exception as exc:  # Triton imports but cannot build or launch (no C compiler, an unsupported GPU)
        _give_up(exc)
        return reference(x, bias, act, slope)  # a build failure raises before the kernel touches x
    return x


_failed = False


def _give_up(exc: BaseException) -> None:
    """After a kernel failed once, every later call takes the torch operations."""
    global _failed
    if not _failed:
        log.warning(
            "Triton epilogue kernel failed (%s: %s); using torch operations from now on", type(exc).__name__, exc
        )
    _failed = True


def set_fused_epilogues(module: torch.nn.Module, on: bool) -> None:
    """Turn the fused kernels (:func:`bias_act_`, YuNet's :func:`depthwise3x3`) on or off in every submodule with a
    ``fused_epilogue`` attribute."""
    for m in module.modules():
        if hasattr(type(m), "fused_epilogue"):
            m.fused_epilogue = bool(on)
