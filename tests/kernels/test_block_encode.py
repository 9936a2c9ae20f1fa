"""The C++ block encode bit for bit against the eager codec (``fused=False``): every finite bf16
and fp16 value as an element at block scale 1, every positive bf16 / fp16 value as a block's
maximum (every E4M3 scale and its rounding boundaries), the float32 sample of
tests/test_e2m1.py, in all four orders, quantize and fake_quantize, every vector path this CPU has
(against one eager result each), one and two threads, partial tiles; ``abs_max`` against torch;
the routing rule.

``bits`` comparisons distinguish -0.0 from 0.0; tensors come from seeded generators.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4lab import kernels
from nvfp4lab.codec import fake_quantize, quantize
from nvfp4lab.kernels import block_encode, native
from nvfp4lab.kernels import quantize as fused_quantize
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import OrderName
from tests.test_e2m1 import _fp32_sample

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CONVENTIONS = ("kernel", "compressed-tensors", "modelopt", "llama.cpp")
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def paths() -> list[str]:
    """The vector paths this CPU runs (the library clamps a wider one to its best)."""
    best = block_encode.ISAS.index(block_encode.isa()) if native.available() else 0
    return list(block_encode.ISAS[: best + 1])


#: Every vector path this CPU has: each check runs them all against one eager result.
PATHS = paths()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.dtype])


def every_finite(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit dtype (both zeros)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[torch.isfinite(values)]


def assert_same(x: torch.Tensor, gs: float | None, convention: str, threads: int = 1) -> None:
    """quantize and fake_quantize of ``x`` by the kernel on every vector path equal the eager
    codec's (computed once)."""
    order = ORDERS[OrderName(convention)]
    want = quantize(x, gs, convention=convention, fused=False)
    want_fake = bits(fake_quantize(x, gs, convention=convention, fused=False))
    t = want.global_scale if want.decode_scale is None else want.decode_scale  # the order's form
    for path in PATHS:
        packed, scales = block_encode.encode(x, t, order, path=path, threads=threads)
        assert torch.equal(packed, want.packed), path
        assert torch.equal(scales.view(torch.uint8), want.scales.view(torch.uint8)), path
        fake = block_encode.fake_quantize(x, t, order, path=path, threads=threads)
        assert torch.equal(bits(fake), want_fake), path


def at_scale_one(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (within +-6) as blocks of 15 behind a 6.0: at gs = 1 every block scale is 1 and
    each element is rounded as itself."""
    values = values.to(dtype)
    pad = -values.numel() % 15
    values = torch.cat([values, torch.zeros(pad, dtype=dtype)]).reshape(-1, 15)
    six = torch.full((values.shape[0], 1), 6.0, dtype=dtype)
    return torch.cat([six, values], dim=1)


@pytest.mark.parametrize("convention", CONVENTIONS)
class TestEqualsEager:
    @pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
    def test_every_element_value(self, dtype: torch.dtype, convention: str) -> None:
        values = every_finite(dtype)
        inside = values[values.float().abs() <= 6.0]
        assert_same(at_scale_one(inside, dtype), 1.0, convention)
        # every value, each block scaled by its own max (saturation, tiny blocks, zero blocks)
        pad = -values.numel() % 16
        x = torch.cat([values, torch.zeros(pad, dtype=dtype)]).reshape(-1, 16)
        for gs in (None, 1.0, 2.0**-20):
            assert_same(x, gs, convention, threads=2)

    @pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
    def test_every_block_max(self, dtype: torch.dtype, convention: str) -> None:
        """Each positive finite value as a block's max, over a random block: every E4M3 scale and
        every rounding boundary of the scale chain the dtype can reach, at several gs."""
        values = every_finite(dtype)
        top = values[values.float() > 0]
        g = torch.Generator().manual_seed(5)
        fill = torch.rand((top.numel(), 16), generator=g) * 2 - 1
        x = (fill * top.float()[:, None]).to(dtype)
        x[:, 3] = top
        for gs in (1.0, 0.37, 2688 / 4.2, 3.1e-3, 7.0e4):
            assert_same(x, gs, convention, threads=2)

    def test_float32_sample(self, convention: str) -> None:
        sample = _fp32_sample()
        sample = sample[torch.isfinite(sample)]
        inside = sample[sample.abs() <= 6.0]
        assert_same(at_scale_one(inside, torch.float32), 1.0, convention, threads=2)
        x = sample[: sample.numel() // 16 * 16].reshape(-1, 16)
        for gs in (None, 1.0):
            assert_same(x, gs, convention, threads=2)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_shapes_tiles_threads(self, dtype: torch.dtype, convention: str) -> None:
        """Partial tiles (blocks not a multiple of 16), thread splits, zero blocks, -0.0."""
        g = torch.Generator().manual_seed(2)
        for rows, k in [(1, 32), (3, 48), (7, 80), (257, 512), (4099, 32)]:
            spread = torch.exp(2 * torch.randn(rows, k, generator=g))
            x = (torch.randn(rows, k, generator=g) * spread).to(dtype)
            x[0, :16] = 0.0
            x[-1, -16:] = -0.0
            for threads in (1, 2):
                assert_same(x, None, convention, threads=threads)


def e4m3_values() -> torch.Tensor:
    """Every positive finite E4M3 value (subnormal 2**-9 to 448), float32."""
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def assert_same_propagating(x: torch.Tensor, gs: float, convention: str) -> None:
    """As :func:`assert_same`, against the eager codec under ``nonfinite="propagate"``."""
    order = ORDERS[OrderName(convention)]
    want = quantize(x, gs, convention=convention, fused=False, nonfinite="propagate")
    want_fake = bits(fake_quantize(x, gs, convention=convention, fused=False,
                                   nonfinite="propagate"))
    t = want.global_scale if want.decode_scale is None else want.decode_scale
    for path in PATHS:
        packed, scales = block_encode.encode(x, t, order, path=path)
        assert torch.equal(packed, want.packed), path
        assert torch.equal(scales.view(torch.uint8), want.scales.view(torch.uint8)), path
        fake = block_encode.fake_quantize(x, t, order, path=path)
        assert torch.equal(bits(fake), want_fake), path


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_at_every_scale(dtype: torch.dtype, convention: str) -> None:
    """Elements exactly on the midpoints between E2M1 magnitudes times s (both signs) in blocks
    of max 6 s, for every E4M3 value s (subnormal scales included), and one ulp either side:
    the ties of both E2M1 rules (even; llama.cpp's first nearest) and the scale roundings."""
    s = e4m3_values()[:, None]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = torch.cat([6 * s, mids * s, -6 * s, -mids * s], dim=1)  # [126, 16]
    x = row.to(dtype)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    down = torch.nextafter(x, torch.zeros_like(x))
    for gs in (1.0, 0.5, 3.0):
        assert_same(torch.cat([x, up, down]), gs, convention)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_huge_and_vanishing_against_the_scale(convention: str) -> None:
    """Elements far beyond 6 s (a saturated scale of 448 under values up to 3e38, llama.cpp's
    first-minimum loop), blocks whose scale rounds to 0 beside larger ones, pre-scaling that
    overflows to inf (gs = 1e30): float32, each path against eager."""
    g = torch.Generator().manual_seed(11)
    magnitudes = torch.logspace(-12, 38.4, 16 * 64, dtype=torch.float64).clamp(max=3e38)
    x = (magnitudes * torch.where(torch.rand(magnitudes.shape, generator=g) < 0.5, -1, 1))
    x = x[torch.randperm(x.numel(), generator=g)].to(torch.float32).reshape(-1, 16)
    tiny = torch.rand((8, 16), generator=g) * 5.0e-3  # amax / 6 below 2**-10 at gs = 1
    # maxima 1e9..1e12 at scale 448: codes 7 and smaller (rounded errors equal) side by side
    big = (torch.rand((256, 16), generator=g) * 0.9 + 0.1) * torch.logspace(9, 12, 256)[:, None]
    x = torch.cat([x, tiny, -tiny, big, -big])
    for gs in (1.0, 2.0**-20, 1e30):
        assert_same(x, gs, convention)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_as_eager(dtype: torch.dtype, convention: str) -> None:
    """Infinities given a finite tensor scale: the eager codec's propagated bits, every order
    and path; NaN too in the llama.cpp order (scale 0 and codes 0 for its block). The codec
    never hands NaN/Inf to the kernel by default: a fused call raises eager's error."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 64, generator=g).to(dtype)
    x[0, 3], x[1, 17], x[2, :16] = float("inf"), float("-inf"), float("inf")
    assert_same_propagating(x, 2.0, convention)
    x[3, 40], x[4, :16] = float("nan"), float("nan")
    if convention == "llama.cpp":
        assert_same_propagating(x, 1.0, convention)
    with pytest.raises(ValueError) as eager:
        quantize(x, convention=convention, fused=False)
    with pytest.raises(ValueError) as fused:
        quantize(x, convention=convention, fused=True)
    assert str(fused.value) == str(eager.value)


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_abs_max_equals_torch(dtype: torch.dtype, path: str) -> None:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(70001, generator=g) * 100).to(dtype)
    for threads in (1, 2):
        got = block_encode.abs_max(x, path=path, threads=threads)
        assert got.dtype == dtype and got.shape == ()
        assert torch.equal(bits(got), bits(x.abs().max()))
    for bad, at in ((float("nan"), 3), (float("inf"), 69999), (float("-inf"), 0)):
        y = x.clone()
        y[at] = bad
        got = block_encode.abs_max(y, path=path, threads=2)
        assert torch.isnan(got) if bad != bad else got == float("inf")
    negative_zero = torch.full((32,), -0.0, dtype=dtype)
    assert torch.equal(bits(block_encode.abs_max(negative_zero, path=path)),
                       bits(torch.zeros((), dtype=dtype)))
    assert block_encode.abs_max(torch.empty(0, dtype=dtype)) == 0


def test_every_order_is_supported_and_an_unknown_step_refused() -> None:
    import dataclasses

    assert all(block_encode.supports(order) for order in ORDERS.values())
    x = torch.randn(4, 32)
    odd = dataclasses.replace(ORDERS[OrderName.MODELOPT], zero_block_scale=2.0)
    assert not block_encode.supports(odd)
    with pytest.raises(ValueError, match="every step of the modelopt order; use the eager"):
        block_encode.encode(x, torch.ones(1), odd)
    assert not kernels.fused_route(x.numel(), 32, x.dtype, x.device, True, order=odd,
                                   native=True)
    kernel = ORDERS[OrderName.VLLM_KERNEL]
    with pytest.raises(ValueError, match=r"multiple of 16, got shape \(4, 24\); use nvfp4lab"):
        block_encode.encode(torch.randn(4, 24), torch.ones(1), kernel)
    with pytest.raises(ValueError, match=r"got a torch\.float64 tensor on cpu; move it"):
        block_encode.fake_quantize(x.double(), torch.ones(1), kernel)
    with pytest.raises(ValueError, match=r"got a torch\.float32 tensor on meta"):
        block_encode.abs_max(x.to("meta"))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch\.float32 tensor"):
        block_encode.fake_quantize(x, torch.ones(1), ORDERS[OrderName.VLLM_KERNEL],
                                   out=torch.empty(4, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_the_codec_runs_it_from_the_first_call(
    monkeypatch: pytest.MonkeyPatch, convention: str
) -> None:
    """``auto`` in a process that has compiled nothing: quantize and fake_quantize of a CPU
    tensor run the block encode at once, in every order, results equal to eager (the modelopt
    order's tensor keeps its exact DECODE scale); ``off`` never."""
    monkeypatch.setattr(kernels, "_EAGER_WORK", {})
    monkeypatch.setattr(
        kernels, "auto_state",
        lambda device_type, dtype=None: kernels.AutoState(0, started=False, warm=False),
    )
    calls: list[str] = []
    for name in ("encode", "fake_quantize"):
        real = getattr(block_encode, name)
        monkeypatch.setattr(block_encode, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    monkeypatch.setenv("NVFP4LAB_FUSED", "auto")
    got, want = quantize(x, convention=convention), quantize(x, convention=convention, fused=False)
    assert got == want
    if convention == "modelopt":
        assert got.decode_scale is not None and torch.equal(got.decode_scale, want.decode_scale)
    assert torch.equal(bits(fake_quantize(x, convention=convention)),
                       bits(fake_quantize(x, convention=convention, fused=False)))
    assert calls == ["encode", "fake_quantize"]
    assert fused_quantize.first_pass(x, ORDERS[OrderName(convention)]).stats is None
    monkeypatch.setenv("NVFP4LAB_FUSED", "off")
    quantize(x, convention=convention)
    fake_quantize(x, convention=convention)
    assert calls == ["encode", "fake_quantize"]


def test_flush_denormal_reaches_every_thread() -> None:
    """Under ``torch.set_flush_denormal(True)`` (FTZ/DAZ on the calling thread only) subnormal
    inputs read as 0 on the caller's thread; the OpenMP workers compute in the caller's float
    mode (``native.h``'s CallerFloatMode), so 1, 2 and 3 threads give the same codes, scales and
    block maximum on every path (before, a worker's blocks kept their denormals)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 256, generator=g) * 1e-39  # 8,192 blocks: past the parallel threshold
    x[::2] *= 1e30  # normal rows between the subnormal ones: not everything flushes
    gs = torch.tensor([1e38], dtype=torch.float32)  # the subnormal rows get non-zero scales
    order = ORDERS[OrderName.VLLM_KERNEL]
    for path in PATHS:  # OpenMP's threads started before the switch (a new one inherits it)
        block_encode.encode(x, gs, order, path=path, threads=3)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        results = {(path, threads): (block_encode.encode(x, gs, order, path=path,
                                                         threads=threads),
                                     block_encode.abs_max(x, path=path, threads=threads))
                   for path in PATHS for threads in (1, 2, 3)}
    finally:
        torch.set_flush_denormal(False)
    for path in PATHS:
        (packed, scales), amax = results[(path, 1)]
        assert scales.view(torch.uint8)[1::2].eq(0).all(), path  # flushed: a zero block
        assert scales.view(torch.uint8)[::2].ne(0).all(), path
        for threads in (2, 3):
            (p2, s2), a2 = results[(path, threads)]
            assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8),
                                                           scales.view(torch.uint8)), (path,
                                                                                       threads)
            assert torch.equal(torch.as_tensor(a2), torch.as_tensor(amax)), (path, threads)
