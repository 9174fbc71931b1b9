"""runtime/kernels.py: bias + activation in one kernel, and its use in SFace's folded conv blocks."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from facegate.models.sface import ConvBNPReLU, load_sface, tiny_sface
from facegate.runtime.kernels import (
    bias_act_,
    depthwise3x3,
    depthwise_reference,
    fused_available,
    reference,
    set_fused_epilogues,
)

log = logging.getLogger(__name__)


def _fused(m: torch.nn.Module) -> int:
    """How many submodules of ``m`` have their fused epilogue on."""
    return sum(bool(getattr(c, "fused_epilogue", False)) for c in m.modules())


def _inputs(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, channels_last: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random activation ``x`` (channels-last or contiguous), a bias and PReLU slopes in [0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    b = torch.randn(shape[1], generator=g).to(device=device, dtype=dtype)
    a = (0.25 * torch.rand(shape[1], generator=g)).to(device=device, dtype=dtype)
    return x, b, a


# --------------------------------------------------------------------------- CPU: the torch-operation path
@pytest.mark.parametrize("act", ["relu", "prelu"])
def test_cpu_is_the_reference_maths(act: str) -> None:
    x, b, a = _inputs((2, 8, 5, 7), torch.float32, "cpu", channels_last=False)
    want = x + b.view(1, -1, 1, 1)
    want = {"relu": F.relu(want), "prelu": F.prelu(want, a)}[act]
    assert not fused_available(x)
    got = bias_act_(x.clone(), b, act, a if act == "prelu" else None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_arguments() -> None:
    x, b, _ = _inputs((1, 4, 3, 3), torch.float32, "cpu", channels_last=False)
    with pytest.raises(ValueError, match="unknown activation"):
        bias_act_(x, b, "gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slope"):
        bias_act_(x, b, "prelu")


def test_set_fused_epilogues_reaches_every_conv_block() -> None:
    m = tiny_sface(0)
    set_fused_epilogues(m, True)
    assert _fused(m) == 27  # the stem and 13 depthwise-separable blocks of two
    assert all(c.fused_epilogue for c in m.modules() if isinstance(c, ConvBNPReLU))
    set_fused_epilogues(m, False)
    assert _fused(m) == 0
    assert not ConvBNPReLU.fused_epilogue  # the class default stays off


def test_fused_flag_changes_nothing_on_the_cpu() -> None:
    m = tiny_sface(0).fuse()
    x = torch.randn(3, 3, 112, 112)
    with torch.inference_mode():
        want, _ = m(x)
        set_fused_epilogues(m, True)
        got, _ = m(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------- CUDA: the Triton kernel
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("act", ["relu", "prelu"])
def test_kernel_matches_the_torch_operations(dtype: torch.dtype, channels_last: bool, act: str) -> None:
    # odd sizes: the last block is partial, and the channel index wraps inside a block
    x, b, a = _inputs((3, 24, 13, 11), dtype, "cuda", channels_last)
    assert fused_available(x), "Triton must be importable on the GPU machine"
    slope = a if act == "prelu" else None
    want = reference(x.float(), b.float(), act, None if slope is None else slope.float())
    ptr = x.data_ptr()
    got = bias_act_(x, b, act, slope)
    assert got.data_ptr() == ptr and got.is_contiguous(memory_format=torch.channels_last) == channels_last
    # one rounding of the fp32 result: within half an ulp of the output dtype
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_kernel_inside_a_cuda_graph() -> None:
    x, b, a = _inputs((4, 32, 8, 8), torch.float16, "cuda", channels_last=True)
    static = x.clone()
    bias_act_(static.clone(), b, "prelu", a)  # compile before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        bias_act_(static, b, "prelu", a)
    torch.cuda.current_stream().wait_stream(side)
    for seed in (1, 2):
        fresh, _, _ = _inputs((4, 32, 8, 8), torch.float16, "cuda", channels_last=True, seed=seed)
        static.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        want = reference(fresh.float(), b.float(), "prelu", a.float())
        torch.testing.assert_close(static.float(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_sface_fp16_fused_matches_unfused() -> None:
    base = load_sface().fuse().cuda().half().to(memory_format=torch.channels_last)
    fused = copy.deepcopy(base)
    set_fused_epilogues(fused, True)
    assert _fused(fused) == 27
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 3, 112, 112, generator=g).cuda().half().contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        e0, _ = base(x)
        e1, _ = fused(x)
    cos = F.cosine_similarity(e0.float(), e1.float())
    log.info("SFace fp16 fused vs unfused epilogues: cosine min %.6f", cos.min().item())
    assert cos.min().item() > 0.9999, cos


def test_yunet_blocks_take_the_flag() -> None:
    from facegate.models.yunet import ConvDPUnit, ConvHead, load_yunet

    m = load_yunet()
    set_fused_epilogues(m, True)
    assert _fused(m) == sum(isinstance(c, (ConvDPUnit, ConvHead)) for c in m.modules()) == 27
    x = torch.rand(2, 3, 64, 64) * 255
    with torch.inference_mode():
        got = m(x)
        set_fused_epilogues(m, False)
        want = m(x)
    for g, w in zip(got, want, strict=True):  # the CPU never takes the fused path
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
def test_yunet_fp32_fused_matches_unfused() -> None:
    from facegate.models.yunet import load_yunet

    base = load_yunet().cuda()
    fused = copy.deepcopy(base)
    set_fused_epilogues(fused, True)
    x = (torch.rand(4, 3, 256, 256, generator=torch.Generator().manual_seed(3)) * 255).cuda()
    with torch.inference_mode():
        want = base(x)
        got = fused(x)
    flat_got = torch.cat([t.flatten() for level in got for t in level])  # 4 outputs × 3 levels
    flat_want = torch.cat([t.flatten() for level in want for t in level])
    diff = (flat_got - flat_want).abs().max().item()
    log.info("YuNet fp32 fused vs unfused: max |diff| %.3g (max |value| %.3g)", diff, flat_want.abs().max().item())
    for g, w in zip(got, want, strict=True):  # fp32; the depthwise kernel sums its nine taps in another order
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_kernel_that_cannot_build_falls_back_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from facegate.runtime import kernels as epilogue

    class Broken:
        launches = 0

        def __getitem__(self, grid: tuple[int]) -> Callable[..., None]:
            def launch(*args: object, **kwargs: object) -> None:
                Broken.launches += 1
                raise RuntimeError("no C compiler")

            return launch

    monkeypatch.setattr(epilogue, "fused_available", lambda x: True)
    monkeypatch.setattr(epilogue, "_kernels", lambda: (Broken(), None))
    monkeypatch.setattr(epilogue, "_failed", False)
    x, b, a = _inputs((2, 4, 3, 3), torch.float32, "cpu", channels_last=False)
    with caplog.at_level(logging.WARNING, logger="facegate.runtime.kernels"):
        for _ in range(3):
            got = bias_act_(x.clone(), b, "prelu", a)
            torch.testing.assert_close(got, reference(x, b, "prelu", a), rtol=0, atol=0)
    assert Broken.launches == 1 and epilogue._failed
    assert sum("Triton epilogue kernel failed" in r.getMessage() for r in caplog.records) == 1


# --------------------------------------------------------------------------- depthwise 3×3 (YuNet's ConvDPUnit)
def _dw_inputs(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x (N, C, H, W)``, depthwise filters ``(C, 1, 3, 3)``, the conv's bias and a preceding layer's bias."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x, w, b, p = (torch.randn(s, generator=g) for s in (shape, (c, 1, 3, 3), (c,), (c,)))
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w, b, p))  # type: ignore[return-value]


@pytest.mark.parametrize("relu", [False, True])
def test_depthwise_reference_is_the_unfused_conv_dp_unit(relu: bool) -> None:
    from facegate.models.yunet import ConvDPUnit

    unit = ConvDPUnit(6, 6, relu=relu).eval()
    x = torch.randn(2, 6, 9, 7, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = unit(x)
        got = depthwise_reference(
            F.conv2d(x, unit.conv1.weight), unit.conv2.weight, unit.conv2.bias, unit.conv1.bias, relu
        )
        assert not fused_available(x)
        fallback = depthwise3x3(
            F.conv2d(x, unit.conv1.weight), unit.conv2.weight, unit.conv2.bias, pre_bias=unit.conv1.bias, relu=relu
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # bias added before vs inside the 1x1 conv
    torch.testing.assert_close(fallback, got, rtol=0, atol=0)
    if relu:
        assert bool((got >= 0).all())


def test_depthwise_padding_is_zero_even_with_a_pre_bias() -> None:
    # a constant image: the corner output sees 4 of 9 taps, an edge 6, the centre 9; the pre-bias reaches
    # only the taps inside the image, as it does when the 1x1 conv adds it before the zero-padded conv
    x = torch.zeros(1, 1, 3, 3)
    w = torch.ones(1, 1, 3, 3)
    got = depthwise_reference(x, w, torch.zeros(1), torch.ones(1))
    assert got[0, 0].tolist() == [[4.0, 6.0, 4.0], [6.0, 9.0, 6.0], [4.0, 6.0, 4.0]]


def test_depthwise_bad_arguments() -> None:
    x, w, b, p = _dw_inputs((1, 4, 5, 5), torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        depthwise3x3(x, w[:3], b)
    with pytest.raises(ValueError, match="do not fit"):
        depthwise3x3(x, w, b, pre_bias=p[:2])
    with pytest.raises(ValueError, match="do not fit"):
        depthwise3x3(x[0], w, b)


def test_a_depthwise_kernel_that_cannot_build_falls_back_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    from facegate.runtime import kernels as epilogue

    launches = []

    class Broken:
        def __getitem__(self, grid: tuple[int, int]) -> Callable[..., None]:
            def launch(*args: object, **kwargs: object) -> None:
                launches.append(grid)
                raise RuntimeError("out of resources")

            return launch

    monkeypatch.setattr(epilogue, "fused_available", lambda x: True)
    monkeypatch.setattr(epilogue, "_kernels", lambda: (None, Broken()))
    monkeypatch.setattr(epilogue, "_failed", False)
    x, w, b, p = _dw_inputs((2, 3, 6, 5), torch.float32, "cpu")
    for _ in range(2):
        got = depthwise3x3(x, w, b, pre_bias=p, relu=True)
        torch.testing.assert_close(got, depthwise_reference(x, w, b, p, True), rtol=0, atol=0)
    assert len(launches) == 1 and epilogue._failed


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 13, 11), (2, 16, 128, 128), (4, 64, 8, 8), (1, 2, 1, 1), (2, 3, 70, 130)])
@pytest.mark.parametrize("pre,relu", [(False, False), (True, True), (True, False)])
def test_depthwise_kernel_matches_the_torch_operations(
    dtype: torch.dtype, shape: tuple[int, int, int, int], pre: bool, relu: bool
) -> None:
    # partial tiles in both directions, planes smaller than a tile, a 1x1 image (only the centre tap)
    x, w, b, p = _dw_inputs(shape, dtype, "cuda")
    assert fused_available(x)
    want = depthwise_reference(x.double(), w.double(), b.double(), p.double() if pre else None, relu)
    got = depthwise3x3(x, w, b, pre_bias=p if pre else None, relu=relu)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]  # fp32 sums, one rounding
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # a channels-last input takes the torch operations, with the same answer
    cl = depthwise3x3(x.contiguous(memory_format=torch.channels_last), w, b, pre_bias=p if pre else None, relu=relu)
    torch.testing.assert_close(cl.double(), want, rtol=tol * 4, atol=tol * 4)


@pytest.mark.gpu
def test_depthwise_kernel_inside_a_cuda_graph() -> None:
    x, w, b, p = _dw_inputs((4, 32, 24, 24), torch.float32, "cuda")
    static = x.clone()
    depthwise3x3(static, w, b, pre_bias=p, relu=True)  # compile before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        out = depthwise3x3(static, w, b, pre_bias=p, relu=True)
    torch.cuda.current_stream().wait_stream(side)
    for seed in (1, 2):
        fresh = _dw_inputs((4, 32, 24, 24), torch.float32, "cuda", seed=seed)[0]
        static.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, depthwise_reference(fresh, w, b, p, True), rtol=1e-5, atol=1e-5)


def _compiled_variants(fn: object) -> int:
    """How many variants Triton compiled of a ``@triton.jit`` function (its per-device kernel caches)."""
    try:
        return sum(len(entry[0]) for entry in fn.device_caches.values())  # type: ignore[attr-defined]
    except (AttributeError, TypeError, IndexError) as exc:  # another Triton's internals
        pytest.skip(f"this Triton keeps its compiled kernels elsewhere ({exc!r})")


@pytest.mark.gpu
def test_the_depthwise_kernel_compiles_a_few_variants() -> None:
    # every compiled variant is ~0.4 s of start-up per engine process on an empty cache. On a 256×256 canvas
    # YuNet's planes are 128..8 pixels wide: four block shapes (and W = 8 not divisible by 16) with ReLU, three
    # without (the heads); neither the channel count nor the batch size may add variants
    from facegate.models.yunet import load_yunet
    from facegate.runtime import kernels as epilogue

    m = load_yunet().cuda()
    set_fused_epilogues(m, True)
    pre = _compiled_variants(epilogue._kernels()[1])  # what earlier tests in this process compiled
    with torch.inference_mode():
        m(torch.rand(2, 3, 256, 256, device="cuda") * 255)
        torch.cuda.synchronize()
        dw0 = _compiled_variants(epilogue._kernels()[1])
        for n in (1, 5, 16, 33):
            m(torch.rand(n, 3, 256, 256, device="cuda") * 255)
        torch.cuda.synchronize()
    dw1 = _compiled_variants(epilogue._kernels()[1])
    log.info(
        "depthwise kernel variants: %d before YuNet, %d after one 256x256 batch, %d after four more", pre, dw0, dw1
    )
    assert dw1 == dw0
    assert dw0 - pre <= 7
