"""GPTQ's C++ column loop (``kernels/gptq_columns``) bit for bit against the eager loop it
replaces: whole GPTQ runs with every option, weight dtype and awkward shape, codes, scales and
weights compared with ``torch.equal``; one group against the eager statements (NaN and
infinities included); its E2M1 rounding over every bfloat16 value and the boundaries; the orders
it leaves to the eager loop."""

from __future__ import annotations

import pytest
import torch

from nvfp4lab.blocks import fixed_scale_codec, multiply_factors
from nvfp4lab.constants import E2M1_MAX
from nvfp4lab.e2m1 import e2m1_table, round_to_e2m1_codes
from nvfp4lab.execution import gptq
from nvfp4lab.execution.gptq import GPTQOptions, gptq_fake_quantize, gptq_quantize
from nvfp4lab.kernels import native
from nvfp4lab.kernels.gptq_columns import run_group
from nvfp4lab.orders import ORDERS
from nvfp4lab.vocab import OrderName

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native C++ library cannot be built here"
)


def _eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "usable", lambda device: False)


def _hessian(k: int, seed: int, *, dead: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * k, k, generator=g) * torch.logspace(-1, 1, k)  # uneven channels
    x[:, :dead] = 0  # inputs that never fire
    return x.T @ x


def _weight(n: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[: n // 4, :16] *= 300.0  # a loud block: others near the scale floor
    w[n // 4 : n // 2, 16:32] = 0.0  # an all-zero block: block scale 0, multiplier 0
    return w.to(dtype)


def _same(a: gptq.GPTQResult, b: gptq.GPTQResult) -> None:
    assert a.weight is not None and b.weight is not None
    assert torch.equal(a.weight.packed, b.weight.packed)
    assert torch.equal(a.weight.scales.view(torch.uint8), b.weight.scales.view(torch.uint8))
    assert torch.equal(a.weight.global_scale, b.weight.global_scale)
    assert (a.dead_columns, a.fallback) == (b.dead_columns, b.fallback)


OPTIONS = {
    "default": GPTQOptions(),
    "act_order": GPTQOptions(act_order=True),
    "updated": GPTQOptions(scales="updated"),
    "block48": GPTQOptions(block_size=48),
    "damp0.1": GPTQOptions(damp=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize(("n", "k"), [(96, 160), (7, 48)])
def test_gptq_equals_the_eager_loop(n: int, k: int, name: str, dtype: torch.dtype,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    w, h = _weight(n, k, n + k, dtype), _hessian(k, k, dead=3)
    fast = gptq_quantize(w, h, options=OPTIONS[name])
    fast_fake = gptq_fake_quantize(w, h, options=OPTIONS[name])
    _eager(monkeypatch)
    _same(fast, gptq_quantize(w, h, options=OPTIONS[name]))
    assert torch.equal(fast_fake, gptq_fake_quantize(w, h, options=OPTIONS[name]))


@pytest.mark.parametrize("name", ["default", "act_order", "updated"])
def test_the_float64_work_matrix_ends_bit_for_bit_the_same(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the codes: the loop's float64 weight rows after every column's error has been
    spread (one ulp of a product fused into a subtract would show here)."""
    options = OPTIONS[name]
    order = ORDERS[OrderName.VLLM_KERNEL]
    w = _weight(64, 384, 5, torch.float32)  # three blocks of 128: later blocks get the errors
    h = _hessian(384, 6).double()
    perm = (torch.argsort(h.diagonal(), descending=True, stable=True) if options.act_order
            else torch.arange(384))
    u = gptq._inverse_factor(h[perm][:, perm], options.damp)
    assert u is not None
    cols = gptq._NVFP4Columns(gptq._tensor_scale(w, None, order), order)
    groups = (perm // 16).tolist()

    def loop() -> tuple[torch.Tensor, ...]:
        scales = cols.scales(w)
        wt = w.double().T[perm].contiguous()
        q, codes = gptq._gptq_loop(wt, u, cols, groups, scales, options)
        return wt, q, codes, scales

    fast = loop()
    _eager(monkeypatch)
    for a, b in zip(fast, loop(), strict=True):
        assert torch.equal(a, b)


def test_the_native_loop_runs_once_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ call is what runs (counted), once per group of 16 columns."""
    import nvfp4lab.kernels.gptq_columns as module

    calls: list[int] = []
    real = module.run_group

    def counted(*args: torch.Tensor) -> bool:
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(gptq, "run_group", counted)
    gptq_quantize(_weight(32, 96, 0, torch.float32), _hessian(96, 1))
    assert calls == [16] * 6


@pytest.mark.parametrize("per_column", [False, True])
def test_one_group_equals_the_eager_statements(per_column: bool) -> None:
    """``run_group`` against the eager loop's own statements for one group (as in
    ``gptq._gptq_loop``): the updated rows, values, codes and errors, bit for bit."""
    g = torch.Generator().manual_seed(3)
    m, n = 16, 777
    block = torch.randn(m, n, generator=g, dtype=torch.float64) * 3.0
    block[0, 7] = block[5, 8] = float("nan")  # code 0, as round_to_e2m1_codes gives it
    block[3, 9], block[4, 10] = float("inf"), -1e300  # saturate (-1e300: -inf in float32)
    u = torch.randn(m, m, generator=g, dtype=torch.float64).triu() * 0.3 + torch.eye(
        m, dtype=torch.float64) * 1.7
    u = u.T.contiguous().T  # column-major strides, as a factor may come back
    shape = (m, n) if per_column else (n,)
    multipliers = torch.rand(shape, generator=g) * 4.0
    multipliers[..., :5] = 0.0  # all-zero blocks
    factors = torch.rand(shape, generator=g) * 0.5
    q, codes = torch.empty(m, n), torch.empty(m, n, dtype=torch.uint8)
    errors = torch.empty(m, n, dtype=torch.float64)
    native_block = block.clone()
    run_group(native_block, u, multipliers, factors, q, codes, errors)

    table = e2m1_table()
    diagonal = u.diagonal().tolist()
    expected = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        mult = multipliers[i] if per_column else multipliers
        fac = factors[i] if per_column else factors
        c = round_to_e2m1_codes((block[i].to(torch.float32) * mult).clamp_(-E2M1_MAX, E2M1_MAX))
        value = table[c.long()] * fac
        assert torch.equal(codes[i], c) and torch.equal(q[i].view(torch.int32),
                                                        value.view(torch.int32))
        expected[i] = (block[i] - value.to(torch.float64)) / diagonal[i]
        block[i + 1 :].sub_(u[i, i + 1 :, None] * expected[i])
    assert codes[0, 7] == 0 and codes[3, 9] == 7 and codes[4, 10] == 15
    assert torch.equal(errors.nan_to_num(1.5), expected.nan_to_num(1.5))
    assert torch.equal(native_block.nan_to_num(1.5), block.nan_to_num(1.5))
    assert torch.equal(errors.isnan(), expected.isnan()) and errors.isnan().any()


def test_rounding_of_every_bfloat16_value_and_the_boundaries() -> None:
    """One column through the C++ loop at multiplier 1 and factor 1 (u = 1): its codes are
    ``round_to_e2m1_codes(clamp(x, -6, 6))`` and its values the E2M1 table's."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16).float()
    every = every[~every.isnan()]
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e30, float("inf")])
    near = torch.cat([grid, grid.nextafter(torch.zeros(())), grid.nextafter(grid * 2)])
    x = torch.cat([every, near, -near, torch.tensor([0.0, -0.0, 1e-45, -1e-45])])
    n = x.numel()
    q, codes = torch.empty(1, n), torch.empty(1, n, dtype=torch.uint8)
    errors = torch.empty(1, n, dtype=torch.float64)
    ones = torch.ones(n)
    run_group(x.double()[None].clone(), torch.ones(1, 1, dtype=torch.float64), ones, ones, q,
              codes, errors)
    expected = round_to_e2m1_codes(x.clamp(-E2M1_MAX, E2M1_MAX))
    assert torch.equal(codes[0], expected)
    assert torch.equal(q[0].view(torch.int32), e2m1_table()[expected.long()].view(torch.int32))


@pytest.mark.parametrize("convention", list(OrderName))
def test_multiply_factors_are_the_codecs_numbers(convention: OrderName) -> None:
    """For the kernel order, the multiplier and factor reproduce ``fixed_scale_codec`` bit for
    bit (subnormal, zero and plain scales); the other orders are left to the eager loop."""
    order = ORDERS[convention]
    scales = torch.tensor([0.0, 2.0**-9, 0.375, 1.0, 448.0, 6.0, 2.0**-6, 30.0])[:, None]
    scale = torch.tensor([3.7e3])
    found = multiply_factors(scales, scale, order)
    if convention is not OrderName.VLLM_KERNEL:
        assert found is None
        return
    assert found is not None
    multiplier, factor = found
    blocks = torch.randn(8, 1, 16) * torch.logspace(-4, 1, 8)[:, None, None]
    encode, decode = fixed_scale_codec(scales, scale, order)
    codes = encode(blocks)
    mine = round_to_e2m1_codes((blocks * multiplier[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
    assert torch.equal(codes, mine)
    assert torch.equal(decode(codes).view(torch.int32),
                       (e2m1_table()[codes.long()] * factor[..., None]).view(torch.int32))


def test_bad_arguments_are_named() -> None:
    block = torch.zeros(2, 4, dtype=torch.float64)
    ones = torch.ones(4)
    out = (torch.empty(2, 4), torch.empty(2, 4, dtype=torch.uint8),
           torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"block must be a contiguous CPU torch\.float64"):
        run_group(block.float(), torch.eye(2, dtype=torch.float64), ones, ones, *out)
    with pytest.raises(ValueError, match=r"u must be a CPU float64 \[2, 2\]"):
        run_group(block, torch.eye(3, dtype=torch.float64), ones, ones, *out)
    with pytest.raises(ValueError, match="multipliers must be"):
        run_group(block, torch.eye(2, dtype=torch.float64), ones.double(), ones, *out)
