"""llama.cpp's CPU arithmetic (``q8_0`` backend) against the slow oracle ``oracles.ggml``, bit for
bit: the Q8_0 activation codes and fp16 scales, the AVX2 dot, the exact FMA, and ``linear``.
(tests/peers/test_llama_cpp_cpu.py checks the same functions against ggml's own library.)"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from nvfp4lab.codec import quantize
from nvfp4lab.e2m1 import unpack_fp4
from nvfp4lab.execution import ggml_cpu
from nvfp4lab.execution.gemm import linear, vllm_decode_scale
from nvfp4lab.oracles import ggml as ref
from nvfp4lab.vocab import Backend, BiasMode
from tests.sample_data import KINDS, make


def ties_row(k: int = 128) -> torch.Tensor:
    """A row (K a multiple of 64) whose scaled values sit exactly half way between integers:
    ``amax = 127`` gives ``id = 1``, so ``x * id = j + 0.5`` (half to even and ``roundf``
    differ); values 32..63 are a zero block."""
    row = torch.arange(k, dtype=torch.float32) % 64 - 31.5
    row[::32] = 127.0
    row[32:64] = 0.0
    return row


def _oracle_q8(x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    rows = [ref.quantize_q8_0(r) for r in x.tolist()]
    return [c for c, _ in rows], [s for _, s in rows]


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_codes_and_scales_match_the_oracle(kind: str) -> None:
    x = make(kind, (4, 128), torch.float32, seed=KINDS.index(kind))
    codes, scales = ggml_cpu.quantize_q8_0(x)
    want_codes, want_scales = _oracle_q8(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert codes.tolist() == want_codes
    assert scales.float().tolist() == want_scales


def test_q8_0_ties_go_to_even_not_away() -> None:
    x = ties_row().reshape(1, -1)
    codes, scales = ggml_cpu.quantize_q8_0(x)
    want_codes, want_scales = _oracle_q8(x)
    assert codes.tolist() == want_codes and scales.float().tolist() == want_scales
    assert codes[0, 1].item() == -30 and codes[0, 2].item() == -30  # -30.5 -> -30, -29.5 -> -30
    away, _ = ref.quantize_q8_0_ref(x[0].tolist())
    assert away[1] == -31 and away[2] == -30  # ggml_quantize_chunk's roundf differs here
    assert codes[0, 32:64].eq(0).all() and scales[0, 1].item() == 0.0  # the zero block


def test_q8_0_bytes_are_ggml_blocks() -> None:
    x = make("normal", (2, 64), torch.float32, seed=3)
    codes, scales = ggml_cpu.quantize_q8_0(x)
    raw = ggml_cpu.q8_0_blocks(codes, scales)
    assert raw.shape == (2, 68) and raw.dtype == torch.uint8
    first = raw[0, :34]
    assert torch.equal(first[:2].view(torch.float16), scales[0, :1])
    assert torch.equal(first[2:].view(torch.int8), codes[0, :32])


def test_q8_0_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match=r"float32.*\.float\(\)"):
        ggml_cpu.quantize_q8_0(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_cpu.quantize_q8_0(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="1 non-finite"):
        ggml_cpu.quantize_q8_0(torch.tensor([float("nan")] + [0.0] * 31))


def test_ue4m3_matches_ggml_for_every_byte() -> None:
    got = ggml_cpu.ue4m3_values(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert got.tolist() == [ref.ue4m3(b) for b in range(256)]
    e4m3 = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(ggml_cpu.ue4m3_values(e4m3), e4m3.float() / 2)  # halved E4M3


def test_fma_is_one_rounding() -> None:
    # a*b + c = 1 + 3*2^-24 - 12*2^-58: just below the float32 midpoint 1 + 3*2^-24. Rounding
    # the float64 sum first lands ON the midpoint and then goes to even (1 + 2^-22): wrong.
    a = torch.tensor([16711935 * 2.0**-58], dtype=torch.float32)
    b = torch.tensor([3084.0])
    c = torch.tensor([1.0])
    exact = ref.round_f32(Fraction(a.item()) * 3084 + 1)
    assert exact == 1 + 2.0**-23
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2.0**-22
    assert ggml_cpu.fma_f32(a, b, c).item() == exact
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, generator=g) * 1e-3
    b = torch.randint(-6096, 6097, (4000,), generator=g).float()
    c = torch.randn(4000, generator=g)
    want = [
        ref.round_f32(Fraction(x) * int(y) + Fraction(z))
        for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)
    ]
    assert ggml_cpu.fma_f32(a, b, c).tolist() == want


def _oracle_dot(
    weight: torch.Tensor, q8: torch.Tensor, d: torch.Tensor, fn: object = ref.vec_dot_nvfp4_q8_0
) -> torch.Tensor:
    codes = unpack_fp4(weight.packed)
    raw = weight.scales.view(torch.uint8)
    return torch.tensor(
        [
            [
                fn(codes[n].tolist(), raw[n].tolist(), q8[m].tolist(), d[m].float().tolist())  # type: ignore[operator]
                for n in range(codes.shape[0])
            ]
            for m in range(q8.shape[0])
        ],
        dtype=torch.float32,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_vec_dot_matches_the_oracle(kind: str) -> None:
    seed = 10 + KINDS.index(kind)
    w = quantize(make(kind, (6, 192), torch.float32, seed=seed))
    x = make(kind, (3, 192), torch.float32, seed=seed + 100)
    q8, d = ggml_cpu.quantize_q8_0(x)
    got = ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8, d)
    assert torch.equal(got, _oracle_dot(w, q8, d))


def test_the_generic_order_differs_from_avx2() -> None:
    w = quantize(make("student_t", (16, 512), torch.float32, seed=5))
    q8, d = ggml_cpu.quantize_q8_0(make("student_t", (4, 512), torch.float32, seed=6))
    avx2 = ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8, d)
    generic = _oracle_dot(w, q8, d, ref.vec_dot_nvfp4_q8_0_generic)
    assert not torch.equal(avx2, generic)  # two float orders: which build runs matters
    assert torch.allclose(avx2, generic, rtol=1e-5, atol=1e-5 * avx2.abs().max().item())


def test_vec_dot_chunks_rows_without_changing_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    w = quantize(make("normal", (8, 128), torch.float32, seed=7))
    q8, d = ggml_cpu.quantize_q8_0(make("normal", (9, 128), torch.float32, seed=8))
    # the eager path (native=False) is the one that chunks: the C++ dot never reads _CHUNK_ELEMENTS
    whole = ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8, d, native=False)
    monkeypatch.setattr(ggml_cpu, "_CHUNK_ELEMENTS", 1)  # one activation row per chunk
    chunked = ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8, d, native=False)
    assert torch.equal(chunked, whole)
    empty = ggml_cpu.vec_dot_nvfp4_q8_0(w.packed, w.scales, q8[:0], d[:0], native=False)
    assert empty.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_q8_0_is_ggml_times_the_sidecar(dtype: torch.dtype) -> None:
    w = quantize(make("normal", (5, 128), torch.float32, seed=9))
    x = make("outliers", (2, 3, 128), torch.float32, seed=10).to(dtype)
    bias = torch.randn(5, generator=torch.Generator().manual_seed(1)).to(dtype)
    q8, d = ggml_cpu.quantize_q8_0(x.reshape(-1, 128).float())
    want = _oracle_dot(w, q8, d) * vllm_decode_scale(w)
    got = linear(x, w, bias, backend=Backend.Q8_0)
    assert got.shape == (2, 3, 5) and got.dtype == dtype
    assert torch.equal(got.reshape(-1, 5), want.to(dtype) + bias)
    got32 = linear(x, w, bias, backend=Backend.Q8_0, bias_mode=BiasMode.FP32)
    assert torch.equal(got32.reshape(-1, 5), (want + bias.float()).to(dtype))


def test_linear_q8_0_needs_llama_cpp_blocks() -> None:
    w = quantize(make("normal", (4, 96), torch.float32, seed=2))
    with pytest.raises(ValueError, match=r"K=96.*multiple of 64.*emulation"):
        linear(torch.zeros(1, 96), w, backend=Backend.Q8_0)
