"""vLLM's rotated NVFP4 paths (execution/rotated_gemm.py) against a slow oracle written here from
the facts (vLLM 0.33.0's transform code, QuTLASS's fusedQuantizeNvAbsMax epilogue, hadacore's
stages): float64 sums per element (math.fsum), float32 / bf16 / E4M3 / E2M1 rounding by hand."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from nvfp4lab.codec import quantize
from nvfp4lab.execution import rotated_gemm as RG
from nvfp4lab.execution.dispatch import select_backend
from nvfp4lab.execution.vllm_transform import RotationSpec, rotation_spec

# -- the oracle's number formats ----------------------------------------------------------------


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def bf16(v: float) -> float:
    """float32 -> bfloat16, round to nearest even on the dropped 16 bits."""
    bits = struct.unpack("I", struct.pack("f", f32(v)))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]


E4M3 = sorted({m * 2.0**-9 for m in range(8)} | {(1 + m / 8) * 2.0**e for e in range(-6, 9)
                                                 for m in range(8) if (1 + m / 8) * 2.0**e <= 448})
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(v: float, grid: list[float]) -> float:
    """Round |v| to the grid, ties to the even index, saturating; keeps the sign."""
    a = min(abs(v), grid[-1])
    i = min(range(len(grid)), key=lambda j: (abs(grid[j] - a), j % 2))
    return math.copysign(grid[i], v)


def sylvester(n: int) -> list[list[int]]:
    return [[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]


def oracle_qutlass(x: list[list[float]], h: list[list[float]], unrounded: bool
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """Decoded activations (code value * E4M3 scale) and the E4M3 scales, QuTLASS's order."""
    b = len(h)
    r6 = f32(1 / f32(6.0))
    values, scales = [], []
    for row in x:
        y = [f32(math.fsum(row[g + i] * h[i][j] for i in range(b)))
             for g in range(0, len(row), b) for j in range(b)]
        vrow, srow = [], []
        for s in range(0, len(y), 16):
            blk = y[s:s + 16]
            sf = f32(6.0 * f32(max(abs(v) for v in blk) * r6))
            sfq = nearest_even(min(sf, 448.0), E4M3)
            used = sf if unrounded else sfq
            inv = f32(1 / f32(used * r6)) if used else 0.0
            vrow += [nearest_even(f32(v * inv), E2M1) * sfq for v in blk]
            srow.append(sfq)
        values.append(vrow)
        scales.append(srow)
    return values, scales


def weight_values(w) -> list[list[float]]:
    codes = w.packed.to(torch.int64)
    lo, hi = codes & 15, codes >> 4
    c = torch.stack((lo, hi), -1).reshape(w.shape[0], -1).tolist()
    s = w.scales.to(torch.float32).tolist()
    return [[math.copysign(E2M1[v & 7], -1.0 if v & 8 else 1.0) * s[r][k // 16]
             for k, v in enumerate(cr)] for r, cr in enumerate(c)]


def oracle_gemm(a: list[list[float]], w: list[list[float]], alpha: float) -> list[list[float]]:
    return [[f32(f32(math.fsum(p * q for p, q in zip(ar, wr, strict=True))) * alpha)
             for wr in w] for ar in a]


# -- fixtures ---------------------------------------------------------------------------------


def _data(k: int, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, k, generator=g) * 2).to(torch.bfloat16)
    x[1, 5] = 40.0  # an outlier the rotation spreads
    stored = torch.tensor(sylvester(b), dtype=torch.float32)
    w = quantize(torch.randn(4, k, generator=g, dtype=torch.bfloat16))
    return x, stored, w


# -- QuTLASS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("b", [16, 32, 64, 128])
def test_qutlass_linear_equals_the_oracle_bit_for_bit(b: int) -> None:
    x, stored, w = _data(128, b, seed=b)
    h = RG.vllm_rotation_matrix(stored, torch.bfloat16)
    expected_h = [[bf16(v / math.sqrt(b)) for v in row] for row in sylvester(b)]
    assert h.to(torch.float32).tolist() == expected_h
    unrounded = b == 128  # QuTLASS's SM100 kernel in vLLM 0.33.0's build
    _, scales = RG.qutlass_quantize(x, h, unrounded_scale=unrounded)
    a_values, a_scales = oracle_qutlass(x.float().tolist(), expected_h, unrounded)
    assert scales.to(torch.float32).tolist() == a_scales
    out = RG.qutlass_linear(x, w, h)
    alpha = f32(f32(1 / float(w.global_scale)) / f32(6.0))
    ref = oracle_gemm(a_values, weight_values(w), alpha)
    assert torch.equal(out, torch.tensor(ref).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4)


def test_the_two_epilogues_differ_and_the_product_approximates_x_wt() -> None:
    x, stored, _ = _data(128, 128, seed=3)
    h = RG.vllm_rotation_matrix(stored)
    rounded = RG.qutlass_quantize(x, h)[0]
    unrounded = RG.qutlass_quantize(x, h, unrounded_scale=True)[0]
    assert not torch.equal(rounded, unrounded)  # the SM100 kernel's codes differ
    # the rotated-back product approximates the unrotated float product (W stored as W·R)
    w_float = torch.randn(4, 128, generator=torch.Generator().manual_seed(9))
    r = torch.block_diag(*[torch.tensor(sylvester(128), dtype=torch.float64) / math.sqrt(128)])
    wq = quantize((w_float.double() @ r).float())
    out = RG.qutlass_linear(x, wq, h).float()
    exact = x.double() @ w_float.double().T
    assert (out.double() - exact).norm() / exact.norm() < 0.15


def test_qutlass_refusals_name_the_value() -> None:
    x, stored, w = _data(64, 16)
    h = RG.vllm_rotation_matrix(stored)
    with pytest.raises(ValueError, match="A must be bf16"):
        RG.qutlass_linear(x.to(torch.float16), w, h)
    with pytest.raises(ValueError, match="bias is None"):
        RG.qutlass_linear(x, w, h, torch.zeros(4))
    with pytest.raises(ValueError, match="blocks"):
        RG.qutlass_quantize(x, RG.vllm_rotation_matrix(torch.ones(8, 8)))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        RG.qutlass_quantize(bad, h)


# -- the generic path -------------------------------------------------------------------------


@pytest.mark.parametrize("b", [16, 32, 128])
def test_hadacore_stages_equal_the_oracle(b: int) -> None:
    x = _data(2 * b, b, seed=b)[0]
    got = RG.hadacore_rotate(x, b).float().tolist()
    c = {2: 0.70703125, 4: 0.5, 8: 0.353515625, 16: 0.25}
    h16, m = sylvester(16), b // 16
    for row, grow in zip(x.float().tolist(), got, strict=True):
        for g0 in range(0, len(row), b):
            s1 = [[bf16(f32(math.fsum(row[g0 + a * 16 + i] * h16[i][j] * 0.25
                                      for i in range(16)))) for j in range(16)]
                  for a in range(m)]
            if m > 1:
                hm = sylvester(m)
                s1 = [[bf16(f32(math.fsum(hm[a][a2] * c[m] * s1[a2][j] for a2 in range(m))))
                       for j in range(16)] for a in range(m)]
            assert grow[g0:g0 + b] == [v for blk in s1 for v in blk]


def test_dense_rotation_and_generic_linear_equal_the_oracle() -> None:
    x, stored, w = _data(64, 32, seed=5)
    h = RG.vllm_rotation_matrix(stored)
    hv = h.float().tolist()
    got = RG.dense_rotate(x, h, inverse=True).float().tolist()
    for row, grow in zip(x.float().tolist(), got, strict=True):
        ref = [bf16(f32(math.fsum(row[g + i] * hv[j][i] for i in range(32))))
               for g in range(0, 64, 32) for j in range(32)]
        assert grow == ref
    gs = torch.tensor([2688.0 / 3.0])
    out = RG.generic_linear(x, w, h, hadacore=False, input_global_scale=gs)
    from nvfp4lab.execution.gemm import linear
    assert torch.equal(out, linear(RG.dense_rotate(x, h), w, input_global_scale=gs,
                                   backend="emulation"))
    with pytest.raises(ValueError, match="bias is None"):
        RG.generic_linear(x, w, h, torch.zeros(4), hadacore=True)


def test_rotation_is_its_own_inverse_in_float64() -> None:
    for b in (16, 32, 64, 128):
        m = torch.tensor(sylvester(b), dtype=torch.float64)
        assert torch.equal(m @ m.T, b * torch.eye(b, dtype=torch.float64))


# -- the selection and the layer ----------------------------------------------------------------


def test_rotation_spec_parses_and_refuses() -> None:
    assert rotation_spec("input:hadamard-16") == RotationSpec("hadamard", 16)
    assert rotation_spec("random-hadamard-128") == RotationSpec("random-hadamard", 128)
    assert rotation_spec("hadamard").block is None
    for bad in ("weight_input:hadamard-16", "input:fourier-16", "input:hadamard-12"):
        with pytest.raises(ValueError, match="rotation"):
            rotation_spec(bad)
    with pytest.raises(TypeError):
        rotation_spec(16)


def test_plan_follows_select_backend() -> None:
    plan = RG.plan_for("input:hadamard-128", gpu="B200", vllm="0.33.0")
    assert plan == RG.VllmRotationPlan("qutlass", False, True, plan.backend)
    h100 = RG.plan_for("input:hadamard-64", gpu="H100", vllm="0.33.0")
    assert h100.path == "generic" and h100.hadacore and h100.backend == "w4a16"
    with pytest.raises(ValueError, match="does not read transform_config"):
        RG.plan_for("input:hadamard-16", gpu="B200", vllm="0.9.1")
    choice = select_backend(gpu="B200", vllm="0.33.0", rotation="input:random-hadamard-32")
    assert choice.transform.gemm_backend == "cute-dsl" and "qutlass path" in choice.reason


def test_rotated_layer_runs_vllms_path() -> None:
    hadamard = pytest.importorskip("nvfp4lab.hadamard")
    if not hasattr(hadamard, "ct_rotation"):
        pytest.skip("compressed-tensors rotations (BlockRotation) are not in this tree")
    from nvfp4lab.execution.layers import NVFP4Linear

    rot = hadamard.ct_rotation("hadamard", 32)
    lin = torch.nn.Linear(64, 8, bias=False, dtype=torch.bfloat16)
    layer = NVFP4Linear.from_linear(lin, hadamard=rot, backend="emulation")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plans = RG.use_vllm_rotation(torch.nn.Sequential(layer), gpu="RTX 5090", vllm="0.33.0")
    assert plans["0"].path == "qutlass"
    h = RG.vllm_rotation_matrix(rot.matrix(torch.float32), torch.bfloat16)
    out = layer(x)
    assert torch.equal(out, RG.qutlass_linear(x, layer._gemm_weight(), h))
    layer.set_input_global_scale(1.0)  # QuTLASS does not read the static activation scale
    assert torch.equal(layer(x), out)
    layer.vllm_rotation = None
    assert layer(x).shape == (2, 5, 8)
