"""The C++ ``q8_0`` kernels (``kernels/ggml_dot.cpp``) bit for bit against the torch reference in
``execution/ggml_cpu.py`` (``native=False``), on every vector path this CPU has: the Q8_0 codes
and fp16 ``d`` (zero blocks, huge and tiny amax, exact .5 ties, -0.0), the NVFP4 x Q8_0 dot (all
16 codes, all 256 scale bytes incl. 0, 0x7E and 0x7F, q8 = -128, d = 0 / subnormal / 65504),
M = 1 and 17, K = 64 .. 4096, N odd (the AVX-512 path pairs weight rows), one and two threads;
the routing of ``ggml_cpu`` and the refusals. Bits are compared as integers (-0.0 != 0.0)."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution import ggml_cpu
from nvfp4lab.kernels import ggml_dot, native
from nvfp4lab.oracles import ggml as ref
from nvfp4lab.settings import NATIVE_ISA_ENV

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)

#: Every vector path this CPU runs for this kernel (each check runs them all).
PATHS = list(native.ISAS[: native.ISAS.index(ggml_dot.isa()) + 1]) if native.available() else []


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """float32 [m, k]: normal rows with special 32-value blocks: zero, -0.0, huge / tiny amax
    (one whose 127 / amax overflows to inf), subnormals, and exact .5 ties of x * id."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 3)
    blocks = x.view(m, k // 32, 32)
    specials = [
        torch.zeros(32),
        torch.full((32,), -0.0),
        torch.randn(32, generator=g) * 1e6,  # d near fp16's top
        torch.randn(32, generator=g) * 1e-30,  # d = 0 in fp16
        torch.randn(32, generator=g) * 1e-38,  # subnormal values, 127 / amax = inf
        torch.randn(32, generator=g) * 1e-41,
        torch.arange(32, dtype=torch.float32) - 15.5,  # ties once amax is 127
    ]
    specials[-1][0] = 127.0
    for i, block in enumerate(specials):
        row, col = divmod(i * 7 + seed, blocks.shape[1] * m)
        blocks[row % m, col % blocks.shape[1]] = block
    return x


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n, k/2] with every nibble, scale bytes uint8 [n, k/16] cycling all 256
    values from a seeded offset, 0, 0x7E and 0x7F among them)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    start = int(torch.randint(0, 256, (1,), generator=g))
    scales = ((torch.arange(n * k // 16) * 37 + start) % 256).to(torch.uint8).reshape(n, k // 16)
    return codes, scales


def q8_rows(m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(arbitrary int8 codes incl. -128, fp16 d incl. 0, subnormals, 65504 and negatives)."""
    g = torch.Generator().manual_seed(seed)
    q8 = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int32).to(torch.int8)
    q8[:, :32] = -128
    d = (torch.rand(m, k // 32, generator=g) * 2.0 ** torch.randint(-26, 16, (m, k // 32),
                                                                     generator=g)).half()
    d.view(-1)[::5] = 0.0
    d.view(-1)[1::7] = 65504.0
    d.view(-1)[2::11] = -(2.0**-20)
    return q8, d


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("k", [64, 192, 576, 4096])
def test_quantize_equals_the_reference(m: int, k: int) -> None:
    x = activations(m, k, seed=m * k)
    want_codes, want_d = ggml_cpu.quantize_q8_0(x, native=False)
    for path in PATHS:
        for threads in (1, 2):
            codes, d = ggml_dot.quantize_q8_0(x, path=path, threads=threads)
            assert torch.equal(codes, want_codes), path
            assert torch.equal(bits(d), bits(want_d)), path


def test_quantize_threads_split_large_inputs() -> None:
    x = activations(160, 1024, seed=5)  # 5120 blocks: above the one-thread limit
    want_codes, want_d = ggml_cpu.quantize_q8_0(x, native=False)
    for path in PATHS:
        codes, d = ggml_dot.quantize_q8_0(x, path=path, threads=2)
        assert torch.equal(codes, want_codes) and torch.equal(bits(d), bits(want_d)), path


def test_quantize_any_leading_shape() -> None:
    x = activations(6, 96, seed=3)
    for t in (x.reshape(2, 3, 96), x[0], x[:0]):
        want_codes, want_d = ggml_cpu.quantize_q8_0(t, native=False)
        codes, d = ggml_cpu.quantize_q8_0(t, native=True)
        assert codes.shape == want_codes.shape and d.shape == want_d.shape
        assert torch.equal(codes, want_codes) and torch.equal(bits(d), bits(want_d))


def test_quantize_ties_go_to_even() -> None:
    x = (torch.arange(64, dtype=torch.float32) % 32 - 15.5).reshape(1, 64)
    x[0, ::32] = 127.0
    for path in PATHS:
        codes, _ = ggml_dot.quantize_q8_0(x, path=path)
        assert codes[0, 1].item() == -14 and codes[0, 2].item() == -14, path  # -14.5, -13.5


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize(("n", "k"), [(1, 64), (3, 128), (37, 576), (33, 4096)])
def test_dot_equals_the_reference(m: int, n: int, k: int) -> None:
    codes, scales = weight(n, k, seed=n + k)
    q8, d = q8_rows(m, k, seed=m + k)
    want = ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales.view(torch.float8_e4m3fn), q8, d,
                                       native=False)
    assert not want.isnan().any()
    for path in PATHS:
        for threads in (1, 2):
            got = ggml_dot.mul_mat(q8, d, codes, scales, path=path, threads=threads)
            assert torch.equal(bits(got), bits(want)), (path, threads)


def test_dot_every_scale_byte_and_code() -> None:
    """Each weight row one scale byte throughout (all 256) and every code in every row."""
    k = 128
    codes = (torch.arange(256 * k // 2) % 256).to(torch.uint8).reshape(256, k // 2)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, 8)
    q8, d = q8_rows(3, k, seed=7)
    want = ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales.contiguous(), q8, d, native=False)
    assert want[:, 0].eq(0).all() and want[:, 0x7F].eq(0).all()  # bytes 0 and 0x7F read as 0
    for path in PATHS:
        got = ggml_dot.mul_mat(q8, d, codes, scales, path=path)
        assert torch.equal(bits(got), bits(want)), path


@pytest.mark.parametrize("m", [1, 17, 70])
def test_mul_mat_equals_the_reference(m: int) -> None:
    """x -> Q8_0 -> dot, as the q8_0 backend calls it; 70 rows span two activation tiles."""
    k, n = 256, 45
    x = activations(m, k, seed=m)
    x[:, 32:64] *= 1e30  # d = inf in fp16: NaN / inf outputs, the same in both
    codes, scales = weight(n, k, seed=m)
    e4m3 = scales.view(torch.float8_e4m3fn)
    want = ggml_cpu.mul_mat(x, codes, e4m3, native=False)
    for path in PATHS:
        for threads in (1, 2):
            got = ggml_dot.mul_mat(*ggml_dot.quantize_q8_0(x, path=path), codes, scales,
                                   path=path, threads=threads)
            fused = ggml_dot.linear(x, codes, scales, path=path, threads=threads)
            finite = ~want.isnan()
            for out in (got, fused):
                assert torch.equal(out.isnan(), want.isnan()), path
                assert torch.equal(bits(out[finite]), bits(want[finite])), path
    clean = activations(m, k, seed=m + 1)
    auto = ggml_cpu.mul_mat(clean, codes, e4m3)
    assert torch.equal(bits(auto), bits(ggml_cpu.mul_mat(clean, codes, e4m3, native=False)))


def test_both_match_the_slow_oracle() -> None:
    """The torch reference and every native path against the exact-rational oracle
    (``oracles.ggml``; tests/execution/test_ggml_cpu.py now runs the native path by default)."""
    k = 192
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(11))  # the oracle needs
    x[0, :32] = 0.0  # 127 / amax finite: no 1e-38 block here
    x[1, 64:96] = torch.arange(32) - 15.5
    x[1, 64] = 127.0
    codes, scales = weight(3, k, seed=11)
    q8, d = ggml_cpu.quantize_q8_0(x, native=False)
    want = [ref.quantize_q8_0(r) for r in x.tolist()]
    assert q8.tolist() == [c for c, _ in want]
    assert d.float().tolist() == [s for _, s in want]
    elements = unpack_fp4(codes)
    oracle = torch.tensor([[ref.vec_dot_nvfp4_q8_0(elements[n].tolist(), scales[n].tolist(),
                                                    q8[m].tolist(), d[m].float().tolist())
                            for n in range(3)] for m in range(2)], dtype=torch.float32)
    assert torch.equal(ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales, q8, d, native=False), oracle)
    for path in PATHS:
        assert torch.equal(bits(ggml_dot.mul_mat(q8, d, codes, scales, path=path)), bits(oracle))


def test_routing_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    x = activations(2, 64, seed=1)
    codes, scales = weight(5, 64, seed=1)
    calls: list[str] = []
    for name in ("linear", "mul_mat", "quantize_q8_0"):
        original = getattr(ggml_dot, name)
        monkeypatch.setattr(ggml_dot, name, lambda *a, _f=original, _n=name, **kw: (
            calls.append(_n), _f(*a, **kw))[1])
    ggml_cpu.mul_mat(x, codes, scales)
    ggml_cpu.mul_mat(x.t().contiguous().t(), codes, scales)  # strided x: the torch path
    ggml_cpu.mul_mat(x, codes, scales, native=False)
    assert calls == ["linear"]
    q8, d = ggml_cpu.quantize_q8_0(x)
    ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales, q8, d)
    assert calls == ["linear", "quantize_q8_0", "mul_mat"]
    with pytest.raises(ValueError, match="native=True needs"):
        ggml_cpu.mul_mat(x.t().contiguous().t(), codes, scales, native=True)
    bad = x.clone()
    bad[1, 3] = float("nan")
    for path in PATHS:
        with pytest.raises(ValueError, match="1 non-finite"):
            ggml_dot.quantize_q8_0(bad, path=path)
        with pytest.raises(ValueError, match="1 non-finite"):
            ggml_dot.linear(bad, codes, scales, path=path)
    with pytest.raises(ValueError, match="1 non-finite"):
        ggml_cpu.mul_mat(bad, codes, scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_dot.quantize_q8_0(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="CPU float32"):
        ggml_dot.quantize_q8_0(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q8 must be int8"):
        ggml_dot.mul_mat(torch.zeros(2, 128, dtype=torch.int8), torch.zeros(2, 2).half(), codes,
                         scales)
    with pytest.raises(ValueError, match="linear needs x float32"):
        ggml_dot.linear(torch.zeros(2, 32), codes, scales)
    monkeypatch.setenv(NATIVE_ISA_ENV, "scalar")
    assert ggml_dot.isa() == "scalar"


def test_flush_denormal_reaches_every_thread() -> None:
    """Under ``torch.set_flush_denormal(True)`` (FTZ/DAZ on the calling thread only) subnormal
    inputs read as 0: every thread count gives the torch path's codes (before, the second
    OpenMP thread kept denormals and its half of the blocks got codes of +-127)."""
    x = torch.randn(160, 1024, generator=torch.Generator().manual_seed(2)) * 1e-39
    x[::2] *= 1e30  # normal rows between the subnormal ones: not everything flushes
    for path in PATHS:  # OpenMP's threads started before the switch (a new one inherits it)
        ggml_dot.quantize_q8_0(x, path=path, threads=3)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        want_codes, want_d = ggml_cpu.quantize_q8_0(x, native=False)
        results = [(path, ggml_dot.quantize_q8_0(x, path=path, threads=threads))
                   for path in PATHS for threads in (1, 2, 3)]
    finally:
        torch.set_flush_denormal(False)
    assert want_codes[1::2].eq(0).all() and want_codes[::2].ne(0).any()
    for path, (codes, d) in results:
        assert torch.equal(codes, want_codes) and torch.equal(bits(d), bits(want_d)), path


def test_empty_shapes_and_a_scalar_weight() -> None:
    """M, N or K of 0: both paths give the same empty or zero output (the torch path's reshape
    of N = 0 rows once raised); a 0-d ``codes`` is a one-line ValueError, not an IndexError."""
    for m, n, k in [(0, 3, 64), (3, 0, 64), (2, 3, 0)]:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n))
        codes = torch.zeros(n, k // 2, dtype=torch.uint8)
        scales = torch.full((n, k // 16), 0x38, dtype=torch.uint8)
        want = ggml_cpu.mul_mat(x, codes, scales, native=False)
        got = ggml_cpu.mul_mat(x, codes, scales, native=True)
        assert want.shape == got.shape == (m, n) and torch.equal(bits(got), bits(want))
    scalar = torch.tensor(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="linear needs x float32"):
        ggml_dot.linear(torch.zeros(2, 64), scalar, torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes must be uint8"):
        ggml_dot.mul_mat(torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, 2).half(), scalar,
                         torch.zeros(1, 4, dtype=torch.uint8))


def test_float32_d_is_refused_on_both_paths() -> None:
    """``d`` is ggml's stored float16: a float32 ``q8_scales`` is refused in one line by the
    torch path and the native one alike (the torch path used to take it)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (4, 32), dtype=torch.uint8, generator=g)
    scales = torch.full((4, 4), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q8 = torch.randint(-127, 128, (2, 64), dtype=torch.int8, generator=g)
    d = torch.full((2, 2), 0.01, dtype=torch.float32)
    for use_native in (False, None):
        with pytest.raises(ValueError, match="q8_scales must be float16"):
            ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales, q8, d, native=use_native)
    assert ggml_cpu.vec_dot_nvfp4_q8_0(codes, scales, q8, d.half(), native=False).shape == (2, 4)
