"""A convolution's epilogue in one pass: ``x = act(x + bias[c])``, in place, for CUDA activations.

PyTorch runs a cuDNN convolution's bias as a separate broadcast ``add_`` and a PReLU as another kernel;
with a per-channel operand neither takes the vectorised elementwise path, and each reads and writes the
whole activation. For SFace in fp16 those two kernels were a quarter of the photo stage's device time on
the H200 (``benchmarks/photo_profile.py --gpu-kernels``: 0.83 + 0.81 of 6.75 ms per 54 photos).
:func:`bias_act_` does both in one Triton kernel (one read, one write, arithmetic in fp32, one rounding).

Everything else (the CPU, no Triton, other layouts, ``torch.compile`` tracing, which fuses by itself) takes
the same maths as torch operations, so results agree to the rounding of the intermediate sum (fp16: the
eager path rounds ``x + bias`` before the activation, the kernel does not).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

Activation = Literal["none", "relu", "prelu"]
_ACT_CODES = {"none": 0, "relu": 1, "prelu": 2}
_BLOCK = 1024


@functools.cache
def _kernel() -> Any | None:
    """The Triton kernel, compiled on first launch; None when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:
        log.info("Triton unavailable (%s): convolution epilogues run as torch operations", exc)
        return None

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

    return bias_act_kernel


def _layout(x: Tensor) -> bool | None:
    """True for a dense channels-last ``(N, C, H, W)`` tensor, False for a contiguous one, None otherwise."""
    if x.is_contiguous():
        return False
    if x.is_contiguous(memory_format=torch.channels_last):
        return True
    return None


def fused_available(x: Tensor) -> bool:
    """Whether :func:`bias_act_` runs its Triton kernel for ``x`` (else it uses torch operations)."""
    return (
        x.is_cuda
        and x.ndim == 4
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and not torch.compiler.is_compiling()
        and _layout(x) is not None
        and _kernel() is not None
    )


def reference(x: Tensor, bias: Tensor, act: Activation = "none", slope: Tensor | None = None) -> Tensor:
    """``act(x + bias)`` as torch operations (what PyTorch computes for conv-with-bias then the activation).

    Args:
        x: ``(N, C, H, W)`` float. bias: ``(C,)``. slope: ``(C,)`` PReLU slopes (``act == "prelu"`` only).
    """
    y = x + bias.to(x.dtype).view(1, -1, 1, 1)
    if act == "relu":
        return F.relu(y)
    if act == "prelu":
        assert slope is not None
        return F.prelu(y, slope.to(x.dtype))
    return y


def bias_act_(x: Tensor, bias: Tensor, act: Activation = "none", slope: Tensor | None = None) -> Tensor:
    """``x = act(x + bias[c])`` in place, one kernel on CUDA; returns ``x`` (or a new tensor on the fallback).

    Args:
        x: ``(N, C, H, W)`` float activation (fp32/fp16/bf16), contiguous or channels-last; overwritten
            when the kernel runs.
        bias: ``(C,)`` per-channel bias, any float dtype (cast to fp32 in the kernel).
        act: ``"none"``, ``"relu"`` or ``"prelu"``.
        slope: ``(C,)`` PReLU slopes when ``act == "prelu"``.

    Raises:
        ValueError: ``act`` is unknown, or ``"prelu"`` without ``slope``.
    """
    if act not in _ACT_CODES:
        raise ValueError(f"unknown activation {act!r}; choose from {sorted(_ACT_CODES)}")
    if act == "prelu" and slope is None:
        raise ValueError("act='prelu' needs a slope tensor")
    if _failed or not fused_available(x) or x.shape[1] != bias.numel():
        return reference(x, bias, act, slope)
    n = x.numel()
    _, c, h, w = x.shape
    kernel = _kernel()
    b = bias.contiguous()
    a = slope.contiguous() if slope is not None else b  # unread unless act == "prelu"
    grid = (-(-n // _BLOCK),)
    try:
        kernel[grid](x, b, a, n, c, h * w, CHANNELS_LAST=bool(_layout(x)), ACT=_ACT_CODES[act], BLOCK=_BLOCK)
    except Exception as exc:  # Triton imports but cannot build or launch (no C compiler, an unsupported GPU)
        _give_up(exc)
        return reference(x, bias, act, slope)  # a build failure raises before the kernel touches x
    return x


_failed = False


def _give_up(exc: BaseException) -> None:
    """After the kernel failed once, every later call takes the torch operations (logged once)."""
    global _failed
    if not _failed:
        log.warning(
            "Triton epilogue kernel failed (%s: %s); using torch operations from now on", type(exc).__name__, exc
        )
    _failed = True


def set_fused_epilogues(module: torch.nn.Module, on: bool) -> int:
    """Turn :func:`bias_act_` on or off in every submodule that offers it (a ``fused_epilogue`` attribute,
    e.g. :class:`facegate.models.sface.ConvBNPReLU`); returns how many submodules were set."""
    n = 0
    for m in module.modules():
        if hasattr(type(m), "fused_epilogue"):
            m.fused_epilogue = bool(on)
            n += 1
    return n
